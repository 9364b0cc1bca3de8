"""Exporters built on the producer: numpy arrays and arbitrary memory as DLPack producers.

* :func:`to_dlpack` exports a numpy array through this package's ctypes producer.
* :func:`numpy_dlpack` exports it through numpy's own C exporter (numpy >= 2.4), tagging
  versioned capsules with the DLPack minor version whose rules numpy keeps: the fastest route
  for host memory numpy can describe.
* :class:`BufferExporter` gives any memory ``__dlpack__`` and ``__dlpack_device__``.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

from dlpack_ctypes import _capi, _claim
from dlpack_ctypes._blocks import DEVICE_TYPES
from dlpack_ctypes._numpy_rules import NUMPY_EXPORTER_KEEPS_RULES
from dlpack_ctypes._pack import export, export_prepared, prepare
from dlpack_ctypes._shapes import C_STRIDES, MAX_NDIM, c_strides, check_shape, contiguous_strides
from dlpack_ctypes._views import HOST_DEVICES, host_view
from dlpack_ctypes.abi import (
    DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_READ_ONLY,
    DLPACK_MINOR_VERSION,
    DLDeviceType,
    kDLCPU,
)
from dlpack_ctypes.dtypes import DataType, from_numpy_dtype
from dlpack_ctypes.producer import negotiate

if TYPE_CHECKING:
    # typing_extensions is not a runtime dependency: annotations only.
    from typing_extensions import CapsuleType

__all__ = [
    "NUMPY_EXPORTER_KEEPS_RULES",
    "BufferExporter",
    "data_pointer",
    "fast_paths",
    "numpy_dlpack",
    "to_dlpack",
]

# The build flag (Py_GIL_DISABLED): free-threaded builds carry "t" in their ABI flags. Reading
# it from sysconfig would import sysconfig (a few ms) for one flag.
_FREE_THREADED = "t" in getattr(sys, "abiflags", "")
_void_from_address = ctypes.c_void_p.from_address


def _data_via_interface(a: np.ndarray[Any, Any]) -> int:
    return int(a.__array_interface__["data"][0])


def _probe_data_offset() -> Any:
    """Return a fast ``PyArrayObject->data`` reader if this interpreter's layout matches.

    ``__array_interface__`` costs ~1 us per call; reading the ``data`` field costs ~0.1 us. It
    is used only when the field sits where it is expected for a varied set of arrays; otherwise
    the slow, layout-free path stays.
    """
    if sys.implementation.name != "cpython" or _FREE_THREADED:
        return _data_via_interface
    offset = object.__basicsize__  # PyObject_HEAD, then the data pointer
    base = np.arange(64, dtype=np.float64).reshape(8, 8)
    samples = [base, base[1:, 2:], base[::-1], base.T, np.zeros(0), np.array(1.0, dtype=np.float32)]
    for arr in samples:
        if _void_from_address(id(arr) + offset).value != _data_via_interface(arr):
            return _data_via_interface

    def read(a: np.ndarray[Any, Any], _off: int = offset) -> int:
        return _void_from_address(id(a) + _off).value or 0

    return read


_array_data: Any = _probe_data_offset()


def data_pointer(array: np.ndarray[Any, Any]) -> int:
    """The address of ``array``'s first element (``array.ctypes.data``, ~8x cheaper).

    Raises:
        TypeError: ``array`` is not a numpy array.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"data_pointer expects a numpy.ndarray: got {type(array).__name__}")
    return int(_array_data(array))


