"""Static types of pb_tensor's Tensor API (checked by ``mypy --strict``; also runs under pytest).

``assert_type`` fails type checking when an inferred type differs; the ``type: ignore[...]``
lines fail it (warn_unused_ignores) when a call that must be rejected is accepted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from typing_extensions import CapsuleType, assert_type

import dlpack_ctypes as dl
import pb_tensor
from pb_tensor import (
    MemoryType,
    Tensor,
    TritonBufferError,
    TritonDtype,
    TritonModelException,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)


def test_tensor_types() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = Tensor("x", a)
    assert_type(t, Tensor)
    assert_type(t.name(), str)
    assert_type(t.shape(), list[int])
    assert_type(t.is_cpu(), bool)
    assert_type(t.as_numpy(), np.ndarray[Any, Any])
    assert_type(t.triton_dtype(), TritonDtype)
    assert_type(t.memory_type, MemoryType)
    assert_type(t.memory_type_id, int)
    assert_type(t.byte_size, int)
    assert_type(t.data_ptr, int)
    assert_type(t.__dlpack_device__(), tuple[dl.DLDeviceType, int])
    assert_type(t.to_host(), Tensor)
    assert_type(repr(t), str)
    capsule = t.to_dlpack()
    assert_type(capsule, CapsuleType)
    assert_type(t.__dlpack__(), CapsuleType)
    assert_type(
        t.__dlpack__(stream=None, max_version=(1, 3), dl_device=(1, 0), copy=False), CapsuleType
    )
    u = Tensor.from_dlpack("y", capsule)
    assert_type(u, Tensor)
    assert_type(Tensor.from_dlpack("z", a), Tensor)
    assert_type(Tensor.from_dlpack("w", t), Tensor)


def test_rejected_calls() -> None:
    a = np.zeros(2)
    with pytest.raises(TypeError):
        Tensor(name="x", array=a)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Tensor(None, a)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Tensor("x", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Tensor.from_dlpack(1, a)  # type: ignore[arg-type]
    t = Tensor("x", a)
    with pytest.raises(TypeError):
        t.__dlpack__(None)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        t.byte_size = 3  # type: ignore[misc]


def test_helper_types() -> None:
    assert_type(numpy_to_triton_type(np.float32), TritonDtype | None)
    assert_type(triton_to_numpy_type(11), type[np.generic] | None)
    assert_type(triton_string_to_numpy("TYPE_FP32"), type[np.generic] | type[bool])
    arr = np.array([b"a"], dtype=object)
    assert_type(serialize_byte_tensor(arr), bytes | tuple[()] | None)
    assert_type(deserialize_bytes_tensor(b"\x01\x00\x00\x00a"), npt.NDArray[np.object_])
    assert_type(TritonDtype.TYPE_FP32.wire_name, str)
    assert_type(TritonDtype.TYPE_FP32.itemsize, int)
    assert_type(pb_tensor.__version__, str)


def test_exception_types() -> None:
    exc: TritonModelException = TritonBufferError("x")
    buf: BufferError = TritonBufferError("x")
    assert isinstance(exc, BufferError)
    assert isinstance(buf, TritonModelException)
