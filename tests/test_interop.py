"""dlpack_ctypes with PyTorch and JAX (each skipped when not installed).

Zero-copy is checked with data pointers: ``Tensor.data_ptr()`` and
``jax.Array.unsafe_buffer_pointer()``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
from conftest import ToDlpack

import dlpack_ctypes as dl
from dlpack_ctypes import DataType, DLDeviceType


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def jax() -> Any:
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.numpy")
    return jax


def data_ptr(a: np.ndarray[Any, Any]) -> int:
    return int(a.__array_interface__["data"][0])


def aligned(shape: tuple[int, ...], dtype: Any = np.float32, align: int = 64) -> Any:
    """A C-contiguous array whose data is ``align``-byte aligned (JAX imports those zero-copy)."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    buf = np.zeros(nbytes + align, dtype=np.uint8)
    start = -data_ptr(buf) % align
    out = buf[start : start + nbytes].view(dt).reshape(shape)
    assert data_ptr(out) % align == 0
    return out


# ------------------------------------------------------------------------------------------------
# torch consuming our exports


@pytest.mark.parametrize("kind", ["BufferExporter", "to_dlpack", "legacy capsule",
                                  "versioned capsule"])
def test_torch_from_our_exports(torch: Any, kind: str) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    base = sys.getrefcount(a)
    source: Any = {
        "BufferExporter": lambda: dl.BufferExporter.from_numpy(a),
        "to_dlpack": lambda: ToDlpack(a),
        "legacy capsule": lambda: dl.to_dlpack(a),
        "versioned capsule": lambda: dl.to_dlpack(a, max_version=(1, 3)),
    }[kind]()
    t = torch.from_dlpack(source)
    del source
    assert t.data_ptr() == data_ptr(a)
    assert t.shape == (3, 4)
    assert t.dtype == torch.float32
    assert t.tolist() == a.tolist()
    t[1, 2] = -7.0  # torch -> numpy
    assert a[1, 2] == -7.0
    a[0, 0] = 42.0  # numpy -> torch
    assert t[0, 0].item() == 42.0
    assert dl.live_exports() == 1
    del t
    assert dl.live_exports() == 0
    assert sys.getrefcount(a) == base


