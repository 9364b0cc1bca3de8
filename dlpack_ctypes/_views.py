"""numpy views of DLPack memory (shared privately by the consumer and the exporters)."""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Final

import numpy as np

from dlpack_ctypes import _capi
from dlpack_ctypes._shapes import c_strides
from dlpack_ctypes.abi import DLDeviceType
from dlpack_ctypes.dtypes import DataType, to_numpy_dtype

__all__ = [
    "EMPTY_DATA",
    "HOST_DEVICES",
    "VIEW_INFO",
    "ViewOwner",
    "host_view",
    "interface",
    "view_info",
]

#: Device types whose memory the CPU can address directly (numpy can view it).
HOST_DEVICES: Final = frozenset(
    {
        DLDeviceType.kDLCPU,
        DLDeviceType.kDLCUDAHost,
        DLDeviceType.kDLROCMHost,
        DLDeviceType.kDLCUDAManaged,
    }
)

# Size-0 tensors may have a NULL data pointer, which numpy < 2.3 rejects in __array_interface__
# (it then tries to convert the owner object itself): point their views here instead.
_EMPTY_BUFFER: Final = (ctypes.c_int64 * 8)()
_capi.immortalize(_EMPTY_BUFFER)
#: A valid, immortal address for the views of empty tensors.
EMPTY_DATA: Final = ctypes.addressof(_EMPTY_BUFFER)

#: DataType -> (typestr of the array the interface describes, itemsize, target): target is True
#: when that typestr is the dtype itself, a numpy dtype to view the raw integers as (ml_dtypes'
#: bfloat16/float8), or None when numpy has no dtype (only a raw view is possible).
VIEW_INFO: dict[DataType, tuple[str, int, np.dtype[Any] | bool | None]] = {}


def view_info(dtype: DataType) -> tuple[str, int, np.dtype[Any] | bool | None]:
    """How numpy views ``dtype`` (memoised in :data:`VIEW_INFO`).

    Raises:
        BufferError: numpy cannot view the type even as raw integers.
    """
    found = VIEW_INFO.get(dtype)
    if found is not None:
        return found
    np_dtype = to_numpy_dtype(dtype)
    info: tuple[str, int, np.dtype[Any] | bool | None]
    if np_dtype is not None and np_dtype.type.__module__ == "numpy":
        info = (np_dtype.str, np_dtype.itemsize, True)
    elif dtype.lanes == 1 and dtype.bits % 8 == 0 and dtype.bits <= 64:
        raw = np.dtype(f"u{dtype.bits // 8}")
        info = (raw.str, raw.itemsize, np_dtype)
    else:
        raise BufferError(f"DLPackTensor.numpy: numpy cannot view {dtype!r}")
    VIEW_INFO[dtype] = info
    return info


def interface(
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: DataType,
    device: tuple[int, int],
    readonly: bool,
) -> dict[str, Any]:
    """The ``__array_interface__`` (v3) describing host memory given by DLPack fields.

    Raises:
        BufferError: the memory is not host-accessible, or numpy cannot view the type.
    """
    if device[0] not in HOST_DEVICES:
        raise BufferError(
            f"DLPackTensor.numpy: memory on device={device!r} is not host-accessible"
        )
    typestr, itemsize, _target = view_info(dtype)
    return {
        "data": (data or EMPTY_DATA, readonly),
        "shape": shape,
        "strides": None if strides == c_strides(shape) else tuple(
            [s * itemsize for s in strides]),
        "typestr": typestr,
        "version": 3,
    }


class ViewOwner(ctypes.c_char * sys.maxsize):  # type: ignore[misc]
    """The ``base`` of a numpy view made without ``__array_interface__``: a writable buffer
    that starts at the data (numpy reads only the view's extent) and keeps ``tensor`` alive.

    Made with ``from_address`` and never owns memory; ``numpy.ndarray(shape, dtype, owner)``
    builds the view in C, which costs less than numpy parsing an interface dict. Its length
    is the address space's, so the Python-level accessors a ctypes array has (indexing,
    ``len``, ``value``, ``raw``), which would read past the tensor, raise TypeError; numpy only
    takes its buffer.

    Raises:
        TypeError: on indexing, ``len()``, ``value`` and ``raw``.
    """

    __slots__ = ("tensor",)

    tensor: object

    def _refuse(self, *args: object) -> Any:
        raise TypeError(
            "ViewOwner is the base of a numpy view of a DLPack tensor; use the view itself"
        )

    __getitem__ = __setitem__ = __len__ = _refuse


# ctypes gives every c_char array type its own ``value`` and ``raw`` after the class body runs.
ViewOwner.value = ViewOwner.raw = property(ViewOwner._refuse)


class _HostView:
    """The ``base`` of :func:`host_view` arrays: describes the memory, keeps its owner."""

    __slots__ = ("__array_interface__", "_keep")

    def __init__(self, iface: dict[str, Any], keep: object) -> None:
        self.__array_interface__ = iface
        self._keep = keep


def host_view(
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: DataType,
    owner: object,
) -> np.ndarray[Any, Any]:
    """A raw numpy view of host memory described by DLPack fields, keeping ``owner`` alive.

    Raises:
        BufferError: numpy cannot view the type.
    """
    iface = interface(data, shape, strides, dtype, (DLDeviceType.kDLCPU, 0), False)
    return np.asarray(_HostView(iface, owner))
