"""Consuming DLPack capsules from pure Python.

:func:`from_dlpack` negotiates with any producer (an object with ``__dlpack__``, or a raw
capsule), validates the managed tensor completely *before* taking ownership, renames the capsule
to ``used_dltensor[_versioned]``, and returns a :class:`DLPackTensor` that owns it. The producer's
deleter runs exactly once, when the tensor and every numpy view made from it are gone, or
earlier if :meth:`DLPackTensor.close` is called while no view exists.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from dlpack_ctypes import _capi
from dlpack_ctypes.abi import (
    DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_READ_ONLY,
    NAME_DLTENSOR,
    NAME_DLTENSOR_VERSIONED,
    DLDeviceType,
)
from dlpack_ctypes.dtypes import VALID_BITS, DataType, to_numpy_dtype
from dlpack_ctypes.producer import (
    DELETER_ADDRESS,
    HOST_DEVICES,
    _deleter_impl,
    c_strides,
)

__all__ = ["DLPackTensor", "consume", "from_dlpack"]

_MAX_NDIM: Final = 64
_REQUEST_VERSION: Final = (1, 3)

# A byte view of the whole address space, for reading the structs a producer hands us at their
# absolute addresses with precompiled struct formats (3x cheaper than ctypes.string_at).
_MEM: Final = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B")
_VERSIONED_HEAD = struct.Struct("@IIPPQ")  # version, manager_ctx, deleter, flags
_DLTENSOR = struct.Struct("@PiiiBBHPPQ")  # DLTensor
_LEGACY_DELETER_OFFSET: Final = 56
_VERSIONED_TENSOR_OFFSET: Final = 32
_unpack_versioned = _VERSIONED_HEAD.unpack_from
_unpack_tensor = _DLTENSOR.unpack_from
_unpack_ptr = struct.Struct("@P").unpack_from
_INT64S = [struct.Struct(f"@{n}q").unpack_from for n in range(_MAX_NDIM + 1)]
_DEVICE_TYPES: Final = frozenset(int(d) for d in DLDeviceType)
_DEVICE_ENUM: Final = {int(d): d for d in DLDeviceType}
# Size-0 tensors may have a NULL data pointer, which numpy < 2.3 rejects in __array_interface__
# (it then tries to convert the owner object itself): point their views here instead.
_EMPTY_BUFFER: Final = (ctypes.c_int64 * 8)()
_capi.immortalize(_EMPTY_BUFFER)
_EMPTY_DATA: Final = ctypes.addressof(_EMPTY_BUFFER)

_ADDR_VERSIONED: Final = _capi.ADDR_DLTENSOR_VERSIONED
_ADDR_USED_VERSIONED: Final = _capi.ADDR_USED_DLTENSOR_VERSIONED
_VERSIONS: Final = {minor: (1, minor) for minor in range(16)}
_NAME_OFFSET: Final = _capi.CAPSULE_NAME_OFFSET
_asarray: Final = np.asarray
_pack_ptr = struct.Struct("@P").pack_into
_get_name = _capi.PyCapsule_GetName
_get_pointer = _capi.PyCapsule_GetPointer
_set_name = _capi.PyCapsule_SetName
_CapsuleType = _capi.CapsuleType

# Foreign deleters wrapped once per address. They are called with the GIL held, as numpy's and
# Triton's consumers call them (a deleter that touches Python must take the GIL itself anyway,
# and re-taking a held GIL is fine); this saves a GIL release/acquire per tensor.
_FOREIGN_DELETERS: dict[int, Callable[[int], None]] = {DELETER_ADDRESS: _deleter_impl}
_capi.immortalize(_FOREIGN_DELETERS)


def _deleter_for(address: int) -> Callable[[int], None]:
    fn = _FOREIGN_DELETERS.get(address)
    if fn is None:
        thunk = _capi.VOIDFN_GIL(address)
        _capi.immortalize(thunk)
        fn = _FOREIGN_DELETERS[address] = thunk
    return fn


# DataType -> (typestr of the array the interface describes, itemsize, target): target is True
# when that typestr is the dtype itself, a numpy dtype to view the raw integers as (ml_dtypes'
# bfloat16/float8), or None when numpy has no dtype (only a raw view is possible).
_VIEW_INFO: dict[DataType, tuple[str, int, np.dtype[Any] | bool | None]] = {}


def _view_info(dtype: DataType) -> tuple[str, int, np.dtype[Any] | bool | None]:
    np_dtype = to_numpy_dtype(dtype)
    info: tuple[str, int, np.dtype[Any] | bool | None]
    if np_dtype is not None and np_dtype.type.__module__ == "numpy":
        info = (np_dtype.str, np_dtype.itemsize, True)
    elif dtype.lanes == 1 and dtype.bits % 8 == 0 and dtype.bits <= 64:
        raw = np.dtype(f"u{dtype.bits // 8}")
        info = (raw.str, raw.itemsize, np_dtype)
    else:
        raise BufferError(f"DLPackTensor.numpy: numpy cannot view {dtype!r}")
    _VIEW_INFO[dtype] = info
    return info


_c_strides = c_strides


class DLPackTensor:
    """A consumed DLPack tensor: owns the producer's managed tensor until released.

    Attributes:
        data: address of the first element (``byte_offset`` already added).
        byte_offset: the producer's ``byte_offset`` (informational; folded into ``data``).
        device: ``(DLDeviceType, device_id)``.
        dtype: the raw :class:`~dlpack_ctypes.dtypes.DataType`.
        shape: dimensions.
        strides: strides in elements (C-order strides when the producer sent NULL).
        readonly: READ_ONLY was set (legacy capsules are treated as writable).
        version: ``(major, minor)`` of a versioned capsule, None for a legacy one.
        flags: the raw flags of a versioned capsule (0 for legacy).
    """

    __slots__ = (
        "__array_interface__",
        "__weakref__",
        "_addr",
        "_closed",
        "_fn",
        "byte_offset",
        "data",
        "device",
        "dtype",
        "flags",
        "shape",
        "strides",
        "version",
    )

    # The tensor is the ``base`` of its numpy views, so it lives as long as they do; its
    # finaliser calls the producer's deleter. _fn is that deleter until it has run.
    __array_interface__: dict[str, Any] | None
    _addr: int
    _fn: Callable[[int], None] | None
    _closed: bool
    data: int
    byte_offset: int
    device: tuple[DLDeviceType, int]
    dtype: DataType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    version: tuple[int, int] | None
    flags: int

    def __new__(cls, *args: object, **kwargs: object) -> DLPackTensor:
        raise TypeError("DLPackTensor is made by dlpack_ctypes.from_dlpack() or consume()")

    def __del__(self) -> None:
        fn = self._fn
        if fn is not None:
            self._fn = None
            fn(self._addr)

    @property
    def readonly(self) -> bool:
        """READ_ONLY is set (legacy capsules cannot say so and import writable)."""
        return bool(self.flags & DLPACK_FLAG_BITMASK_READ_ONLY)

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
        return self._fn is None

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
        if self._closed:
            raise BufferError("DLPackTensor.numpy: the tensor was closed")
        if self.__array_interface__ is None:
            info = _VIEW_INFO.get(self.dtype)
            if info is None or self.device[0] not in HOST_DEVICES:
                self.__array_interface__ = self._interface()
                info = _VIEW_INFO[self.dtype]
            else:
                # Inlined _interface() for the common case: this is the consumer's hot path
                # (a C-order view leaves "strides" out, which numpy parses fastest).
                shape = self.shape
                strides = self.strides
                if strides == _c_strides(shape):
                    self.__array_interface__ = {
                        "data": (self.data or _EMPTY_DATA, (self.flags & 1) != 0),
                        "shape": shape,
                        "typestr": info[0],
                        "version": 3,
                    }
                else:
                    self.__array_interface__ = {
                        "data": (self.data or _EMPTY_DATA, (self.flags & 1) != 0),
                        "shape": shape,
                        "strides": tuple([n * info[1] for n in strides]),
                        "typestr": info[0],
                        "version": 3,
                    }
        else:
            info = _VIEW_INFO[self.dtype]
        target = info[2]
        arr: np.ndarray[Any, Any] = _asarray(self)
        if target is True or raw:
            return arr
        if target is None:
            raise BufferError(
                f"DLPackTensor.numpy: numpy has no dtype for {self.dtype!r}; install "
                "ml_dtypes for bfloat16/float8, or pass raw=True for an integer view"
            )
        return arr.view(target)

    def _interface(self) -> dict[str, Any]:
        if self.device[0] not in HOST_DEVICES:
            raise BufferError(
                f"DLPackTensor.numpy: memory on device={self.device!r} is not host-accessible"
            )
        typestr, itemsize, _target = _VIEW_INFO.get(self.dtype) or _view_info(self.dtype)
        shape = self.shape
        strides = self.strides
        return {
            "data": (self.data or _EMPTY_DATA, self.readonly),
            "shape": shape,
            "strides": None if strides == _c_strides(shape) else tuple(
                [s * itemsize for s in strides]),
            "typestr": typestr,
            "version": 3,
        }

    def close(self) -> None:
        """Release the managed tensor now, or as soon as possible.

        If :meth:`numpy` was never called, the producer's deleter runs now. Otherwise views may
        still use the memory, so it runs when the last of them (and this object) is gone; further
        :meth:`numpy` calls raise either way. Idempotent.
        """
        self._closed = True
        if self.__array_interface__ is None:
            fn = self._fn
            if fn is not None:
                self._fn = None
                fn(self._addr)

    def __enter__(self) -> DLPackTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def consume(
    capsule: object,
    *,
    check: Callable[[DLPackTensor], None] | None = None,
) -> DLPackTensor:
    """Take ownership of a DLPack capsule (``"dltensor"`` or ``"dltensor_versioned"``).

    Everything is validated before the capsule is renamed; on any failure before that point the
    capsule is left as it was, so its producer still frees it. As with every DLPack consumer, a
    capsule must be consumed once: do not hand the same capsule to two threads at once.

    Args:
        capsule: a fresh DLPack capsule.
        check: extra validation run on the parsed tensor before the capsule is renamed; if it
            raises, the capsule is left unconsumed and the error propagates. It runs before the
            data type is checked against DLPack's table, so it may see an invalid ``dtype``.

    Raises:
        TypeError: ``capsule`` is not a PyCapsule.
        ValueError: the capsule was already consumed (``used_...``) or is not a DLPack capsule.
        BufferError: versioned major != 1, or an invalid tensor (unknown device type or dtype
            code, bad bits, negative ndim or shape, NULL data for a non-empty tensor ...).
    """
    if type(capsule) is not _CapsuleType:
        raise TypeError(f"consume expects a PyCapsule: got {type(capsule).__name__}")
    mem = _MEM
    try:
        # Versioned is what modern producers return for our max_version request; trying it
        # first saves a PyCapsule_GetName call on the hot path.
        ptr = _get_pointer(capsule, _ADDR_VERSIONED) or 0
    except ValueError:
        ptr = 0
    if ptr:
        major, minor, _ctx, deleter, flags = _unpack_versioned(mem, ptr)
        if major != 1:
            raise BufferError(
                f"unsupported DLPack version: {major}.{minor}; this consumer understands 1.x"
            )
        fields = _unpack_tensor(mem, ptr + _VERSIONED_TENSOR_OFFSET)
        version: tuple[int, int] | None = _VERSIONS.get(minor) or (major, minor)
        used_name = _ADDR_USED_VERSIONED
    else:
        name = _get_name(capsule)
        if name == NAME_DLTENSOR:
            ptr = _get_pointer(capsule, _capi.ADDR_DLTENSOR) or 0
            fields = _unpack_tensor(mem, ptr)
            (deleter,) = _unpack_ptr(mem, ptr + _LEGACY_DELETER_OFFSET)
            flags = 0
            version = None
            used_name = _capi.ADDR_USED_DLTENSOR
        elif name is not None and name.startswith(b"used_"):
            raise ValueError(
                f"DLPack capsule was already consumed: name={name.decode(errors='replace')!r}"
            )
        else:
            raise ValueError(
                f"not a DLPack capsule: name={name!r}, expected {NAME_DLTENSOR!r} or "
                f"{NAME_DLTENSOR_VERSIONED!r}"
            )
    data, dev_type, dev_id, ndim, code, bits, lanes, shape_ptr, strides_ptr, byte_offset = fields
    dev = _DEVICE_ENUM.get(dev_type)
    if dev is None:
        raise BufferError(f"invalid DLPack tensor: unknown device type {dev_type}")
    if ndim:
        if not 0 < ndim <= _MAX_NDIM:
            raise BufferError(f"invalid DLPack tensor: {ndim=} outside [0, {_MAX_NDIM}]")
        if not shape_ptr:
            raise BufferError(f"invalid DLPack tensor: NULL shape with {ndim=}")
        unpack = _INT64S[ndim]
        shape = unpack(mem, shape_ptr)
        if not data or min(shape) <= 0:
            _check_sizes(shape, data)
        strides = unpack(mem, strides_ptr) if strides_ptr else _c_strides(shape)
    elif not data:
        raise BufferError("invalid DLPack tensor: NULL data pointer for a 0-d tensor")
    else:
        shape = strides = ()
    tensor = _new_tensor(DLPackTensor)
    tensor._fn = None
    tensor._closed = False
    tensor.__array_interface__ = None
    tensor.data = (data or 0) + byte_offset
    tensor.byte_offset = byte_offset
    tensor.device = (dev, dev_id)
    tensor.shape = shape
    tensor.strides = strides
    tensor.flags = flags
    tensor.version = version
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
    if _NAME_OFFSET is None:
        _set_name(capsule, used_name)
    else:
        _pack_ptr(mem, id(capsule) + _NAME_OFFSET, used_name)
    # Owned from here on: the tensor's finaliser releases it exactly once whatever happens next.
    tensor._addr = ptr
    tensor._fn = (_FOREIGN_DELETERS.get(deleter) or _deleter_for(deleter)) if deleter else None
    return tensor


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


def _check_sizes(shape: tuple[int, ...], data: int | None) -> None:
    size = 1
    for n in shape:
        if n < 0:
            raise BufferError(f"invalid DLPack tensor: negative dimension in {shape=}")
        size *= n
    if size and not data:
        raise BufferError(f"invalid DLPack tensor: NULL data pointer with {shape=}")


_new_tensor = object.__new__


def from_dlpack(
    obj: object,
    *,
    device: tuple[int, int] | None = None,
    copy: bool | None = None,
    stream: object = None,
    check: Callable[[DLPackTensor], None] | None = None,
) -> DLPackTensor:
    """Import any DLPack producer (or a raw capsule) without copying.

    Asks the producer for ``max_version=(1, 3)``; if it raises TypeError and the caller asked
    for neither ``device`` nor ``copy``, retries the legacy call (``stream`` only).

    Args:
        obj: an object with ``__dlpack__`` (numpy, torch, JAX, CuPy ...) or a DLPack capsule.
        device: passed to the producer as ``dl_device``.
        copy: passed to the producer.
        stream: passed to the producer when not None (the consumer's stream, DLPack rules).
        check: see :func:`consume`.

    Raises:
        TypeError: ``obj`` is neither a capsule nor a DLPack producer, or the producer rejected
            the arguments.
        ValueError: a raw capsule combined with ``device``/``copy``/``stream`` (nothing to
            negotiate with), or an already consumed capsule.
        BufferError: the producer refused, or the tensor is invalid (see :func:`consume`).
    """
    if type(obj) is _CapsuleType:
        if device is not None or copy is not None or stream is not None:
            raise ValueError(
                "from_dlpack: device, copy and stream cannot be negotiated with a raw capsule"
            )
        return consume(obj, check=check)
    if stream is None and device is None and copy is None:
        # The common request, with the fewest steps (this is the consumer's hot path).
        producer: Any = obj
        try:
            capsule = producer.__dlpack__(max_version=_REQUEST_VERSION)
        except AttributeError:
            if hasattr(obj, "__dlpack__"):
                raise  # raised inside the producer
            raise TypeError(
                f"from_dlpack expects a DLPack capsule or an object with __dlpack__: "
                f"got {type(obj).__name__}"
            ) from None
        except TypeError:
            capsule = producer.__dlpack__()  # a producer that predates DLPack 1.0
        return consume(capsule, check=check)
    method = getattr(obj, "__dlpack__", None)
    if method is None:
        raise TypeError(
            f"from_dlpack expects a DLPack capsule or an object with __dlpack__: "
            f"got {type(obj).__name__}"
        )
    kwargs: dict[str, Any] = {"max_version": _REQUEST_VERSION}
    if stream is not None:
        kwargs["stream"] = stream
    if device is not None:
        kwargs["dl_device"] = device
    if copy is not None:
        kwargs["copy"] = copy
    try:
        capsule = method(**kwargs)
    except TypeError:
        if device is not None or copy is not None:
            raise
        capsule = method() if stream is None else method(stream=stream)
    return consume(capsule, check=check)


class _HostView:
    """The ``base`` of :func:`_host_view` arrays: describes the memory, keeps its owner."""

    __slots__ = ("__array_interface__", "_keep")

    def __init__(self, interface: dict[str, Any], keep: object) -> None:
        self.__array_interface__ = interface
        self._keep = keep


def _host_view(
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: DataType,
    owner: object,
) -> np.ndarray[Any, Any]:
    """A raw numpy view of host memory described by DLPack fields, keeping ``owner`` alive."""
    tensor = _new_tensor(DLPackTensor)
    tensor._fn = None
    tensor._closed = False
    tensor.__array_interface__ = None
    tensor.data, tensor.byte_offset = data, 0
    tensor.device = (DLDeviceType.kDLCPU, 0)
    tensor.dtype, tensor.shape, tensor.strides = dtype, shape, strides
    tensor.version, tensor.flags = None, 0
    return np.asarray(_HostView(tensor._interface(), owner))
