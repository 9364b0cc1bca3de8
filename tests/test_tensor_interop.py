"""pb_tensor.Tensor with PyTorch and JAX: zero copy both ways, upstream's DLPack tests.

Every test skips when its framework is not installed. Zero copy is proven with data pointers
and ``np.shares_memory``, and by writing through one side and reading the other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import dlpack_ctypes as dl
from pb_tensor import MemoryType, Tensor, TritonDtype, TritonModelException
from pb_tensor import tensor as _tensor_module

NOT_CONTIGUOUS = (
    "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in C-Order "
    "are supported."
)


def _aligned(n: int, dtype: Any, *, misalign: int = 0) -> np.ndarray[Any, Any]:
    """A 1-D array whose data starts ``misalign`` bytes after a 64-byte boundary."""
    dt = np.dtype(dtype)
    raw = np.zeros(n * dt.itemsize + 128, dtype=np.uint8)
    start = -raw.ctypes.data % 64 + misalign
    out = raw[start : start + n * dt.itemsize].view(dt)
    assert out.ctypes.data % 64 == misalign
    return out


@pytest.fixture(params=["numpy", "ctypes"])
def exporter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which exporter CPU tensors use: numpy's (numpy >= 2.4) or dlpack_ctypes' (forced)."""
    if request.param == "ctypes":
        monkeypatch.setattr(_tensor_module, "_NUMPY_EXPORTS", False)
    elif not _tensor_module._NUMPY_EXPORTS:
        pytest.skip("this numpy's exporter is not used (numpy < 2.4)")
    return str(request.param)


# ================================================================================================
# PyTorch


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch")


TORCH_DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"]


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_upstream_pytorch_dlpack(torch: Any, dtype: str, exporter: str) -> None:
    # Upstream test_pytorch_dlpack, with zero copy checked on every hop.
    from torch.utils.dlpack import from_dlpack, to_dlpack

    t = torch.ones([100], dtype=getattr(torch, dtype))
    # capsule path
    pb = Tensor.from_dlpack("test_tensor", to_dlpack(t))
    np.testing.assert_array_equal(pb.as_numpy(), t.numpy())
    assert pb.data_ptr == t.data_ptr()
    back = from_dlpack(pb.to_dlpack())
    assert back.type() == t.type()
    assert torch.equal(back, t)
    assert back.data_ptr() == t.data_ptr()
    # protocol path, and pb as the producer
    pb2 = Tensor.from_dlpack("test_tensor", t)
    np.testing.assert_array_equal(pb2.as_numpy(), t.numpy())
    back2 = torch.from_dlpack(pb2)
    assert back2.type() == t.type()
    assert torch.equal(back2, t)
    assert back2.data_ptr() == t.data_ptr()
    assert np.shares_memory(pb2.as_numpy(), t.numpy())


def test_torch_bool(torch: Any) -> None:
    t = torch.tensor([True, False, True])
    pb = Tensor.from_dlpack("b", t)
    assert pb.triton_dtype() is TritonDtype.TYPE_BOOL
    np.testing.assert_array_equal(pb.as_numpy(), [True, False, True])
    back = torch.from_dlpack(pb)
    assert back.dtype == torch.bool
    assert back.data_ptr() == t.data_ptr()
    from torch.utils.dlpack import from_dlpack

    assert torch.equal(from_dlpack(pb.to_dlpack()), t)


def test_upstream_bf16_through_torch(torch: Any) -> None:
    # qa identity_bf16 model: BF16 in, to_dlpack -> torch -> from_dlpack(to_dlpack(t)).
    from torch.utils.dlpack import from_dlpack, to_dlpack

    t = torch.tensor([1.5, -2.25, 3.0, 0.0], dtype=torch.bfloat16)
    pb_in = Tensor.from_dlpack("INPUT0", t)
    assert pb_in.triton_dtype() is TritonDtype.TYPE_BF16
    mid = from_dlpack(pb_in.to_dlpack())
    assert mid.dtype == torch.bfloat16
    assert mid.data_ptr() == t.data_ptr()
    out = Tensor.from_dlpack("OUTPUT0", to_dlpack(mid))
    assert out.triton_dtype() is TritonDtype.TYPE_BF16
    assert out.triton_dtype().wire_name == "BF16"
    assert torch.equal(torch.from_dlpack(out), t)
    try:
        import ml_dtypes
    except ImportError:
        with pytest.raises(TritonModelException, match=r"(?i)tensor dtype is bf16 and cannot "
                                                        r"be converted to numpy"):
            out.as_numpy()
    else:
        view = out.as_numpy()
        assert view.dtype == ml_dtypes.bfloat16
        assert view.ctypes.data == t.data_ptr()
        # The view is cached and exporting afterwards still works.
        assert torch.equal(torch.from_dlpack(out), t)


