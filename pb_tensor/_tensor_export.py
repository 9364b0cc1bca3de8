"""The export side of :class:`pb_tensor.Tensor` beyond numpy's own exporter: the
``dlpack_ctypes`` path (GPU, pinned, BF16, copies, read-only legacy imports) and host copies
of GPU memory.

Shared with :mod:`pb_tensor.tensor` only; every function takes the tensor's fields as
arguments and never builds a ``Tensor`` (no import cycle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

import dlpack_ctypes as dl
from pb_tensor._tensor_import import DEVICE_OF_MEMORY, KDL_CPU
from pb_tensor.dtypes import MemoryType, TritonDtype, triton_to_dlpack
from pb_tensor.errors import TritonBufferError, TritonModelException

if TYPE_CHECKING:
    from typing_extensions import CapsuleType

__all__ = [
    "ctypes_export",
    "dl_dtype",
    "export_fields",
    "host_copy",
    "numpy_export",
    "raw_host",
]


def dl_dtype(dtype: TritonDtype) -> dl.DataType:
    """The DLPack data type of a (non-BYTES) Triton dtype."""
    return dl.DataType(*triton_to_dlpack(dtype))


def raw_host(name: str, imported: dl.DLPackTensor | None) -> np.ndarray[Any, Any]:
    """The raw host words of an imported tensor (BF16 as uint16).

    Raises:
        TritonModelException: the tensor holds no imported data.
    """
    if imported is None:
        raise TritonModelException(f"Tensor {name!r} holds no host data")
    return imported.numpy(raw=True)


def export_fields(
    name: str, array: np.ndarray[Any, Any] | None, imported: dl.DLPackTensor | None
) -> tuple[object, int, tuple[int, ...], tuple[int, ...] | None]:
    """(owner, data pointer, shape, strides) of a tensor's data.

    Raises:
        TritonModelException: the tensor holds no data.
    """
    if array is not None:
        return array, dl.data_pointer(array), array.shape, None
    if imported is None:
        raise TritonModelException(f"Tensor {name!r} holds no data to export")
    return imported, imported.data, imported.shape, imported.strides


def _readonly(array: np.ndarray[Any, Any] | None, imported: dl.DLPackTensor | None) -> bool:
    if imported is not None:
        # A legacy import's views are read-only because the capsule could not say; its
        # re-exports pass on what was received (no READ_ONLY flag), as upstream does.
        return bool(imported.flags & dl.DLPACK_FLAG_BITMASK_READ_ONLY)
    if array is not None:
        return not array.flags.writeable
    return False


def _numpy_storage_dtype(dtype: TritonDtype) -> np.dtype[Any]:
    if dtype == TritonDtype.TYPE_BF16:
        return np.dtype(np.uint16)
    from pb_tensor.dtypes import numpy_dtype_of

    return numpy_dtype_of(dtype)


def host_copy(
    dtype: TritonDtype, dims: tuple[int, ...], nbytes: int, data_ptr: int, device_id: int
) -> tuple[np.ndarray[Any, Any] | None, dl.DLPackTensor | None]:
    """A host copy of ``nbytes`` of GPU memory at ``data_ptr`` on ``device_id``: a numpy
    view, or for BF16 (which numpy cannot describe) an imported DLPack tensor.

    Raises:
        TritonModelException: CUDA unavailable or the copy failed.
    """
    from pb_tensor import cuda

    host = np.empty(nbytes, dtype=np.uint8)
    if host.nbytes:
        cuda.copy_device_to_host(host, data_ptr, device=device_id)
    view = host.view(_numpy_storage_dtype(dtype)).reshape(dims)
    if dtype != TritonDtype.TYPE_BF16:
        return view, None
    imported = dl.from_dlpack(
        dl.BufferExporter(host, dl.data_pointer(host), dims, None, dl_dtype(dtype))
    )
    return None, imported


def numpy_export(
    array: np.ndarray[Any, Any],
    max_version: tuple[int, int] | None,
    dl_device: tuple[int, int] | None,
    copy: bool | None,
) -> CapsuleType:
    """numpy's exporter, its ``BufferError`` raised as :class:`TritonBufferError`."""
    try:
        return dl.numpy_dlpack(array, max_version=max_version, dl_device=dl_device, copy=copy)
    except BufferError as exc:
        raise TritonBufferError(str(exc)) from exc


