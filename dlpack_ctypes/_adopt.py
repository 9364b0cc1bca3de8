"""Taking over a ``DLManagedTensorVersioned*`` the caller already owns (private).

The DLPack C exchange API hands its consumer an owning pointer, not a capsule. :func:`adopt`
wraps one in a :class:`~dlpack_ctypes.consumer.DLPackTensor`, validated as a consumed capsule
is, and calls the producer's deleter exactly once on every failure path. It reads the common
tensor with one struct read (:func:`_fill_exchanged`) and leaves anything else to
:func:`dlpack_ctypes._tensor.fill`. Shared with :mod:`dlpack_ctypes.exchange` only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Container
from typing import Final

from dlpack_ctypes import _capi
from dlpack_ctypes._owned import arm, owns
from dlpack_ctypes._shapes import C_STRIDES, MAX_NDIM, c_strides
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

__all__ = ["Accepts", "adopt", "release_versioned"]

#: ``(dtypes, device types)`` a consumer's check passes in every C-contiguous tensor.
Accepts = tuple[Container[tuple[int, int, int]], Container[int]]

_MEM: Final = _capi.MEM
# Header and DLTensor of a DLManagedTensorVersioned at once (80 bytes; see _fill_exchanged).
_unpack_exchanged: Final = struct.Struct("@IIPPQPiiiBBHPPQ").unpack_from
_new_tensor: Final = object.__new__
_MAX_ADDRESS: Final = 2**64 - 1


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
    dtype = VALID_DTYPES.get((code, bits, lanes))
    dev = DEVICE_ENUM.get(dev_type)
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
    unpack = INT64S[ndim]
    shape = unpack(_MEM, shape_ptr)
    if shape not in POSITIVE_SHAPES:
        return None
    strides = C_STRIDES.get(shape) or c_strides(shape)
    if strides_ptr and unpack(_MEM, strides_ptr) != strides:
        return None
    tensor.version = VERSIONS.get(minor) or (major, minor)
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
    accepts: Accepts | None = None,
) -> DLPackTensor:
    """Wrap a ``DLManagedTensorVersioned*`` that the caller owns (no capsule involved).

    Ownership passes to this function on entry: on success the returned tensor calls the
    deleter exactly once when it is released; on every failure (invalid tensor, ``check``
    raising, an asynchronous exception, ``MemoryError``) the deleter is called exactly once
    before the error propagates. Call it immediately after obtaining ``ptr``.

    ``accepts`` is ``(dtypes, device types)`` that ``check`` passes in every C-contiguous
    tensor: such a tensor, read on the one-read path, skips the call of ``check``.

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
        elif check is not None and (
            accepts is None
            or tensor.dtype not in accepts[0]
            or tensor.device[0] not in accepts[1]
        ):
            check(tensor)  # where fill() calls it: every field set, the dtype known valid
        # owned from the registry entry on: the finaliser releases it
        if deleter:
            arm(tensor, DELETERS.get(deleter) or deleter_for(deleter), ptr)
        else:
            tensor._fn = False
    except BaseException:
        # Interrupted before the tensor owned the struct: it is released here.
        if not owns(tensor):
            release_versioned(ptr)
        raise
    return tensor


def release_versioned(ptr: int) -> None:
    """Call the deleter of the ``DLManagedTensorVersioned`` at ``ptr`` (if it has one).

    For a struct this process owns and will not adopt. The major-version rule allows calling
    the deleter of any version ("it is safe to do so").
    """
    deleter = unpack_versioned_head(_MEM, ptr)[3]
    if deleter:
        deleter_for(deleter)(ptr)