def _numpy_strides(a: np.ndarray[Any, Any]) -> tuple[int, ...]:
    """``a``'s real strides in elements, as numpy's own exporter sends them.

    Size-1 dimensions keep whatever stride the array has (numpy's C-contiguity flag ignores
    them, but consumers such as torch see the stride). A stride that is not a whole number of
    elements is allowed only where numpy's exporter allows it (size-1 dimensions) and is then
    divided the way C divides, towards zero.
    """
    it = a.itemsize
    st = a.strides
    es = tuple([s // it for s in st])
    # Floor-division remainders are never negative, so equal sums mean every stride divides.
    if sum(es) * it == sum(st):
        return es
    fixed = []
    for n, s in zip(a.shape, st):
        if s % it and n > 1:
            raise BufferError(
                f"cannot export a numpy array whose byte strides are not multiples of its "
                f"itemsize: strides={st}, itemsize={it}"
            )
        fixed.append(s // it if s >= 0 else -(-s // it))
    return tuple(fixed)


_C_BYTE_STRIDES: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}


def _strides_of(a: np.ndarray[Any, Any], c_contiguous: bool) -> tuple[int, ...]:
    """Element strides of ``a`` (memoised C strides when its byte strides are exactly C's)."""
    shape = a.shape
    if c_contiguous:
        st = a.strides
        key = (shape, a.itemsize)
        if _C_BYTE_STRIDES.get(key) == st:
            return C_STRIDES.get(shape) or c_strides(shape)
        if st == tuple([s * a.itemsize for s in c_strides(shape)]):
            if len(_C_BYTE_STRIDES) > 4096:
                _C_BYTE_STRIDES.clear()
            _C_BYTE_STRIDES[key] = st
            return c_strides(shape)
    return _numpy_strides(a)


def _numpy_dlpack(
    a: np.ndarray[Any, Any],
    stream: object,
    max_version: object,
    dl_device: object,
    copy: bool | None,
) -> CapsuleType:
    flags = a.flags
    readonly = not flags.writeable
    if (
        stream is None and dl_device is None and copy is None
        and type(max_version) is tuple and len(max_version) == 2
        and type(max_version[0]) is int and max_version[0] >= 1
    ):
        # The request numpy and torch consumers make: skip the general negotiation.
        versioned, make_copy, device = True, False, (1, 0)
    else:
        versioned, make_copy, device = negotiate(
            (1, 0), stream=stream, max_version=max_version, dl_device=dl_device, copy=copy,
            readonly=readonly,
        )
        if make_copy:
            a = np.array(a, copy=True, order="C")
            flags = a.flags
            readonly = False
    shape = a.shape
    if len(shape) > MAX_NDIM:
        check_shape(shape, None)
    strides = _strides_of(a, flags.c_contiguous)
    return export(
        a, _array_data(a), shape, strides, from_numpy_dtype(a.dtype), device, versioned,
        (DLPACK_FLAG_BITMASK_READ_ONLY if readonly else 0)
        | (DLPACK_FLAG_BITMASK_IS_COPIED if make_copy else 0),
    )


def to_dlpack(
    array: np.ndarray[Any, Any],
    *,
    stream: object = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> CapsuleType:
    """Export a numpy array as a DLPack capsule through this package's ctypes producer.

    The array is kept alive until the consumer releases the tensor. Arguments follow
    ``__dlpack__``: ``max_version=None`` gives a legacy ``"dltensor"`` capsule (what JAX
    accepts), ``(1, x)`` a ``"dltensor_versioned"`` one.

    Raises:
        TypeError: ``array`` is not a numpy array, or malformed arguments.
        ValueError: a stream other than None or -1.
        BufferError: unsupported dtype (object, string, datetime, non-native byte order ...),
            read-only data requested as a legacy capsule, strides that are not whole elements,
            or a device other than the CPU requested.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"to_dlpack expects a numpy.ndarray: got {type(array).__name__}")
    return _numpy_dlpack(array, stream, max_version, dl_device, copy)


class BufferExporter:
    """An object implementing the DLPack protocol over any memory.

    ``np.from_dlpack(BufferExporter(...))``, ``torch.from_dlpack(...)`` and ``jnp.from_dlpack``
    then import the memory without a copy. Requests are negotiated as :func:`negotiate`
    describes; ``copy=True`` is honoured for host-accessible memory only.

    Args: as :func:`export_buffer`; ``strides`` in elements or None for C-contiguous.

    Raises:
        ValueError: malformed shape or strides, or an unknown device type.
        BufferError: too many dimensions.
    """

    __slots__ = (
        "_data",
        "_device",
        "_dtype",
        "_owner",
        "_prepared",
        "_readonly",
        "_shape",
        "_strides",
    )

    # The packed versioned block of the plain export, made on the second one (None: none yet,
    # False: one, which packed its own block: a one-off exporter gains nothing from preparing);
    # later exports copy it instead of packing every field again.
    _prepared: tuple[Any, bytes, int, int, int] | Literal[False] | None

    def __init__(
        self,
        owner: object,
        data: int,
        shape: Sequence[int],
        strides: Sequence[int] | None,
        dtype: DataType,
        device: tuple[int, int] = (kDLCPU, 0),
        *,
        readonly: bool = False,
    ) -> None:
        check_shape(shape, strides)
        self._owner = owner
        self._data = int(data)
        self._shape = tuple(int(n) for n in shape)
        self._strides = tuple(
            int(s) for s in (contiguous_strides(shape) if strides is None else strides)
        )
        self._dtype = DataType(*dtype)
        device_type = int(device[0])
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"unknown DLPack device type: {device=!r}")
        self._device = (device_type, int(device[1]))
        self._readonly = readonly
        self._prepared = None

    @classmethod
    def from_numpy(cls, array: np.ndarray[Any, Any]) -> BufferExporter:
        """Wrap a numpy array (kept alive by the exporter and by every export).

        Raises:
            TypeError: ``array`` is not a numpy array.
            BufferError: unsupported dtype, more than 64 dimensions, or strides that are not
                whole elements.
        """
        if not isinstance(array, np.ndarray):
            raise TypeError(f"from_numpy expects a numpy.ndarray: got {type(array).__name__}")
        shape = array.shape
        if len(shape) > MAX_NDIM:
            check_shape(shape, None)
        flags = array.flags
        self = object.__new__(cls)
        self._owner = array
        self._data = _array_data(array)
        self._shape = shape
        self._strides = _strides_of(array, flags.c_contiguous)
        self._dtype = from_numpy_dtype(array.dtype)
        self._device = (1, 0)
        self._readonly = not flags.writeable
        self._prepared = None
        return self

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        """``(device_type, device_id)`` of the memory."""
        return DLDeviceType(self._device[0]), self._device[1]

    def __dlpack__(
        self,
        *,
        stream: object = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> CapsuleType:
        """Export as a capsule (see :func:`negotiate` for the rules and errors)."""
        versioned, make_copy, device = negotiate(
            self._device, stream=stream, max_version=max_version, dl_device=dl_device,
            copy=copy, readonly=self._readonly,
        )
        if make_copy:
            if self._device[0] not in HOST_DEVICES:
                raise BufferError(
                    f"copy=True is not supported for device memory: device={self._device!r}"
                )
            copy_of = np.array(
                host_view(self._data, self._shape, self._strides, self._dtype, self), order="C"
            )
            return export(copy_of, _array_data(copy_of), self._shape,
                           tuple(contiguous_strides(self._shape)), self._dtype, device,
                           versioned, DLPACK_FLAG_BITMASK_IS_COPIED)
        flags = DLPACK_FLAG_BITMASK_READ_ONLY if self._readonly else 0
        if versioned and device is self._device:  # the plain request: device not relabelled
            prepared = self._prepared
            if prepared is None:
                self._prepared = False
            else:
                if prepared is False:
                    prepared = self._prepared = prepare(self._data, self._shape, self._strides,
                                                        self._dtype, device, True, flags)
                return export_prepared(self._owner, prepared, _ADDR_VERSIONED)
        return export(self._owner, self._data, self._shape, self._strides, self._dtype,
                       device, versioned, flags)


_get_pointer = _capi.PyCapsule_GetPointer
_ADDR_VERSIONED: Final = _capi.ADDR_DLTENSOR_VERSIONED
_pack_u32 = struct.Struct("@I").pack_into
_POINTER_OFFSET: Final = _claim.POINTER_OFFSET
_unpack_pointer_and_name = struct.Struct("@PP").unpack_from
# The name pointer of the last numpy capsule PyCapsule_GetPointer accepted as versioned.
_NUMPY_VERSIONED_NAME: list[int] = [0]


def numpy_dlpack(
    array: np.ndarray[Any, Any],
    *,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> CapsuleType:
    """Export ``array`` through numpy's own ``__dlpack__`` (C code: ~0.1 us).

    Versioned capsules say DLPack 1.3 when numpy keeps its rules (numpy >= 2.4), 1.0 otherwise.

    Raises:
        BufferError: as numpy raises it (unsupported dtype, read-only data as a legacy capsule,
            another device requested).
        TypeError: malformed arguments.
    """
    if dl_device is None and copy is None:  # the common request: fewer keywords to parse
        capsule: CapsuleType = array.__dlpack__(max_version=max_version)
    else:
        capsule = array.__dlpack__(max_version=max_version, dl_device=dl_device, copy=copy)
    if max_version is not None and NUMPY_EXPORTER_KEEPS_RULES and max_version[0] >= 1:
        mem = _capi.MEM
        if _POINTER_OFFSET is None:
            ptr = _get_pointer(capsule, _ADDR_VERSIONED)
        else:
            # numpy names its capsules with one static string: once PyCapsule_GetPointer has
            # accepted a capsule with that name pointer, the next ones are read directly from
            # the capsule object (the field offsets are self-checked at import).
            ptr, name = _unpack_pointer_and_name(mem, id(capsule) + _POINTER_OFFSET)
            if name != _NUMPY_VERSIONED_NAME[0]:
                ptr = _get_pointer(capsule, _ADDR_VERSIONED)
                _NUMPY_VERSIONED_NAME[0] = name
        if ptr:
            _pack_u32(mem, ptr + 4, DLPACK_MINOR_VERSION)
    return capsule


def fast_paths() -> dict[str, bool]:
    """Which guarded fast paths this interpreter uses (each was self-checked at import).

    ``numpy_data_pointer``: reading ``PyArrayObject->data`` directly; ``capsule_rename``: renaming
    consumed capsules by writing their name field; ``numpy_exporter``: numpy's own exporter keeps
    this package's rules.
    """
    return {
        "numpy_data_pointer": _array_data is not _data_via_interface,
        "capsule_rename": _capi.CAPSULE_NAME_OFFSET is not None,
        "numpy_exporter": NUMPY_EXPORTER_KEEPS_RULES,
    }