def test_torch_from_our_strided_exports(torch: Any) -> None:
    a = np.arange(60, dtype=np.int64).reshape(3, 4, 5)
    for v in (a[:, 1:, ::2], a.transpose(2, 0, 1), np.asfortranarray(a), a[1, 2, 3, ...]):
        t = torch.from_dlpack(dl.BufferExporter.from_numpy(v))
        assert t.data_ptr() == data_ptr(v)
        assert tuple(t.stride()) == tuple(s // v.itemsize for s in v.strides)
        assert t.numpy().tolist() == v.tolist()


@pytest.mark.parametrize("torch_dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_torch_from_raw_bfloat16_float8(torch: Any, torch_dtype: str) -> None:
    # numpy cannot import these codes, torch can: export raw integer storage as DLPack bf16/fp8.
    reference = torch.tensor([0.5, -1.0, 2.0, 3.5]).to(getattr(torch, torch_dtype))
    code = {"bfloat16": 4, "float8_e4m3fn": 10, "float8_e5m2": 12}[torch_dtype]
    bits = reference.element_size() * 8
    storage = reference.view(torch.uint8 if bits == 8 else torch.int16).numpy().copy()
    exporter = dl.BufferExporter(storage, data_ptr(storage), (4,), None, DataType(code, bits, 1))
    t = torch.from_dlpack(exporter)
    assert t.dtype == getattr(torch, torch_dtype)
    assert t.data_ptr() == data_ptr(storage)
    assert torch.equal(t.float(), reference.float())


def test_torch_readonly_and_copy(torch: Any) -> None:
    a = np.arange(6, dtype=np.float64)
    a.flags.writeable = False
    # torch asks for max_version=(1, 0): our versioned capsule carries READ_ONLY (torch itself
    # imports it writable; that is torch's policy).
    t = torch.from_dlpack(dl.BufferExporter.from_numpy(a))
    assert t.data_ptr() == data_ptr(a)
    del t
    c = torch.from_dlpack(dl.BufferExporter.from_numpy(a), copy=True)
    assert c.data_ptr() != data_ptr(a)
    assert c.tolist() == a.tolist()
    # A legacy capsule of read-only data is refused by our producer.
    with pytest.raises(BufferError, match=r"read-only"):
        dl.to_dlpack(a)


# ------------------------------------------------------------------------------------------------
# our consumer of torch tensors


def test_from_torch(torch: Any) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    x = dl.from_dlpack(t)
    assert x.data == t.data_ptr()
    assert x.version is not None
    assert x.version[0] == 1
    assert (x.shape, x.strides, x.dtype) == ((3, 4), (4, 1), DataType(2, 32, 1))
    assert x.device == (DLDeviceType.kDLCPU, 0)
    v = x.numpy()
    assert data_ptr(v) == t.data_ptr()
    v[2, 1] = -1.0  # numpy -> torch
    assert t[2, 1].item() == -1.0
    t[0, 3] = 99.0  # torch -> numpy
    assert v[0, 3] == 99.0
    x.close()
    del v
    # Legacy capsule from torch.
    x = dl.consume(t.__dlpack__())
    assert x.version is None
    assert x.data == t.data_ptr()
    assert x.numpy().tolist() == t.tolist()


@pytest.mark.parametrize(
    ("name", "expected"),
    [("bool", (6, 8)), ("int8", (0, 8)), ("uint8", (1, 8)), ("int16", (0, 16)),
     ("uint16", (1, 16)), ("int32", (0, 32)), ("int64", (0, 64)), ("float16", (2, 16)),
     ("float32", (2, 32)), ("float64", (2, 64)), ("complex64", (5, 64)),
     ("complex128", (5, 128)), ("bfloat16", (4, 16)), ("float8_e4m3fn", (10, 8)),
     ("float8_e5m2", (12, 8))],
)
def test_from_torch_dtypes(torch: Any, name: str, expected: tuple[int, int]) -> None:
    torch_dtype = getattr(torch, name, None)
    if torch_dtype is None:
        pytest.skip(f"torch has no {name}")
    t = torch.arange(6).to(torch_dtype)
    x = dl.from_dlpack(t)
    assert x.dtype == DataType(*expected, 1)
    assert x.data == t.data_ptr()
    raw = x.numpy(raw=True)
    assert data_ptr(raw) == t.data_ptr()
    assert raw.tobytes() == t.view(torch.uint8).numpy().tobytes()
    if name.startswith(("bfloat", "float8")):
        if dl.to_numpy_dtype(x.dtype) is not None:  # ml_dtypes installed
            assert x.numpy().astype(np.float32).tolist() == t.float().tolist()
    else:
        assert x.numpy().tolist() == t.tolist()


def test_from_torch_layouts(torch: Any) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    for t in (base.t(), base[1:, ::2], base[2:], base[1, 2], torch.empty(0, 3),
              base.expand(2, 4, 6)):
        x = dl.from_dlpack(t)
        assert x.shape == tuple(t.shape)
        assert x.strides == tuple(t.stride())
        assert x.data == t.data_ptr()
        v = x.numpy()
        assert v.tolist() == t.tolist()
        if t.numel():
            assert data_ptr(v) == t.data_ptr()


def test_from_torch_copy_and_errors(torch: Any) -> None:
    t = torch.arange(4.0)
    x = dl.from_dlpack(t, copy=True)
    assert x.data != t.data_ptr()
    assert x.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    x.close()
    with pytest.raises(BufferError, match=r"require gradient"):
        dl.from_dlpack(torch.ones(2, requires_grad=True))


def test_torch_round_trip_through_us(torch: Any) -> None:
    # torch -> our consumer -> our producer -> torch: the same memory all the way.
    t = torch.arange(10, dtype=torch.int32)
    view = dl.from_dlpack(t).numpy()
    t2 = torch.from_dlpack(dl.BufferExporter.from_numpy(view))
    assert t2.data_ptr() == t.data_ptr()
    t2[4] = 40
    assert t[4].item() == 40
    del view
    assert dl.live_exports() == 1
    del t2
    assert dl.live_exports() == 0


# ------------------------------------------------------------------------------------------------
# JAX


def test_jax_from_our_exports(jax: Any) -> None:
    jnp = jax.numpy
    a = aligned((3, 4))
    a[...] = np.arange(12).reshape(3, 4)
    for source in (dl.BufferExporter.from_numpy(a), ToDlpack(a)):
        j = jnp.from_dlpack(source)
        assert j.unsafe_buffer_pointer() == data_ptr(a)
        assert np.asarray(j).tolist() == a.tolist()
        a[0, 0] += 100.0  # JAX arrays are immutable, but the buffer is shared
        assert float(j[0, 0]) == a[0, 0]
        del j
    assert dl.live_exports() == 0


def test_jax_gets_legacy_capsules(jax: Any) -> None:
    # JAX accepts only "dltensor": it calls __dlpack__(stream=None), so we produce legacy.
    a = aligned((8,))
    producer = ToDlpack(a)
    j = jax.numpy.from_dlpack(producer)
    assert producer.calls == [{"stream": None}]
    assert j.unsafe_buffer_pointer() == data_ptr(a)
    # A read-only array cannot travel as a legacy capsule.
    a.flags.writeable = False
    with pytest.raises(BufferError, match=r"read-only"):
        jax.numpy.from_dlpack(dl.BufferExporter.from_numpy(a))


def test_from_jax(jax: Any) -> None:
    jnp = jax.numpy
    j = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    x = dl.from_dlpack(j)
    assert x.version is None  # JAX always produces legacy capsules
    assert x.data == j.unsafe_buffer_pointer()
    assert (x.shape, x.strides, x.dtype) == ((3, 4), (4, 1), DataType(2, 32, 1))
    assert x.device == (DLDeviceType.kDLCPU, 0)
    v = x.numpy()
    assert data_ptr(v) == j.unsafe_buffer_pointer()
    assert v.tolist() == np.asarray(j).tolist()


def test_from_jax_bfloat16(jax: Any) -> None:
    jnp = jax.numpy
    j = jnp.array([1.0, 2.5, -3.0], dtype=jnp.bfloat16)
    x = dl.from_dlpack(j)
    assert x.dtype == DataType(4, 16, 1)
    assert x.data == j.unsafe_buffer_pointer()
    assert x.numpy(raw=True).tobytes() == np.asarray(j).tobytes()
    if dl.to_numpy_dtype(x.dtype) is not None:  # ml_dtypes installed (a JAX dependency)
        assert x.numpy().astype(np.float32).tolist() == [1.0, 2.5, -3.0]
