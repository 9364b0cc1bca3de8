"""Triton python_backend's ``pb_utils.Tensor`` in pure Python, on top of :mod:`dlpack_ctypes`.

Drop-in for the tensor parts of ``triton_python_backend_utils``::

    import numpy as np
    import pb_tensor as pb_utils

    t = pb_utils.Tensor("INPUT0", np.arange(6, dtype=np.float32).reshape(2, 3))
    u = pb_utils.Tensor.from_dlpack("OUTPUT0", torch_tensor)   # zero-copy
    np.from_dlpack(t)                                           # zero-copy

``import pb_tensor`` imports none of its modules (``import dlpack_ctypes`` aside): each public
name is loaded on first access (PEP 562). The Tensor loads the DLPack machinery, the BYTES
codec, pickling, CUDA support (``pb_tensor.cuda``) and shared memory (``pb_tensor.shm``) only
when a call needs them. The first ``os.fork()`` loads every module behind a public name, so
that a child never finds one half-imported by another thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

# One distribution, one version: written once, in dlpack_ctypes (the base layer, whose
# ``__init__`` imports nothing either).
from dlpack_ctypes import __version__

if TYPE_CHECKING:
    # What the type checker sees; at run time __getattr__ below imports these on first access.
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

# Public name -> the module that defines it.
_LAZY: dict[str, str] = {
    "Tensor": "pb_tensor.tensor",
    **dict.fromkeys(("TritonBufferError", "TritonModelException"), "pb_tensor.errors"),
    **dict.fromkeys(
        ("deserialize_bytes_tensor", "serialize_byte_tensor"), "pb_tensor.bytes_codec"
    ),
    **dict.fromkeys(
        (
            "TRITON_STRING_TO_NUMPY",
            "MemoryType",
            "TritonDtype",
            "numpy_to_triton_type",
            "triton_string_to_numpy",
            "triton_to_numpy_type",
        ),
        "pb_tensor.dtypes",
    ),
}



def _load_all_before_fork() -> None:
    # Names load on first access, possibly on another thread while this one forks. A fork in
    # the middle of that import would copy its module lock, held by a thread the child does not
    # have, and the child's first access to that module would wait forever. So the first fork
    # loads every module behind a lazy name (waiting for another thread's import in progress
    # through the import system's own locks); the child then never imports them.
    # The Tensor's own first-use imports count too: pickling (any pickled Tensor) and the
    # records module of shared memory (only once the program has imported shared memory).
    modules = set(_LAZY.values()) | {"pb_tensor._pickling"}
    if "pb_tensor.shm" in sys.modules:
        modules.add("pb_tensor.shm._tensors")
    for module in sorted(modules):
        # A failing import raises again where the name is used; a fork must not fail for it.
        with contextlib.suppress(Exception):
            __import__(module)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_load_all_before_fork)

def __getattr__(name: str) -> object:
    """Import the module behind a public name on its first access and cache the name here.

    Thread-safe: the import system serialises the import itself, and every thread stores the
    same object.

    Raises:
        AttributeError: ``name`` is not a public name of this package (nor a loaded
            submodule).
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pb_tensor' has no attribute {name!r}")
    __import__(module)  # the import statement's machinery: -X importtime reports it
    value = getattr(sys.modules[module], name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
