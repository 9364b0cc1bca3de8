"""Export blocks packed and wrapped in fresh capsules: ``export``, ``prepare``, ``export_prepared``.

Each block is registered in :data:`~dlpack_ctypes._blocks.LIVE` and its capsule queued in
:data:`~dlpack_ctypes._blocks.PENDING`, whose sweep releases the ones dropped unconsumed (see
:mod:`dlpack_ctypes._blocks` for the lifetime model).
"""

from __future__ import annotations

import ctypes
import struct
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    # typing_extensions is not a runtime dependency: only annotations use it.
    from typing_extensions import CapsuleType

from dlpack_ctypes import _capi
from dlpack_ctypes._blocks import (
    DELETER_ADDRESS,
    EXPORT_SWEEP_STEP,
    LIVE,
    PENDING,
    SWEEP_LIMIT,
    _locked_sweep,
)
from dlpack_ctypes.abi import DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION

__all__ = [
    "export",
    "export_prepared",
    "prepare",
]

_step = _locked_sweep

# Native alignment ("@") reproduces the C layout; abi.py checks the same offsets at import.
_LEGACY_HEAD = "@PiiiBBHPPQPP"  # DLManagedTensor, 64 bytes
_VERSIONED_HEAD = "@IIPPQPiiiBBHPPQ"  # DLManagedTensorVersioned, 80 bytes
_PACKERS: dict[tuple[bool, int], tuple[Any, Any, int]] = {}


def _packer(versioned: bool, ndim: int) -> tuple[Any, Any, int]:
    key = (versioned, ndim)
    found = _PACKERS.get(key)
    if found is None:
        head = _VERSIONED_HEAD if versioned else _LEGACY_HEAD
        fmt = struct.Struct(head + "q" * (2 * ndim))
        block_type = ctypes.c_int64 * (fmt.size // 8)
        head_size = struct.calcsize(head)
        found = _PACKERS[key] = (fmt.pack_into, block_type, head_size)
    return found


def export(
    owner: object,
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: tuple[int, int, int],
    device: tuple[int, int],
    versioned: bool,
    flags: int,
    _live: Any = LIVE,
    _pending: Any = PENDING,
    _new: Any = _capi.PyCapsule_New,
    _addressof: Any = ctypes.addressof,
) -> CapsuleType:
    """Pack one export block and wrap it in a fresh capsule (no validation: callers check).

    Exception-safe at every step: until the capsule is returned, any exception (including an
    asynchronous one such as ``KeyboardInterrupt``, or ``MemoryError``) releases the export; a
    capsule that already reached the pending queue is then skipped by the sweep, because the
    registry no longer holds its block.
    """
    ndim = len(shape)
    found = _PACKERS.get((versioned, ndim))
    pack, block_type, head = found if found is not None else _packer(versioned, ndim)
    block = block_type()
    addr = _addressof(block)
    dims = addr + head if ndim else 0
    strd = dims + 8 * ndim if ndim else 0
    if versioned:
        pack(block, 0, DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION, 0, DELETER_ADDRESS, flags,
             data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2], dims, strd, 0,
             *shape, *strides)
        name = _capi.ADDR_DLTENSOR_VERSIONED
    else:
        pack(block, 0, data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2],
             dims, strd, 0, 0, DELETER_ADDRESS, *shape, *strides)
        name = _capi.ADDR_DLTENSOR
    # The registry entry is undone unless the capsule reached the pending queue (the sweep
    # then releases it when the caller never got it). A finally clause, not an except one:
    # CPython 3.10 runs a signal handler on entry to an except clause, so a second
    # asynchronous exception there skipped the undo and left the entry for ever; a clause
    # whose first instruction starts a try block is entered without one.
    queued = False
    try:
        _live[addr] = (block, owner)
        capsule: CapsuleType = _new(addr, name, None)
        _pending.append((capsule, block, addr, name))
        queued = True  # no handler point since the append returned
        if len(_pending) > SWEEP_LIMIT:
            # Up to SWEEP_LIMIT entries at once when they are released (the usual case: the
            # consumer let go), so the lock and call overhead is paid once per ~64 exports,
            # not once per 4; still at most EXPORT_SWEEP_STEP held capsules examined.
            _step(SWEEP_LIMIT, EXPORT_SWEEP_STEP)
    finally:
        try:
            if not queued:
                # The capsule never reached the caller, so nobody can have consumed it.
                _live.pop(addr, None)
        finally:
            pass
    return capsule


# Offset of DLTensor.shape in the managed struct (strides follow): the only fields a prepared
# block still needs per export, because they point into the block itself.
_SHAPE_FIELD: Final = {True: 32 + 24, False: 24}
_pack_pointers = struct.Struct("@PP").pack_into


def prepare(
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: tuple[int, int, int],
    device: tuple[int, int],
    versioned: bool,
    flags: int,
) -> tuple[Any, bytes, int, int, int]:
    """Pack an export block once for repeated :func:`export_prepared` calls of the same tensor.

    Returns ``(block type, the packed bytes with NULL shape/strides pointers, offset of the shape
    pointer, offset of the shape array, ndim)``; no validation (callers check, as for
    :func:`export`).
    """
    ndim = len(shape)
    found = _PACKERS.get((versioned, ndim))
    pack, block_type, head = found if found is not None else _packer(versioned, ndim)
    block = block_type()
    if versioned:
        pack(block, 0, DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION, 0, DELETER_ADDRESS, flags,
             data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2], 0, 0, 0,
             *shape, *strides)
    else:
        pack(block, 0, data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2],
             0, 0, 0, 0, DELETER_ADDRESS, *shape, *strides)
    return block_type, bytes(block), _SHAPE_FIELD[versioned], head, ndim


def export_prepared(
    owner: object,
    prepared: tuple[Any, bytes, int, int, int],
    name: int,
    _live: Any = LIVE,
    _pending: Any = PENDING,
    _new: Any = _capi.PyCapsule_New,
    _addressof: Any = ctypes.addressof,
) -> CapsuleType:
    """:func:`export` of a block made by :func:`prepare`: one copy of the packed bytes and the
    two pointers into the block, instead of packing every field (``name``: the capsule name's
    address, :data:`~dlpack_ctypes._capi.ADDR_DLTENSOR_VERSIONED` for a versioned block).

    Exception-safe at every step, exactly as :func:`export` (the steps after the packing are
    the same).
    """
    block_type, packed, field, head, ndim = prepared
    block = block_type.from_buffer_copy(packed)
    addr = _addressof(block)
    if ndim:
        _pack_pointers(block, field, addr + head, addr + head + 8 * ndim)
    queued = False  # the undo of export(), for the same reasons
    try:
        _live[addr] = (block, owner)
        capsule: CapsuleType = _new(addr, name, None)
        _pending.append((capsule, block, addr, name))
        queued = True
        if len(_pending) > SWEEP_LIMIT:
            _step(SWEEP_LIMIT, EXPORT_SWEEP_STEP)
    finally:
        try:
            if not queued:
                _live.pop(addr, None)
        finally:
            pass
    return capsule
