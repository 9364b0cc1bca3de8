"""Pure-Python (ctypes) binding of the DLPack C ABI, v1.3.

Produce DLPack capsules from any memory and consume capsules from any producer (numpy, PyTorch,
JAX, CuPy ...) with no compiled code::

    import numpy as np
    import dlpack_ctypes as dl

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.from_dlpack(dl.BufferExporter.from_numpy(a))   # our producer, numpy consumer
    t = dl.from_dlpack(a)                                 # numpy producer, our consumer
    view = t.numpy()                                      # zero-copy, keeps the tensor alive
"""

from __future__ import annotations

from dlpack_ctypes import abi
from dlpack_ctypes._capi import CapsuleType
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
    NUMPY_EXPORTER_KEEPS_RULES,
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