def test_upstream_non_contiguous_error(torch: Any) -> None:
    from torch.utils.dlpack import to_dlpack

    t = torch.transpose(torch.rand([20, 30], dtype=torch.float16), 0, 1)
    with pytest.raises(TritonModelException) as exc:
        Tensor.from_dlpack("test_tensor", to_dlpack(t))
    assert str(exc.value) == NOT_CONTIGUOUS
    with pytest.raises(TritonModelException) as exc:
        Tensor.from_dlpack("test_tensor", t)
    assert str(exc.value) == NOT_CONTIGUOUS


def test_upstream_cpu_numpy(torch: Any, exporter: str) -> None:
    # Upstream test_dlpack_cpu_numpy.
    t = torch.rand([4, 5], dtype=torch.float16)
    pb = Tensor.from_dlpack("tensor", t)
    out = np.from_dlpack(pb)
    np.testing.assert_array_equal(out, t.numpy())
    assert pb.is_cpu()
    assert pb.__dlpack_device__() == tuple(t.__dlpack_device__())
    assert out.ctypes.data == t.data_ptr()


@pytest.mark.parametrize(
    "make",
    [
        lambda torch: torch.ones((1, 1, 6, 6)).contiguous(),
        lambda torch: torch.ones((6, 1)),
        lambda torch: torch.ones((1, 6))[:, :],
        lambda torch: torch.ones((4, 6))[1:2],
        lambda torch: torch.ones((0,)),
        lambda torch: torch.ones((0, 0, 0)),
        lambda torch: torch.ones((2, 3, 0)),
        lambda torch: torch.ones((2, 0, 2)),
        lambda torch: torch.ones((3, 4)).T[:, 1:2],
        lambda torch: torch.tensor(5.0),
    ],
    ids=["1x1x6x6", "6x1", "1x6", "row-slice", "0", "0x0x0", "2x3x0", "2x0x2", "Tx1", "0-d"],
)
def test_torch_shapes_upstream_rejected(torch: Any, make: Any) -> None:
    # fix: server#6102/#6960 shapes (size-1 dims with normalised strides, empty tensors) that
    # upstream's contiguity check rejects.
    t = make(torch)
    pb = Tensor.from_dlpack("x", t)
    assert pb.shape() == list(t.shape)
    np.testing.assert_array_equal(pb.as_numpy(), t.numpy())
    back = torch.from_dlpack(pb)
    assert back.shape == t.shape
    if t.numel():
        assert back.data_ptr() == t.data_ptr()


@pytest.mark.parametrize(
    "make",
    [lambda torch: torch.ones((4, 6))[::2], lambda torch: torch.ones(10)[::2],
     lambda torch: torch.ones((4, 6))[:, 1:3]],
    ids=["row-strided", "1d-strided", "column-slice"],
)
def test_torch_strided_views_rejected(torch: Any, make: Any) -> None:
    # fix: upstream accepts these and reads the wrong elements.
    with pytest.raises(TritonModelException) as exc:
        Tensor.from_dlpack("x", make(torch))
    assert str(exc.value) == NOT_CONTIGUOUS


def test_torch_write_through(torch: Any, exporter: str) -> None:
    t = torch.zeros(4, dtype=torch.int32)
    pb = Tensor.from_dlpack("x", t)
    pb.as_numpy()[1] = 7  # as_numpy() is a view (upstream: a copy)
    assert int(t[1]) == 7
    back = torch.from_dlpack(Tensor("y", np.arange(3, dtype=np.int64)))
    back[0] = 9
    assert back.tolist() == [9, 1, 2]


def test_numpy_to_torch_zero_copy(torch: Any, exporter: str) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    pb = Tensor("x", a)
    t = torch.from_dlpack(pb)
    assert t.data_ptr() == a.ctypes.data
    a[1, 1] = 42
    assert float(t[1, 1]) == 42
    t2 = torch.utils.dlpack.from_dlpack(pb.to_dlpack())
    assert t2.data_ptr() == a.ctypes.data


def test_torch_tensor_outlives_pb(torch: Any) -> None:
    a = np.arange(4, dtype=np.float64)
    pb = Tensor.from_dlpack("x", dl.BufferExporter.from_numpy(a))
    t = torch.from_dlpack(pb)
    del pb
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert dl.live_exports() >= 1
    del t
    assert dl.live_exports() == 0


