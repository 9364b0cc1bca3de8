"""Triton python_backend's ``pb_utils.Tensor`` in pure Python, on top of :mod:`dlpack_ctypes`.

Drop-in for the tensor parts of ``triton_python_backend_utils``::

    import numpy as np
    import pb_tensor as pb_utils

    t = pb_utils.Tensor("INPUT0", np.arange(6, dtype=np.float32).reshape(2, 3))
    u = pb_utils.Tensor.from_dlpack("OUTPUT0", torch_tensor)   # zero-copy
    np.from_dlpack(t)                                           # zero-copy

CUDA support (``pb_tensor.cuda``) is imported only when a GPU tensor needs it, and shared memory
(``pb_tensor.shm``) only when used.
"""

from __future__ import annotations

# One distribution, one version: written once, in dlpack_ctypes (the base layer).
from dlpack_ctypes import __version__
from pb_tensor.bytes_codec import deserialize_bytes_tensor, serialize_byte_tensor
from pb_tensor.dtypes import (
    TRITON_STRING_TO_NUMPY,
    MemoryType,
    TritonDtype,
    numpy_to_triton_type,
    triton_string_to_numpy,
    triton_to_numpy_type,
)
from pb_tensor.errors import TritonBufferError, TritonModelException
from pb_tensor.tensor import Tensor

__all__ = [
    "TRITON_STRING_TO_NUMPY",
    "MemoryType",
    "Tensor",
    "TritonBufferError",
    "TritonDtype",
    "TritonModelException",
    "__version__",
    "deserialize_bytes_tensor",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
]
