"""Static types of dlpack_ctypes' public API (checked by ``mypy --strict``; also runs under pytest).

``assert_type`` fails type checking when an inferred type differs; the ``type: ignore[...]``
lines fail it (warn_unused_ignores) when a call that must be rejected is accepted.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pytest
from typing_extensions import CapsuleType, assert_type

import dlpack_ctypes as dl
from dlpack_ctypes import abi


def test_producer_types() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    capsule = dl.to_dlpack(a, stream=None, max_version=(1, 3), dl_device=(1, 0), copy=None)
    assert_type(capsule, CapsuleType)
    exporter = dl.BufferExporter.from_numpy(a)
    assert_type(exporter, dl.BufferExporter)
    assert_type(exporter.__dlpack__(max_version=(1, 0)), CapsuleType)
    assert_type(exporter.__dlpack_device__(), tuple[dl.DLDeviceType, int])
    raw = dl.BufferExporter(a, a.ctypes.data, (6,), None, dl.DataType(2, 32), (1, 0),
                            readonly=True)
    assert_type(raw, dl.BufferExporter)
    exported = dl.export_buffer(a, a.ctypes.data, [6], [1], dl.DataType(2, 32, 1),
                                versioned=False, readonly=False, copied=False)
    assert_type(exported, CapsuleType)
    assert_type(dl.negotiate((1, 0), max_version=(1, 0)), tuple[bool, bool, tuple[int, int]])
    assert_type(dl.flush(), int)
    assert_type(dl.live_exports(), int)
    del capsule, exported
    dl.flush()


def test_consumer_types() -> None:
    a = np.arange(6, dtype=np.float32)
    t = dl.from_dlpack(a, device=None, copy=None, stream=None, check=None)
    assert_type(t, dl.DLPackTensor)
    assert_type(t.data, int)
    assert_type(t.byte_offset, int)
    assert_type(t.device, tuple[dl.DLDeviceType, int])
    assert_type(t.dtype, dl.DataType)
    assert_type(t.shape, tuple[int, ...])
    assert_type(t.strides, tuple[int, ...])
    assert_type(t.readonly, bool)
    assert_type(t.version, tuple[int, int] | None)
    assert_type(t.flags, int)
    assert_type(t.is_copied, bool)
    assert_type(t.closed, bool)
    assert_type(t.ndim, int)
    assert_type(t.size, int)
    assert_type(t.nbytes, int)
    assert_type(t.is_c_contiguous(), bool)
    assert_type(t.numpy(), np.ndarray[Any, Any])
    assert_type(t.numpy(raw=True), np.ndarray[Any, Any])
    with t as entered:
        assert_type(entered, dl.DLPackTensor)
    assert_type(t.close(), None)

    def check(tensor: dl.DLPackTensor) -> None:
        assert tensor.ndim == 1

    t2 = dl.consume(a.__dlpack__(), check=check)
    assert_type(t2, dl.DLPackTensor)
    t2.close()


def test_dtype_types() -> None:
    dt = dl.from_numpy_dtype(np.dtype(np.int16))
    assert_type(dt, dl.DataType)
    assert_type(dt.code, int)
    assert_type(dt.bits, int)
    assert_type(dt.lanes, int)
    assert_type(dt.itemsize, int)
    assert_type(dl.to_numpy_dtype(dt), np.dtype[Any] | None)
    assert_type(dl.DLDataTypeCode(4), dl.DLDataTypeCode)
    assert_type(dl.DLDeviceType(2), dl.DLDeviceType)
    assert_type(abi.kDLCPU, Literal[abi.DLDeviceType.kDLCPU])
    assert_type(abi.kDLFloat, Literal[abi.DLDataTypeCode.kDLFloat])
    assert_type(dl.DLPACK_ABI_VERSION, tuple[int, int])
    assert_type(dl.DLPACK_FLAG_BITMASK_READ_ONLY, Literal[1])
    assert_type(abi.NAME_DLTENSOR_VERSIONED, Literal[b"dltensor_versioned"])
    assert_type(dl.HOST_DEVICES, frozenset[dl.DLDeviceType])


def test_rejected_calls() -> None:
    # Each of these is a type error (the ignore would be reported as unused otherwise) and a
    # runtime error.
    with pytest.raises(TypeError):
        dl.to_dlpack([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dl.to_dlpack(np.zeros(2), max_version="1.3")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dl.from_dlpack(np.zeros(2), (1, 0))  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        dl.BufferExporter.from_numpy(np.zeros(2)).__dlpack__((1, 0))  # type: ignore[call-arg]