def test_torch_read_only_like_numpy(torch: Any) -> None:
    # Read-only data goes out as a versioned READ_ONLY capsule: torch treats the Tensor exactly
    # as it treats the numpy array itself (it never gets a legacy capsule hiding the flag).
    a = np.arange(3, dtype=np.float32)
    a.flags.writeable = False
    direct = torch.from_dlpack(a)
    via_pb = torch.from_dlpack(Tensor("x", a))
    assert via_pb.data_ptr() == direct.data_ptr() == a.ctypes.data
    assert via_pb.tolist() == [0.0, 1.0, 2.0]


# ================================================================================================
# JAX


@pytest.fixture(scope="module")
def jnp() -> Any:
    pytest.importorskip("jax")
    import jax.numpy

    return jax.numpy


def _jax_ptr(x: Any) -> int:
    return int(x.unsafe_buffer_pointer())


def test_jax_to_tensor_zero_copy(jnp: Any) -> None:
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    pb = Tensor.from_dlpack("x", x)
    assert pb.triton_dtype() is TritonDtype.TYPE_FP32
    assert pb.memory_type is MemoryType.CPU
    assert pb.data_ptr == _jax_ptr(x)
    out = pb.as_numpy()
    assert out.ctypes.data == _jax_ptr(x)
    np.testing.assert_array_equal(out, np.asarray(x))
    back = np.from_dlpack(pb)
    assert back.ctypes.data == _jax_ptr(x)


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int32", "float16", "float32"])
def test_jax_dtypes(jnp: Any, dtype: str) -> None:
    x = jnp.ones((2, 3), dtype=dtype)
    pb = Tensor.from_dlpack("x", x)
    np.testing.assert_array_equal(pb.as_numpy(), np.asarray(x))
    assert pb.as_numpy().dtype == np.dtype(dtype)


def test_jax_bf16(jnp: Any) -> None:
    x = jnp.array([1.5, 2.5], dtype=jnp.bfloat16)
    pb = Tensor.from_dlpack("x", x)
    assert pb.triton_dtype() is TritonDtype.TYPE_BF16
    assert pb.data_ptr == _jax_ptr(x)
    y = jnp.from_dlpack(pb)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, dtype=np.float32), [1.5, 2.5])


def test_numpy_to_jax_aligned_zero_copy(jnp: Any, exporter: str) -> None:
    a = _aligned(6, np.float32)
    a[:] = np.arange(6)
    pb = Tensor("x", a)
    j = jnp.from_dlpack(pb)
    assert _jax_ptr(j) == a.ctypes.data
    a[0] = 99  # JAX arrays are immutable, but the memory is shared
    assert float(j[0]) == 99


def test_numpy_to_jax_unaligned_is_copied(jnp: Any, exporter: str) -> None:
    # JAX needs 64-byte-aligned CPU buffers; it copies others. The values are still right,
    # the memory is not shared, and our export is released.
    a = _aligned(6, np.float32, misalign=4)
    a[:] = np.arange(6)
    pb = Tensor("x", a)
    j = jnp.from_dlpack(pb)
    assert _jax_ptr(j) != a.ctypes.data
    np.testing.assert_array_equal(np.asarray(j), np.arange(6))
    a[0] = 99
    assert float(j[0]) == 0
    del j


def test_tensor_to_jax_through_our_producer(jnp: Any) -> None:
    # A BF16/pinned-free tensor that exports through dlpack_ctypes (imported via our producer).
    a = _aligned(4, np.int32)
    a[:] = [1, 2, 3, 4]
    pb = Tensor.from_dlpack("x", dl.BufferExporter.from_numpy(a))
    j = jnp.from_dlpack(pb)
    assert _jax_ptr(j) == a.ctypes.data
    assert j.tolist() == [1, 2, 3, 4]
    del j, pb


def test_jax_array_outlives_pb(jnp: Any) -> None:
    x = jnp.arange(5.0)
    pb = Tensor.from_dlpack("x", x)
    out = pb.as_numpy()
    del pb, x
    np.testing.assert_array_equal(out, np.arange(5.0))


def test_jax_to_torch_through_tensor(jnp: Any, torch: Any) -> None:
    x = jnp.arange(4, dtype=jnp.int64) if jnp.arange(1).dtype == jnp.int64 else jnp.arange(4)
    pb = Tensor.from_dlpack("x", x)
    t = torch.from_dlpack(pb)
    assert t.data_ptr() == _jax_ptr(x)
    assert t.tolist() == [0, 1, 2, 3]
