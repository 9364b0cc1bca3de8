"""Pure-Python (ctypes) binding of the DLPack C ABI, v1.3.

Produce DLPack capsules from any memory and consume capsules from any producer (numpy, PyTorch,
JAX, CuPy ...) with no compiled code::

    import numpy as np
    import dlpack_ctypes as dl

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.from_dlpack(dl.BufferExporter.from_numpy(a))   # our producer, numpy consumer
    t = dl.from_dlpack(a)                                 # numpy producer, our consumer
    view = t.numpy()                                      # zero-copy, keeps the tensor alive

``import dlpack_ctypes`` loads only the ABI mirrors and the export registry; every public name is
loaded from its module on first access (PEP 562), so a program pays only for the parts it uses
(the consumer does not load the exporters, nor the exporters the consumer). The first
``os.fork()`` loads them all, so that a child never finds one half-imported by another thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # What the type checker sees; at run time __getattr__ below imports these on first access.
    from dlpack_ctypes import abi
    from dlpack_ctypes._capi import CapsuleType
    from dlpack_ctypes._numpy_rules import NUMPY_EXPORTER_KEEPS_RULES
    from dlpack_ctypes.abi import (
        DLPACK_ABI_VERSION,
        DLPACK_FLAG_BITMASK_IS_COPIED,
        DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED,
        DLPACK_FLAG_BITMASK_READ_ONLY,
        DLDataTypeCode,
        DLDeviceType,
    )
    from dlpack_ctypes.consumer import DLPackTensor, consume, from_dlpack
    from dlpack_ctypes.dtypes import DataType, from_numpy_dtype, to_numpy_dtype
    from dlpack_ctypes.exporters import (
        BufferExporter,
        data_pointer,
        fast_paths,
        numpy_dlpack,
        to_dlpack,
    )
    from dlpack_ctypes.producer import (
        HOST_DEVICES,
        c_strides,
        export_buffer,
        flush,
        live_exports,
        negotiate,
    )

__all__ = [
    "DLPACK_ABI_VERSION",
    "DLPACK_FLAG_BITMASK_IS_COPIED",
    "DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED",
    "DLPACK_FLAG_BITMASK_READ_ONLY",
    "HOST_DEVICES",
    "NUMPY_EXPORTER_KEEPS_RULES",
    "BufferExporter",
    "CapsuleType",
    "DLDataTypeCode",
    "DLDeviceType",
    "DLPackTensor",
    "DataType",
    "abi",
    "c_strides",
    "consume",
    "data_pointer",
    "export_buffer",
    "fast_paths",
    "flush",
    "from_dlpack",
    "from_numpy_dtype",
    "live_exports",
    "negotiate",
    "numpy_dlpack",
    "to_dlpack",
    "to_numpy_dtype",
]

__version__ = "0.1.0"

# Loaded now, before this package's fork hook is registered below. Its own fork hook takes the
# sweep lock, which another thread's import in progress may need (a collection during the
# import sweeps); hooks registered later run first, so the packages' hooks let such imports
# finish before the lock is taken.
import dlpack_ctypes._blocks  # noqa: F401

# Public name -> the module that defines it (the module itself for "abi").
_LAZY: dict[str, str] = {
    "abi": "dlpack_ctypes.abi",
    "CapsuleType": "dlpack_ctypes._capi",
    **dict.fromkeys(
        (
            "DLPACK_ABI_VERSION",
            "DLPACK_FLAG_BITMASK_IS_COPIED",
            "DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED",
            "DLPACK_FLAG_BITMASK_READ_ONLY",
            "DLDataTypeCode",
            "DLDeviceType",
        ),
        "dlpack_ctypes.abi",
    ),
    **dict.fromkeys(("DLPackTensor", "consume", "from_dlpack"), "dlpack_ctypes.consumer"),
    **dict.fromkeys(("DataType", "from_numpy_dtype", "to_numpy_dtype"), "dlpack_ctypes.dtypes"),
    # Re-exported by dlpack_ctypes.exporters; answered without importing the producer.
    "NUMPY_EXPORTER_KEEPS_RULES": "dlpack_ctypes._numpy_rules",
    **dict.fromkeys(
        (
            "BufferExporter",
            "data_pointer",
            "fast_paths",
            "numpy_dlpack",
            "to_dlpack",
        ),
        "dlpack_ctypes.exporters",
    ),
    **dict.fromkeys(
        ("HOST_DEVICES", "c_strides", "export_buffer", "flush", "live_exports", "negotiate"),
        "dlpack_ctypes.producer",
    ),
}



def _load_all_before_fork() -> None:
    # Names load on first access, possibly on another thread while this one forks. A fork in
    # the middle of that import would copy its module lock, held by a thread the child does not
    # have, and the child's first access to that module would wait forever. So the first fork
    # loads every module behind a lazy name (waiting for another thread's import in progress
    # through the import system's own locks); the child then never imports them.
    for module in sorted(set(_LAZY.values())):
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
        AttributeError: ``name`` is not a public name of this package.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dlpack_ctypes' has no attribute {name!r}")
    __import__(module)  # the import statement's machinery: -X importtime reports it
    found = sys.modules[module]
    value = found if name == "abi" else getattr(found, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
