"""The fields of :class:`pb_tensor.Tensor` and their read-only accessors.

:class:`TensorFields` declares every slot a ``Tensor`` has and answers the questions that only
read them (name, shape, dtype, device, size, address, ``repr``); :mod:`pb_tensor.tensor` adds
construction, conversion, DLPack and shared memory. It never builds a ``Tensor`` (no import
cycle).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import dlpack_ctypes as dl
from pb_tensor.dtypes import MemoryType, TritonDtype
from pb_tensor.extras_policy import extras_allowed

__all__ = ["TensorFields"]

# is_cpu() runs on hot paths: an enum member read through its class costs several times a
# module global.
_GPU = MemoryType.GPU

# What pybind11 raises for Triton's triton_dtype(): its return type is an unregistered C enum.
_TRITON_DTYPE_ERROR = (
    "Unable to convert function return value to a Python type! The signature was\n"
    "\t(self: c_python_backend_utils.Tensor) -> TRITONSERVER_datatype_enum"
)


class TensorFields:
    """The slots of a ``Tensor`` and their read-only accessors (not used on its own)."""

    __slots__ = (
        "__weakref__",
        "_array",
        "_dims",
        "_dl",
        "_dtype",
        "_lengths",
        "_memory_id",
        "_memory_type",
        "_name",
        "_serialized",
        "_shm",
    )

    _name: str
    _dtype: TritonDtype
    _dims: tuple[int, ...]
    _memory_type: MemoryType
    _memory_id: int
    # numpy data: the user's array, a view of the DLPack import, or of shared memory.
    _array: np.ndarray[Any, Any] | None
    # The consumed DLPack tensor (owns the producer's memory), or None.
    _dl: dl.DLPackTensor | None
    # BYTES only: the serialized wire bytes.
    _serialized: np.ndarray[Any, Any] | None
    # BYTES only: the element lengths serialisation found (many elements only), stored beside
    # the payload when the tensor is saved to shared memory.
    _lengths: np.ndarray[Any, Any] | None
    # Shared-memory state once saved or loaded (handle, pool), or None.
    _shm: Any

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def shape(self) -> list[int]:
        """The dimensions, as a list (upstream returns a list, not a tuple)."""
        return list(self._dims)

    def triton_dtype(self) -> TritonDtype:
        """The Triton data type (works, unlike upstream where it raises TypeError).

        Raises:
            TypeError: inside a model served by ``pb_tensor.runtime`` without
                ``pb_tensor_extras=True``, with Triton's text (python_backend#382), so that
                model code calling it fails here as it fails in Triton
                (:mod:`pb_tensor.extras_policy`). :attr:`dtype` always works.
        """
        if not extras_allowed():
            raise TypeError(_TRITON_DTYPE_ERROR)
        return self._dtype

    def is_cpu(self) -> bool:
        """True for CPU and pinned (CPU_PINNED) memory."""
        return self._memory_type != _GPU

    # ----------------------------------------------------------------------------------------
    # Typed extras

    @property
    def dtype(self) -> TritonDtype:
        """The Triton data type (what ``triton_dtype()`` returns where it works)."""
        return self._dtype

    @property
    def memory_type(self) -> MemoryType:
        """Where the data lives: CPU, CPU_PINNED or GPU."""
        return self._memory_type

    @property
    def memory_type_id(self) -> int:
        """The device id (0 for CPU memory)."""
        return self._memory_id

    @property
    def byte_size(self) -> int:
        """Bytes of data; for BYTES tensors, the serialized size."""
        if self._serialized is not None:
            return int(self._serialized.nbytes)
        if self._array is not None:
            return int(self._array.nbytes)
        imported = self._dl
        return imported.nbytes if imported is not None else 0

    @property
    def data_ptr(self) -> int:
        """Address of the first byte (for BYTES tensors: of the serialized bytes)."""
        if self._serialized is not None:
            return int(dl.data_pointer(self._serialized))
        if self._array is not None:
            return int(dl.data_pointer(self._array))
        imported = self._dl
        return imported.data if imported is not None else 0

    def __repr__(self) -> str:
        device = self._memory_type.name
        if self._memory_type != MemoryType.CPU:
            device += f":{self._memory_id}"
        return (
            f"Tensor(name={self._name!r}, dtype={self._dtype.wire_name}, "
            f"shape={list(self._dims)}, device={device})"
        )
