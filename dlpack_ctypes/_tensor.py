"""The consumed tensor and the managed-struct parser (shared privately by the import paths).

:class:`DLPackTensor` is public through :mod:`dlpack_ctypes.consumer`. :func:`fill` validates a
managed tensor and fills a blank DLPackTensor from it; :func:`adopt` is the entry point for
import paths that already own a ``DLManagedTensorVersioned*`` (the DLPack C exchange API): it
validates, wraps, and calls the producer's deleter exactly once on every failure path.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from dlpack_ctypes import _capi
from dlpack_ctypes._blocks import DELETER_ADDRESS, DELETER_TARGET
from dlpack_ctypes._owned import OWNED, release
from dlpack_ctypes._shapes import C_STRIDES, MAX_NDIM, c_strides
from dlpack_ctypes._views import EMPTY_DATA, HOST_DEVICES, VIEW_INFO, ViewOwner, interface
from dlpack_ctypes.abi import (
    DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_READ_ONLY,
    DLDeviceType,
)
from dlpack_ctypes.dtypes import VALID_BITS, DataType

__all__ = [
    "DELETERS",
    "DEVICE_ENUM",
    "DLPackTensor",
    "INT64S",
    "POSITIVE_SHAPES",
    "VALID_DTYPES",
    "VERSIONS",
    "blank",
    "deleter_for",
    "fill",
    "unpack_versioned_head",
]

_MEM: Final = _capi.MEM
_VERSIONED_HEAD = struct.Struct("@IIPPQ")  # version, manager_ctx, deleter, flags
_DLTENSOR = struct.Struct("@PiiiBBHPPQ")  # DLTensor
_LEGACY_DELETER_OFFSET: Final = 56
_VERSIONED_TENSOR_OFFSET: Final = 32
_unpack_versioned = _VERSIONED_HEAD.unpack_from
_unpack_tensor = _DLTENSOR.unpack_from
_unpack_ptr = struct.Struct("@P").unpack_from
_INT64S = [struct.Struct(f"@{n}q").unpack_from for n in range(MAX_NDIM + 1)]
_DEVICE_ENUM: Final = {int(d): d for d in DLDeviceType}
_VERSIONS: Final = {minor: (1, minor) for minor in range(16)}
_asarray: Final = np.asarray
_ndarray: Final = np.ndarray
_ViewOwner: Final = ViewOwner
_C_STRIDES: Final = C_STRIDES
# DataType -> the numpy dtype of its views, for the types numpy has itself (filled by numpy()).
_NATIVE: dict[DataType, np.dtype[Any]] = {}
_c_strides = c_strides
_new_tensor = object.__new__
_release = release
_OWNED = OWNED
_MAX_ADDRESS: Final = 2**64 - 1
# Element strides below this bound give byte strides that fit numpy's intp for any itemsize
# DLPack can describe (bits * lanes / 8 < 2**21); larger ones get the exact check.
_SAFE_STRIDE: Final = 2**41
_INTP_MAX: Final = 2**63 - 1

# Foreign deleters wrapped once per address. They are called with the GIL held, as numpy's and
# Triton's consumers call them (a deleter that touches Python must take the GIL itself anyway,
# and re-taking a held GIL is fine); this saves a GIL release/acquire per tensor.
_FOREIGN_DELETERS: dict[int, Callable[[int], object]] = {DELETER_ADDRESS: DELETER_TARGET}
_capi.immortalize(_FOREIGN_DELETERS)
#: The memo behind :func:`deleter_for` (read-only for callers that inline its lookup).
DELETERS: Final = _FOREIGN_DELETERS


def deleter_for(address: int) -> Callable[[int], object]:
    """A callable for the C deleter at ``address`` (this package's own is called directly)."""
    fn = _FOREIGN_DELETERS.get(address)
    if fn is None:
        thunk = _capi.VOIDFN_GIL(address)
        _capi.immortalize(thunk)
        fn = _FOREIGN_DELETERS[address] = thunk
    return fn


class DLPackTensor:
    """A consumed DLPack tensor: owns the producer's managed tensor until released.

    Attributes:
        data: address of the first element (``byte_offset`` already added).
        byte_offset: the producer's ``byte_offset`` (informational; folded into ``data``).
        device: ``(DLDeviceType, device_id)``.
        dtype: the raw :class:`~dlpack_ctypes.dtypes.DataType`.
        shape: dimensions.
        strides: strides in elements (C-order strides when the producer sent NULL).
        readonly: numpy views are read-only: the producer set READ_ONLY, or the capsule was a
            legacy ``"dltensor"`` one (which cannot say whether writes are allowed) and the
            consumer did not pass ``legacy_writable=True``.
        version: ``(major, minor)`` of a versioned capsule, None for a legacy one.
        flags: the raw flags of a versioned capsule (0 for legacy).
    """

    __slots__ = (
        "__array_interface__",
        "__weakref__",
        "_addr",
        "_closed",
        "_fn",
        "_viewed",
        "byte_offset",
        "data",
        "device",
        "dtype",
        "flags",
        "readonly",
        "shape",
        "strides",
        "version",
    )

    # The tensor is the ``base`` of its numpy views, so it lives as long as they do; its
    # finaliser calls the producer's deleter. _fn is None until the tensor owns the managed
    # tensor, False if that has no deleter, else the weak reference that keys its OWNED entry
    # (see arm()). Every release pops that entry and calls the deleter in one chain of C
    # builtins, so two threads (close() and close(), or close() and the finaliser) can never
    # both call it, and no asynchronous exception can separate the pop from the call.
    __array_interface__: dict[str, Any] | None
    _addr: int
    _fn: Any
    _closed: bool
    # True once numpy() made a view without __array_interface__ (the fast path): close() must
    # then leave the release to the finaliser, as when the interface is set.
    _viewed: bool
    data: int
    byte_offset: int
    device: tuple[DLDeviceType, int]
    dtype: DataType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    readonly: bool
    version: tuple[int, int] | None
    flags: int

    def __new__(cls, *args: object, **kwargs: object) -> DLPackTensor:
        raise TypeError("DLPackTensor is made by dlpack_ctypes.from_dlpack() or consume()")

    def __del__(self) -> None:
        # An exception raised before the release (at this method's first bytecode, say) is
        # lost by CPython, but not the release: the weak reference's callback then hands the
        # tensor to the next sweep (see arm()).
        try:
            ref = self._fn
        except AttributeError:  # made by blank() but interrupted before it set _fn
            return
        if ref:
            # _blocks.release() inlined: subscripts and one call, no signal handler between.
            owned = _OWNED
            try:
                fn = owned[ref]
                del owned[ref]  # the gate: of two threads here, one raises KeyError
            except KeyError:  # released already (close())
                pass
            else:
                fn(self._addr)
            self._fn = None  # the reference dies with its entry gone: no callback, no sweep

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return (
            f"DLPackTensor(shape={self.shape}, dtype={self.dtype!r}, "
            f"device=({self.device[0].name}, {self.device[1]}), readonly={self.readonly}{state})"
        )

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes spanned by the elements, ``size * itemsize``."""
        return self.size * self.dtype.itemsize

    @property
    def is_copied(self) -> bool:
        """The producer set IS_COPIED: this tensor's data is exclusively ours."""
        return bool(self.flags & DLPACK_FLAG_BITMASK_IS_COPIED)

    @property
    def closed(self) -> bool:
        """:meth:`close` was called."""
        return self._closed

    @property
    def released(self) -> bool:
        """The producer's deleter has run (or there was none)."""
        ref = self._fn
        return not ref or ref not in _OWNED

    def is_c_contiguous(self) -> bool:
        """Elements are dense in C order (size-1 dimensions and empty tensors always pass)."""
        if self.size == 0:
            return True
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1:
                if s != expected:
                    return False
                expected *= n
        return True

    def numpy(self, *, raw: bool = False) -> np.ndarray[Any, Any]:
        """A zero-copy numpy view; it keeps the managed tensor alive.

        Args:
            raw: view types numpy lacks (bfloat16 and float8 without ``ml_dtypes``) as unsigned
                integers of the same width instead of raising.

        Raises:
            BufferError: the memory is not host-accessible, the tensor is closed, or numpy has no
                dtype for it (and ``raw`` is False or lanes != 1).
        """
        dtype = _NATIVE.get(self.dtype)
        if (
            dtype is not None
            and self.data
            and not self.readonly
            and self.device[0] in HOST_DEVICES
            and self.strides == _C_STRIDES.get(self.shape)
        ):
            # The common view (writable, C order, a type numpy has) without parsing an
            # __array_interface__: a buffer object at the data keeps this tensor alive and
            # numpy takes it as the view's base. Marked viewed *before* _closed is looked at
            # (see below for why).
            self._viewed = True
            if self._closed:
                raise BufferError("DLPackTensor.numpy: the tensor was closed")
            owner = _ViewOwner.from_address(self.data)
            owner.tensor = self
            view: np.ndarray[Any, Any] = _ndarray(self.shape, dtype, owner)
            return view
        if self.__array_interface__ is None:
            info = VIEW_INFO.get(self.dtype)
            if info is None or self.device[0] not in HOST_DEVICES:
                if self._closed:
                    raise BufferError("DLPackTensor.numpy: the tensor was closed")
                iface = interface(self.data, self.shape, self.strides, self.dtype, self.device,
                                  self.readonly)
                info = VIEW_INFO[self.dtype]
            else:
                # Inlined interface() for the common case: this is the consumer's hot path
                # (a C-order view leaves "strides" out, which numpy parses fastest).
                shape = self.shape
                strides = self.strides
                if strides == _c_strides(shape):
                    iface = {
                        "data": (self.data or EMPTY_DATA, self.readonly),
                        "shape": shape,
                        "typestr": info[0],
                        "version": 3,
                    }
                else:
                    iface = {
                        "data": (self.data or EMPTY_DATA, self.readonly),
                        "shape": shape,
                        "strides": tuple([n * info[1] for n in strides]),
                        "typestr": info[0],
                        "version": 3,
                    }
            # Publish the interface *before* looking at _closed, while close() sets _closed
            # before looking at the interface: whichever runs second sees the other, so either
            # close() leaves the release to the finaliser or this call raises. A view can
            # therefore never be made after (or outlive) the release.
            self.__array_interface__ = iface
        else:
            info = VIEW_INFO[self.dtype]
        if self._closed:
            raise BufferError("DLPackTensor.numpy: the tensor was closed")
        target = info[2]
        if target is True and self.dtype not in _NATIVE:
            _NATIVE[self.dtype] = np.dtype(info[0])
        try:
            arr: np.ndarray[Any, Any] = _asarray(self)
        except (ValueError, OverflowError) as exc:
            raise BufferError(f"DLPackTensor.numpy: numpy cannot view {self!r}: {exc}") from exc
        if target is True or raw:
            return arr
        if target is None:
            raise BufferError(
                f"DLPackTensor.numpy: numpy has no dtype for {self.dtype!r}; install "
                "ml_dtypes for bfloat16/float8, or pass raw=True for an integer view"
            )
        return arr.view(target)

    def close(self) -> None:
        """Release the managed tensor now, or as soon as possible.

        If :meth:`numpy` was never called, the producer's deleter runs now. Otherwise views may
        still use the memory, so it runs when the last of them (and this object) is gone; further
        :meth:`numpy` calls raise either way. Idempotent and safe to call from several threads.
        """
        self._closed = True
        if self.__array_interface__ is None and not self._viewed:
            ref = self._fn
            if ref:
                _release(ref, self._addr)

    def __enter__(self) -> DLPackTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def blank() -> DLPackTensor:
    """A DLPackTensor that owns nothing yet (its finaliser does nothing until ``_fn`` is set)."""
    tensor: DLPackTensor = _new_tensor(DLPackTensor)
    tensor._fn = None
    tensor._closed = False
    tensor._viewed = False
    tensor.__array_interface__ = None
    return tensor


def fill(
    tensor: DLPackTensor,
    ptr: int,
    versioned: bool,
    check: Callable[[DLPackTensor], None] | None,
    legacy_writable: bool,
) -> int:
    """Validate the managed tensor at ``ptr`` and describe it in ``tensor``.

    Ownership is the caller's business: nothing here calls or records the deleter.

    Returns:
        The address of the producer's deleter (0 for none).

    Raises:
        BufferError: versioned major != 1 (no other field is read), or an invalid tensor
            (unknown device type or dtype code, bad bits, ndim outside [0, 64], NULL shape,
            negative dimensions, NULL data for a non-empty tensor, an address or byte stride that
            does not fit 64 bits).
        Exception: whatever ``check`` raises.
    """
    mem = _MEM
    if versioned:
        major, minor, _ctx, deleter, flags = _unpack_versioned(mem, ptr)
        if major != 1:
            raise BufferError(
                f"unsupported DLPack version: {major}.{minor}; this consumer understands 1.x"
            )
        fields = _unpack_tensor(mem, ptr + _VERSIONED_TENSOR_OFFSET)
        tensor.version = _VERSIONS.get(minor) or (major, minor)
        tensor.readonly = (flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0
    else:
        fields = _unpack_tensor(mem, ptr)
        (deleter,) = _unpack_ptr(mem, ptr + _LEGACY_DELETER_OFFSET)
        flags = 0
        tensor.version = None
        tensor.readonly = not legacy_writable
    data, dev_type, dev_id, ndim, code, bits, lanes, shape_ptr, strides_ptr, byte_offset = fields
    dev = _DEVICE_ENUM.get(dev_type)
    if dev is None:
        raise BufferError(f"invalid DLPack tensor: unknown device type {dev_type}")
    if ndim:
        if not 0 < ndim <= MAX_NDIM:
            raise BufferError(f"invalid DLPack tensor: {ndim=} outside [0, {MAX_NDIM}]")
        if not shape_ptr:
            raise BufferError(f"invalid DLPack tensor: NULL shape with {ndim=}")
        unpack = _INT64S[ndim]
        shape = unpack(mem, shape_ptr)
        # Set lookups of shapes and strides already seen valid: min()/max() cost ~100 ns each.
        if not data or shape not in _POSITIVE_SHAPES:
            _check_sizes(shape, data)
        if strides_ptr:
            strides = unpack(mem, strides_ptr)
            if strides not in _SAFE_STRIDES:
                _check_strides(strides, bits, lanes)
        else:
            # C strides of a shape whose dimensions are all >= 0; too large ones make numpy()
            # raise BufferError instead.
            strides = _c_strides(shape)
    elif not data:
        raise BufferError("invalid DLPack tensor: NULL data pointer for a 0-d tensor")
    else:
        shape = strides = ()
    address = (data or 0) + byte_offset
    if address > _MAX_ADDRESS:
        raise BufferError(
            f"invalid DLPack tensor: data={data:#x} + {byte_offset=} does not fit a 64-bit address"
        )
    tensor.data = address
    tensor.byte_offset = byte_offset
    tensor.device = (dev, dev_id)
    tensor.shape = shape
    tensor.strides = strides
    tensor.flags = flags
    dtype = _VALID_DTYPES.get((code, bits, lanes))
    if dtype is None:
        # Not seen yet, or invalid: the caller's check sees the raw type first (so it can
        # word its own error), then the generic rules apply.
        tensor.dtype = DataType(code, bits, lanes)
        if check is not None:
            check(tensor)
        tensor.dtype = _dtype_of(code, bits, lanes)
    else:
        tensor.dtype = dtype
        if check is not None:
            check(tensor)
    tensor._addr = ptr
    deleter_address: int = deleter  # struct's "P" gives an int (0 for NULL): no int() needed
    return deleter_address


_VALID_DTYPES: dict[tuple[int, int, int], DataType] = {}


def _dtype_of(code: int, bits: int, lanes: int) -> DataType:
    key = (code, bits, lanes)
    found = _VALID_DTYPES.get(key)
    if found is not None:
        return found
    valid_bits = VALID_BITS.get(code)
    if valid_bits is None:
        raise BufferError(f"invalid DLPack tensor: unknown dtype code {code}")
    if bits not in valid_bits or lanes < 1:
        raise BufferError(
            f"invalid DLPack tensor: dtype code {code} with {bits=} {lanes=} is not valid"
        )
    found = _VALID_DTYPES[key] = DataType(code, bits, lanes)
    return found


# Shapes whose dimensions are all > 0 and stride tuples within +-_SAFE_STRIDE (valid for every
# itemsize), as seen so far. Bounded: a program with ever-new shapes only refills them. Sets of
# immutable tuples: concurrent adds and clears are safe under the GIL and harmless without it
# (a miss only takes the exact check again).
_POSITIVE_SHAPES: set[tuple[int, ...]] = set()
_SAFE_STRIDES: set[tuple[int, ...]] = set()
_MAX_REMEMBERED: Final = 4096


def _check_sizes(shape: tuple[int, ...], data: int | None) -> None:
    size = 1
    for n in shape:
        if n < 0:
            raise BufferError(f"invalid DLPack tensor: negative dimension in {shape=}")
        size *= n
    if size and not data:
        raise BufferError(f"invalid DLPack tensor: NULL data pointer with {shape=}")
    if size:
        if len(_POSITIVE_SHAPES) >= _MAX_REMEMBERED:
            _POSITIVE_SHAPES.clear()
        _POSITIVE_SHAPES.add(shape)


def _check_strides(strides: tuple[int, ...], bits: int, lanes: int) -> None:
    if max(strides) < _SAFE_STRIDE and min(strides) > -_SAFE_STRIDE:
        if len(_SAFE_STRIDES) >= _MAX_REMEMBERED:
            _SAFE_STRIDES.clear()
        _SAFE_STRIDES.add(strides)
        return
    itemsize = max(1, (bits * lanes + 7) // 8)
    for s in strides:
        if abs(s) * itemsize > _INTP_MAX:
            raise BufferError(
                f"invalid DLPack tensor: byte stride {s} * {itemsize} does not fit 64 bits "
                f"({strides=})"
            )


# The memos and readers behind fill(), shared read-only with the exchange import
# (dlpack_ctypes._adopt), which inlines its common case.
VALID_DTYPES: Final = _VALID_DTYPES
POSITIVE_SHAPES: Final = _POSITIVE_SHAPES
DEVICE_ENUM: Final = _DEVICE_ENUM
INT64S: Final = _INT64S
VERSIONS: Final = _VERSIONS
unpack_versioned_head: Final = _unpack_versioned