def _device_pair(value: object) -> tuple[int, int]:
    """``dl_device`` as two ints (malformed values are left for :func:`dl.negotiate` to reject)."""
    try:
        device_type, device_id = cast("tuple[Any, Any]", value)
        return int(device_type), int(device_id)
    except (TypeError, ValueError):
        return (-1, -1)


def ctypes_export(
    name: str,
    dtype: TritonDtype,
    dims: tuple[int, ...],
    memory_type: MemoryType,
    memory_id: int,
    array: np.ndarray[Any, Any] | None,
    imported: dl.DLPackTensor | None,
    stream: object,
    max_version: tuple[int, int] | None,
    dl_device: tuple[int, int] | None,
    copy: bool | None,
) -> CapsuleType:
    """``Tensor.__dlpack__`` through ``dlpack_ctypes`` (for a non-BYTES tensor).

    Raises:
        BufferError: an unsupported ``dl_device`` or read-only data as a legacy capsule;
            :class:`TritonBufferError` for a GPU host copy with ``copy=False``.
        TypeError, ValueError: malformed arguments.
    """
    device = (int(DEVICE_OF_MEMORY[memory_type]), memory_id)
    if (
        memory_type == MemoryType.GPU
        and dl_device is not None
        and _device_pair(dl_device) == (KDL_CPU, 0)
    ):
        if copy is False:
            raise TritonBufferError(
                "__dlpack__: dl_device=(kDLCPU, 0) needs a copy of GPU memory but copy=False"
            )
        # Validates stream (a host copy takes None or -1), max_version and copy.
        versioned = dl.negotiate(
            (KDL_CPU, 0), stream=stream, max_version=max_version, copy=copy
        )[0]
        return _export_host_copy(name, dtype, dims, memory_id, array, imported, versioned)
    readonly = _readonly(array, imported)
    versioned, make_copy, out_device = dl.negotiate(
        device, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy,
        readonly=readonly,
    )
    owner, data, shape, strides = export_fields(name, array, imported)
    if make_copy:
        if memory_type == MemoryType.GPU:
            from pb_tensor import cuda

            buffer = cuda.device_copy(data, _nbytes(array, imported), device=memory_id)
            return dl.export_buffer(buffer, buffer.ptr, shape, None, dl_dtype(dtype),
                                    out_device, versioned=versioned, copied=True)
        source = array if array is not None else raw_host(name, imported)
        host = np.array(source, order="C", copy=True)
        return dl.export_buffer(host, dl.data_pointer(host), shape, None,
                                dl_dtype(dtype), out_device, versioned=versioned,
                                copied=True)
    return dl.export_buffer(owner, data, shape, strides, dl_dtype(dtype), out_device,
                            versioned=versioned, readonly=readonly)


def _nbytes(array: np.ndarray[Any, Any] | None, imported: dl.DLPackTensor | None) -> int:
    # Tensor.byte_size for a tensor that can be exported (never BYTES, so no serialized data).
    if array is not None:
        return int(array.nbytes)
    return imported.nbytes if imported is not None else 0


def _export_host_copy(
    name: str,
    dtype: TritonDtype,
    dims: tuple[int, ...],
    memory_id: int,
    array: np.ndarray[Any, Any] | None,
    imported: dl.DLPackTensor | None,
    versioned: bool,
) -> CapsuleType:
    """A capsule of a fresh host copy of GPU data (IS_COPIED when versioned)."""
    data_ptr = (int(dl.data_pointer(array)) if array is not None
                else imported.data if imported is not None else 0)
    host_array, host_imported = host_copy(dtype, dims, _nbytes(array, imported), data_ptr,
                                          memory_id)
    owner, data, shape, strides = export_fields(name, host_array, host_imported)
    return dl.export_buffer(owner, data, shape, strides, dl_dtype(dtype), (KDL_CPU, 0),
                            versioned=versioned, copied=True)
