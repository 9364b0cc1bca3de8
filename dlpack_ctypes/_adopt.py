"""Taking over a ``DLManagedTensorVersioned*`` the caller already owns (private).

The DLPack C exchange API hands its consumer an owning pointer, not a capsule. :func:`adopt`
wraps one in a :class:`~dlpack_ctypes.consumer.DLPackTensor`, validated as a consumed capsule
is, and calls the producer's deleter exactly once on every failure path; :func:`adopt_mapped`
does the same for consumers with their own dtype and device tables (pb_tensor's Triton rules).
Both read the common tensor with one struct read (:func:`_fill_exchanged`) and leave anything
else to :func:`dlpack_ctypes._tensor.fill`. Shared with :mod:`dlpack_ctypes.exchange` only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final, TypeVar

from dlpack_ctypes import _capi
from dlpack_ctypes._blocks import C_STRIDES, MAX_NDIM, c_strides
from dlpack_ctypes._tensor import (
    DELETERS,
    DEVICE_ENUM,
    INT64S,
    POSITIVE_SHAPES,
    VALID_DTYPES,
    VERSIONS,
    DLPackTensor,
    deleter_for,
    fill,
    unpack_versioned_head,
)
from dlpack_ctypes.abi import DLPACK_FLAG_BITMASK_READ_ONLY

__all__ = ["adopt", "adopt_mapped", "release_versioned"]

_MEM: Final = _capi.MEM
# Header and DLTensor of a DLManagedTensorVersioned at once (80 bytes; see _fill_exchanged).
_unpack_exchanged: Final = struct.Struct("@IIPPQPiiiBBHPPQ").unpack_from
_new_tensor: Final = object.__new__
_MAX_ADDRESS: Final = 2**64 - 1
_VALID_DTYPES: Final = VALID_DTYPES
_POSITIVE_SHAPES: Final = POSITIVE_SHAPES
_DEVICE_ENUM: Final = DEVICE_ENUM
_INT64S: Final = INT64S
_VERSIONS: Final = VERSIONS
_C_STRIDES: Final = C_STRIDES
_c_strides: Final = c_strides
_FOREIGN_DELETERS: Final = DELETERS
_unpack_versioned: Final = unpack_versioned_head


def _fill_exchanged(tensor: DLPackTensor, ptr: int) -> int | None:
    """:func:`fill` for the common tensor an exchange table makes, or None to call fill().

    Common: a valid dtype and device type, 1 to 64 dimensions already seen all positive, C
    strides (given or NULL), data set. The whole struct is read at once, which is safe here
    only: an exchange table of major version 1 makes DLPack 1.x structs, all of this size (a
    capsule's struct is read in two steps, its version first). Anything else, including a
    version other than 1.x, is left to fill(), which checks it all in order.
    """
    (major, minor, _ctx, deleter, flags, data, dev_type, dev_id, ndim, code, bits, lanes,
     shape_ptr, strides_ptr, byte_offset) = _unpack_exchanged(_MEM, ptr)  # fmt: skip
    dtype = _VALID_DTYPES.get((code, bits, lanes))
    dev = _DEVICE_ENUM.get(dev_type)
    if (
        major != 1
        or dtype is None
        or dev is None
        or not data
        or not 0 < ndim <= MAX_NDIM
        or not shape_ptr
        or data + byte_offset > _MAX_ADDRESS
    ):
        return None
    unpack = _INT64S[ndim]
    shape = unpack(_MEM, shape_ptr)
    if shape not in _POSITIVE_SHAPES:
        return None
    strides = _C_STRIDES.get(shape) or _c_strides(shape)
    if strides_ptr and unpack(_MEM, strides_ptr) != strides:
        return None
    tensor.version = _VERSIONS.get(minor) or (major, minor)
    tensor.readonly = (flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0
    tensor.data = data + byte_offset
    tensor.byte_offset = byte_offset
    tensor.device = (dev, dev_id)
    tensor.shape = shape
    tensor.strides = strides
    tensor.flags = flags
    tensor.dtype = dtype
    tensor._addr = ptr
    deleter_address: int = deleter
    return deleter_address


def adopt(
    ptr: int,
    *,
    check: Callable[[DLPackTensor], None] | None = None,
) -> DLPackTensor:
    """Wrap a ``DLManagedTensorVersioned*`` that the caller owns (no capsule involved).

    Ownership passes to this function on entry: on success the returned tensor calls the
    deleter exactly once when it is released; on every failure (invalid tensor, ``check``
    raising, an asynchronous exception, ``MemoryError``) the deleter is called exactly once
    before the error propagates. Call it immediately after obtaining ``ptr``.

    Raises:
        BufferError: see :func:`fill`.
        Exception: whatever ``check`` raises.
    """
    tensor: DLPackTensor | None = None
    try:
        # blank() inlined (this is the exchange import's hot path).
        tensor = _new_tensor(DLPackTensor)
        tensor._fn = None
        tensor._closed = False
        tensor._viewed = False
        tensor.__array_interface__ = None
        deleter = _fill_exchanged(tensor, ptr)
        if deleter is None:
            deleter = fill(tensor, ptr, True, check, False)
        elif check is not None:
            check(tensor)  # where fill() calls it: every field set, the dtype known valid
        # owned from here on: the finaliser releases it
        tensor._fn = [_FOREIGN_DELETERS.get(deleter) or deleter_for(deleter)] if deleter else []
    except BaseException:
        # Interrupted before _fn was first set, or before it was set to the deleter: the
        # tensor does not own the struct, so it is released here.
        if tensor is None or getattr(tensor, "_fn", None) is None:
            release_versioned(ptr)
        raise
    return tensor


_D = TypeVar("_D")
_M = TypeVar("_M")


def adopt_mapped(
    ptr: int,
    dtypes: dict[tuple[int, int, int], _D],
    devices: dict[int, _M],
    check: Callable[[DLPackTensor], None],
) -> tuple[DLPackTensor, _D, _M]:
    """:func:`adopt` for consumers with their own rules, with their tables looked up.

    ``check`` is the consumer's whole rule set; ``dtypes`` and ``devices`` (keyed by dtype and
    by device type) list what it accepts as is. A C-contiguous tensor whose dtype and device type
    are both in them is returned without calling ``check`` (so every such tensor must pass it);
    any other is validated exactly as :func:`adopt` does with ``check``, which must refuse what
    the tables do not list. Ownership and failures are as for :func:`adopt`.

    Returns:
        The tensor and its ``dtypes`` and ``devices`` values.

    Raises:
        BufferError: see :func:`fill`.
        LookupError: ``check`` accepted a tensor whose dtype or device type is not listed.
        Exception: whatever ``check`` raises.
    """
    tensor: DLPackTensor | None = None
    try:
        tensor = _new_tensor(DLPackTensor)
        tensor._fn = None
        tensor._closed = False
        tensor._viewed = False
        tensor.__array_interface__ = None
        deleter = _fill_exchanged(tensor, ptr)
        if deleter is None:
            deleter = fill(tensor, ptr, True, check, False)
            checked = True
        else:
            checked = False
        mapped_dtype = dtypes.get(tensor.dtype)
        mapped_device = devices.get(tensor.device[0])
        if mapped_dtype is None or mapped_device is None:
            if not checked:
                check(tensor)  # the exact error of what the tables do not list
            raise LookupError(
                f"adopt_mapped(): check accepted dtype={tensor.dtype!r} on device type "
                f"{int(tensor.device[0])}, which the tables do not list"
            )
        tensor._fn = [_FOREIGN_DELETERS.get(deleter) or deleter_for(deleter)] if deleter else []
    except BaseException:
        if tensor is None or getattr(tensor, "_fn", None) is None:
            release_versioned(ptr)
        raise
    return tensor, mapped_dtype, mapped_device


def release_versioned(ptr: int) -> None:
    """Call the deleter of the ``DLManagedTensorVersioned`` at ``ptr`` (if it has one).

    For a struct this process owns and will not adopt. The major-version rule allows calling
    the deleter of any version ("it is safe to do so").
    """
    deleter = _unpack_versioned(_MEM, ptr)[3]
    if deleter:
        deleter_for(deleter)(ptr)
