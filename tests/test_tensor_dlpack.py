"""pb_tensor.Tensor and DLPack: ``from_dlpack`` (capsules and producers) and ``__dlpack__``.

Capsules are hand-built with ``make_capsule`` (conftest: counting deleter, C-style destructor;
its teardown asserts every deleter ran exactly once) or produced by ``dlpack_ctypes``; the
autouse leak fixture asserts ``dlpack_ctypes.live_exports() == 0`` after every test.
Upstream bugs fixed here are marked "fix:" (see the README's "Differences from Triton").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import capsule_name, capsule_pointer

import dlpack_ctypes as dl
from dlpack_ctypes import abi
from pb_tensor import MemoryType, Tensor, TritonBufferError, TritonDtype, TritonModelException
from pb_tensor import tensor as _tensor_module

NOT_CONTIGUOUS = (
    "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in C-Order "
    "are supported."
)
NOT_A_PRODUCER = (
    "Provided tensor is not supported. Tensor must be a DLPack capsule or have `__dlpack__` "
    "and `__dlpack_device__` attributes"
)
BF16_NUMPY = (
    "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and from_dlpack() "
    "instead."
)
GPU_NUMPY = "Tensor is stored in GPU and cannot be converted to NumPy."
READ_ONLY = abi.DLPACK_FLAG_BITMASK_READ_ONLY
IS_COPIED = abi.DLPACK_FLAG_BITMASK_IS_COPIED
BF16 = dl.DataType(int(abi.kDLBfloat), 16, 1)


def _struct(capsule: object) -> dict[str, Any]:
    """The fields of a fresh DLPack capsule, read with the ctypes mirrors."""
    name = capsule_name(capsule)
    assert name is not None
    ptr = capsule_pointer(capsule, name)
    out: dict[str, Any] = {"name": name}
    if name.endswith(b"versioned"):
        m = abi.DLManagedTensorVersioned.from_address(ptr)
        out["version"] = (m.version.major, m.version.minor)
        out["flags"] = m.flags
    else:
        lm = abi.DLManagedTensor.from_address(ptr)
        out["version"] = None
        out["flags"] = 0
        m = lm  # type: ignore[assignment]
    t = m.dl_tensor
    out["data"] = (t.data or 0) + t.byte_offset
    out["device"] = (t.device.device_type, t.device.device_id)
    out["dtype"] = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
    out["shape"] = tuple(t.shape[i] for i in range(t.ndim))
    out["strides"] = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
    return out


def _bf16_tensor(values: list[float]) -> tuple[Tensor, np.ndarray[Any, Any]]:
    """A BF16 Tensor over uint16 host memory (bfloat16 = the top half of a float32)."""
    bits = (np.array(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    exporter = dl.BufferExporter(bits, bits.ctypes.data, bits.shape, None, BF16)
    return Tensor.from_dlpack("bf16", exporter), bits


def _error(fn: Callable[..., object], *args: object) -> Exception:
    """The exception ``fn(*args)`` raises, with its tracebacks cleared: their frames would
    otherwise keep the capsule or tensor alive and hide whether the deleter ran."""
    try:
        fn(*args)
    except Exception as exc:
        link: BaseException | None = exc
        while link is not None:
            link.__traceback__ = None
            link = link.__cause__ or link.__context__
        return exc
    raise AssertionError("no exception raised")


class FakeProducer:
    """A DLPack producer whose device and capsule are chosen by the test."""

    def __init__(self, device: tuple[int, int], make: Callable[..., Any] | None = None) -> None:
        self.device = device
        self.make = make
        self.calls: list[dict[str, Any]] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        assert self.make is not None, "__dlpack__ must not be called"
        return self.make(**kwargs)


# ================================================================================================
# Import: what is accepted, zero copy


@pytest.mark.parametrize("via", ["protocol", "numpy-capsule", "legacy-capsule", "our-capsule"])
def test_import_numpy_zero_copy(via: str) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    src: object = {
        "protocol": a,
        "numpy-capsule": a.__dlpack__(max_version=(1, 0)) if via == "numpy-capsule" else None,
        "legacy-capsule": a.__dlpack__() if via == "legacy-capsule" else None,
        "our-capsule": dl.to_dlpack(a, max_version=(1, 0)) if via == "our-capsule" else None,
    }[via]
    t = Tensor.from_dlpack("x", src)
    assert t.shape() == [3, 4]
    assert t.triton_dtype() is TritonDtype.TYPE_FP32
    assert t.data_ptr == a.ctypes.data
    assert t.byte_size == a.nbytes
    out = t.as_numpy()
    assert np.shares_memory(out, a)
    assert t.as_numpy() is out  # cached: the same object on every call
    if via == "legacy-capsule":
        # Difference from upstream: a legacy capsule cannot say whether writes are allowed,
        # so its view is read-only; re-exporting it as a legacy capsule still works.
        assert not out.flags.writeable
        back = dl.consume(t.to_dlpack(), legacy_writable=True).numpy()
        assert np.shares_memory(back, a)
        out = back
    # Difference from upstream (which copies at import): as_numpy() is a view, so writes
    # reach the producer's memory.
    out[0, 0] = -1
    assert a[0, 0] == -1
    np.testing.assert_array_equal(out, a)


def test_import_numpy_bool() -> None:
    # Upstream test_bool_datatype (its FIXME: numpy now exports bool directly).
    bool_array = np.asarray([False, True])
    bool_tensor = Tensor("tensor", bool_array)
    out = Tensor.from_dlpack("tensor", bool_tensor)
    np.testing.assert_array_equal(out.as_numpy(), bool_array)
    assert out.triton_dtype() is TritonDtype.TYPE_BOOL
    np.testing.assert_array_equal(Tensor.from_dlpack("direct", bool_array).as_numpy(), bool_array)


def test_import_tensor_into_tensor_shares_memory() -> None:
    a = np.arange(5, dtype=np.int64)
    t = Tensor("x", a)
    u = Tensor.from_dlpack("y", t)
    assert u.name() == "y"
    assert u.data_ptr == a.ctypes.data
    del t
    np.testing.assert_array_equal(u.as_numpy(), np.arange(5))


def test_legacy_producer_without_max_version() -> None:
    # A producer that knows only ``stream`` (DLPack < 1.0): retried without the new keywords.
    a = np.arange(4, dtype=np.int32)

    class Legacy:
        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

        def __dlpack__(self, stream: object = None) -> Any:
            return a.__dlpack__()

    t = Tensor.from_dlpack("x", Legacy())
    assert np.shares_memory(t.as_numpy(), a)


@pytest.mark.parametrize("obj", [None, 3, "x", [1, 2], object()], ids=repr)
def test_not_a_producer(obj: object) -> None:
    with pytest.raises(TritonModelException) as info:
        Tensor.from_dlpack("x", obj)
    assert str(info.value) == NOT_A_PRODUCER


def test_producer_missing_dlpack_device() -> None:
    class OnlyDlpack:
        def __dlpack__(self, **kwargs: Any) -> Any:
            raise AssertionError("not called")

    with pytest.raises(TritonModelException, match="__dlpack_device__"):
        Tensor.from_dlpack("x", OnlyDlpack())


def test_producer_buffer_error_is_triton_exception() -> None:
    # numpy refuses big-endian data; model code catching TritonModelException catches it.
    with pytest.raises(TritonModelException, match="byte order") as info:
        Tensor.from_dlpack("x", np.zeros(3, dtype=">i4"))
    assert isinstance(info.value, BufferError)


# ================================================================================================
# Contiguity (fix: upstream skips strides[0] and 1-D tensors, and rejects empty tensors)


@pytest.mark.parametrize(
    ("shape", "strides"),
    [
        ((2, 3), (3, 1)),
        ((1, 1, 4, 4), (1, 1, 4, 1)),  # torch >= 1.13 normalised size-1 strides (server#6102)
        ((1, 3), (99, 1)),
        ((3, 1), (1, 7)),
        ((1,), (5,)),
        ((4, 1, 2), (2, 0, 1)),
        ((0,), (0,)),
        ((0, 0, 0), (0, 0, 0)),  # numpy's strides for empty arrays (server#6960)
        ((2, 3, 0), (0, 0, 0)),
        ((2, 2, 0, 2), (1, 1, 1, 1)),
        ((2, 0, 2), (7, -3, 5)),
        ((3, 0), (1, 1)),
    ],
)
def test_contiguous_strides_accepted(
    make_capsule: Any, shape: tuple[int, ...], strides: tuple[int, ...]
) -> None:
    size = int(np.prod(shape))
    base = np.arange(max(size, 1), dtype=np.float32)
    capsule, _ = make_capsule(base, shape=shape, strides=strides)
    t = Tensor.from_dlpack("x", capsule)
    assert capsule_name(capsule) == b"used_dltensor_versioned"
    assert t.shape() == list(shape)
    out = t.as_numpy()
    assert out.shape == shape
    np.testing.assert_array_equal(out.reshape(-1), base[:size])


@pytest.mark.parametrize(
    ("shape", "strides"),
    [
        ((2, 5), (10, 1)),  # a row-strided view: upstream accepts it and reads the wrong data
        ((5,), (2,)),  # a strided 1-D view: upstream accepts it too
        ((3,), (-1,)),
        ((30, 20), (1, 30)),  # transposed
        ((2, 3), (1, 2)),  # Fortran order
        ((2, 1, 3), (6, 3, 2)),
        ((4, 2), (4, 1)),
    ],
)
def test_non_contiguous_rejected_without_consuming(
    make_capsule: Any, shape: tuple[int, ...], strides: tuple[int, ...]
) -> None:
    base = np.zeros(1000, dtype=np.float32)
    capsule, info = make_capsule(base[500:], shape=shape, strides=strides)
    exc = _error(Tensor.from_dlpack, "x", capsule)
    assert type(exc) is TritonModelException
    assert str(exc) == NOT_CONTIGUOUS
    # Validation happens before the capsule is consumed: it is left as it was, and dropping it
    # releases it (the fixture checks the deleter ran exactly once).
    assert capsule_name(capsule) == b"dltensor_versioned"
    assert info.calls == 0
    del capsule
    assert info.calls == 1


@pytest.mark.parametrize(
    "make",
    [lambda b: b[::2], lambda b: b.reshape(4, 5)[::2], lambda b: b.reshape(4, 5)[:, 1:3],
     lambda b: b.reshape(4, 5).T],
    ids=["1d-step", "row-step", "column-slice", "transposed"],
)
def test_non_contiguous_numpy_views_rejected(make: Any) -> None:
    view = make(np.arange(20, dtype=np.float64))
    with pytest.raises(TritonModelException) as exc:
        Tensor.from_dlpack("x", view)
    assert str(exc.value) == NOT_CONTIGUOUS


def test_null_strides_and_byte_offset(make_capsule: Any) -> None:
    base = np.arange(10, dtype=np.int16)
    capsule, _ = make_capsule(base, shape=(2, 3), strides=None, byte_offset=4, version=None)
    t = Tensor.from_dlpack("x", capsule)
    np.testing.assert_array_equal(t.as_numpy(), base[2:8].reshape(2, 3))
    assert t.data_ptr == base.ctypes.data + 4


def test_null_data_for_empty_tensor(make_capsule: Any) -> None:
    capsule, _ = make_capsule(shape=(2, 0), dtype=(2, 32, 1), data=None)
    t = Tensor.from_dlpack("x", capsule)
    assert t.shape() == [2, 0]
    assert t.byte_size == 0
    assert t.as_numpy().shape == (2, 0)


# ================================================================================================
# Capsule names and ownership


@pytest.mark.parametrize("version", [None, (1, 0), (1, 3)])
def test_consumed_capsule_renamed(make_capsule: Any, version: tuple[int, int] | None) -> None:
    # fix: upstream renames to the non-standard "used_dlpack".
    capsule, info = make_capsule(np.arange(3.0), version=version)
    t = Tensor.from_dlpack("x", capsule)
    expected = b"used_dltensor" if version is None else b"used_dltensor_versioned"
    assert capsule_name(capsule) == expected
    del capsule
    assert info.calls == 0  # the Tensor owns it now
    np.testing.assert_array_equal(t.as_numpy(), [0.0, 1.0, 2.0])
    del t
    assert info.calls == 1


def test_numpy_capsule_renamed() -> None:
    for capsule in (np.arange(3).__dlpack__(), np.arange(3).__dlpack__(max_version=(1, 0))):
        name = capsule_name(capsule)
        Tensor.from_dlpack("x", capsule)
        assert capsule_name(capsule) == b"used_" + (name or b"")


def test_used_capsule_rejected(make_capsule: Any) -> None:
    # fix: upstream does not check capsule names, so a consumed capsule is imported twice
    # (double ownership, a double free later).
    capsule, info = make_capsule(np.arange(3.0))
    t = Tensor.from_dlpack("x", capsule)
    with pytest.raises(TritonModelException, match="already consumed"):
        Tensor.from_dlpack("y", capsule)
    del t
    assert info.calls == 1


def test_foreign_capsule_name_rejected(make_capsule: Any) -> None:
    # Upstream reads any capsule's pointer whatever its name.
    capsule, _ = make_capsule(np.arange(3.0), name=b"not_a_dltensor", deleter=False)
    with pytest.raises(TritonModelException, match="not a DLPack capsule"):
        Tensor.from_dlpack("x", capsule)
    assert capsule_name(capsule) == b"not_a_dltensor"


@pytest.mark.parametrize("version", [None, (1, 3)])
def test_null_deleter_tolerated(make_capsule: Any, version: tuple[int, int] | None) -> None:
    # fix: upstream calls the deleter without a NULL check (the spec allows NULL).
    keep = np.arange(4, dtype=np.uint8)
    capsule, info = make_capsule(keep, deleter=False, version=version)
    t = Tensor.from_dlpack("x", capsule)
    np.testing.assert_array_equal(t.as_numpy(), keep)
    out = np.from_dlpack(t)
    del t, capsule, out
    assert info.calls == 0


# ================================================================================================
# Unsupported dtypes and devices: a Triton error and no leak


@pytest.mark.parametrize(
    "dtype",
    [
        (5, 64, 1),  # complex64
        (5, 128, 1),
        (7, 8, 1), (8, 8, 1), (10, 8, 1), (13, 8, 1), (14, 8, 1),  # the float8 codes
        (2, 8, 1),  # float8 as pre-1.0 producers wrote it (kDLFloat, 8 bits)
        (2, 32, 4),  # lanes != 1
        (0, 8, 2),
        (3, 64, 1),  # opaque handle
        (6, 16, 1),  # bool that is not 8 bits
        (4, 32, 1),  # bfloat that is not 16 bits
        (2, 24, 1),
    ],
)
@pytest.mark.parametrize("version", [None, (1, 3)])
def test_unsupported_dlpack_dtype_no_leak(
    make_capsule: Any, dtype: tuple[int, int, int], version: tuple[int, int] | None
) -> None:
    # fix: upstream renames the capsule, then fails with "Dtype is invalid." and leaks it.
    capsule, info = make_capsule(np.zeros(16, dtype=np.uint8), shape=(2,), dtype=dtype,
                                 version=version)
    exc = _error(Tensor.from_dlpack, "x", capsule)
    assert isinstance(exc, TritonModelException)
    assert capsule_name(capsule) == (b"dltensor" if version is None else b"dltensor_versioned")
    del capsule
    assert info.calls == 1


def test_unsupported_dtype_from_our_producer_no_leak() -> None:
    data = np.zeros(4, dtype=np.complex64)
    exporter = dl.BufferExporter(data, data.ctypes.data, data.shape, None, dl.DataType(5, 64, 1))
    with pytest.raises(TritonModelException, match="Dtype is invalid"):
        Tensor.from_dlpack("x", exporter)
    assert dl.live_exports() == 0
    with pytest.raises(TritonModelException, match="Dtype is invalid"):
        Tensor.from_dlpack("x", exporter.__dlpack__(max_version=(1, 0)))
    assert dl.live_exports() == 0


def test_complex_numpy_rejected() -> None:
    with pytest.raises(TritonModelException, match="Dtype is invalid"):
        Tensor.from_dlpack("x", np.zeros(3, dtype=np.complex128))


@pytest.mark.parametrize("device_type", [4, 7, 10, 11, 13, 14])
def test_unsupported_device_capsule(make_capsule: Any, device_type: int) -> None:
    capsule, info = make_capsule(np.zeros(4, np.float32), device=(device_type, 0))
    exc = _error(Tensor.from_dlpack, "x", capsule)
    assert type(exc) is TritonModelException
    # fix: upstream says "is not support by Python backend."
    assert str(exc) == f"DLDevice type {device_type} is not supported by Python backend."
    assert capsule_name(capsule) == b"dltensor_versioned"
    del capsule
    assert info.calls == 1


@pytest.mark.parametrize("device_type", [4, 10, 13])
def test_unsupported_device_producer(device_type: int) -> None:
    producer = FakeProducer((device_type, 0))
    with pytest.raises(TritonModelException) as exc:
        Tensor.from_dlpack("x", producer)
    assert str(exc.value) == f"DLDevice type {device_type} is not supported by Python backend."
    assert producer.calls == []  # refused before asking for a capsule


def test_gpu_producer_without_cuda() -> None:
    from pb_tensor import cuda

    if cuda.is_available():
        pytest.skip("a CUDA device is present")
    producer = FakeProducer((2, 0))
    with pytest.raises(TritonModelException):
        Tensor.from_dlpack("x", producer)
    assert producer.calls == []


def test_cuda_capsule_wrapped_as_gpu_tensor(make_capsule: Any) -> None:
    # As upstream, the capsule path does not check for a GPU: the tensor is a GPU tensor
    # (upstream test_dlpack_gpu_numpy: is_cpu() False, as_numpy() refused).
    capsule, info = make_capsule(np.zeros(4, np.float16), device=(2, 1))
    t = Tensor.from_dlpack("x", capsule)
    assert t.is_cpu() is False
    assert t.memory_type is MemoryType.GPU
    assert t.memory_type_id == 1
    assert t.__dlpack_device__() == (2, 1)
    assert repr(t) == "Tensor(name='x', dtype=FP16, shape=[4], device=GPU:1)"
    exc = _error(t.as_numpy)
    assert type(exc) is TritonModelException
    assert str(exc) == GPU_NUMPY
    del t
    assert info.calls == 1


# ================================================================================================
# Pinned memory (kDLCUDAHost): fix, upstream imports it as plain CPU


def test_cuda_host_producer_imports_as_pinned() -> None:
    a = np.arange(6, dtype=np.float32)
    exporter = dl.BufferExporter(a, a.ctypes.data, a.shape, None, dl.DataType(2, 32, 1), (3, 0))
    t = Tensor.from_dlpack("p", exporter)
    assert t.memory_type is MemoryType.CPU_PINNED
    assert t.memory_type_id == 0
    assert t.is_cpu() is True
    assert t.__dlpack_device__() == (3, 0)
    assert repr(t) == "Tensor(name='p', dtype=FP32, shape=[6], device=CPU_PINNED:0)"
    assert t.to_host() is t
    assert np.shares_memory(t.as_numpy(), a)
    assert t.data_ptr == a.ctypes.data
    # Exports say kDLCUDAHost, or kDLCPU when the consumer asks for it.
    s = _struct(t.__dlpack__(max_version=(1, 0)))
    assert s["device"] == (3, 0)
    assert s["data"] == a.ctypes.data
    assert _struct(t.__dlpack__(max_version=(1, 0), dl_device=(1, 0)))["device"] == (1, 0)
    assert _struct(t.__dlpack__(max_version=(1, 0), dl_device=(3, 0)))["device"] == (3, 0)
    with pytest.raises(TritonBufferError):
        t.__dlpack__(dl_device=(2, 0))
    out = np.from_dlpack(t)
    assert np.shares_memory(out, a)


def test_cuda_host_capsule_imports_as_pinned(make_capsule: Any) -> None:
    capsule, _ = make_capsule(np.arange(4, dtype=np.int32), device=(3, 0), version=None)
    t = Tensor.from_dlpack("p", capsule)
    assert t.memory_type is MemoryType.CPU_PINNED
    assert t.__dlpack_device__() == (3, 0)
    np.testing.assert_array_equal(t.as_numpy(), np.arange(4))


# ================================================================================================
# Export: __dlpack__ keywords


@pytest.fixture(params=["numpy", "ctypes"])
def exporter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which exporter CPU tensors use: numpy's (numpy >= 2.4) or dlpack_ctypes' (forced)."""
    if request.param == "ctypes":
        monkeypatch.setattr(_tensor_module, "_NUMPY_EXPORTS", False)
    elif not _tensor_module._NUMPY_EXPORTS:
        pytest.skip("this numpy's exporter is not used (numpy < 2.4)")
    return str(request.param)


@pytest.fixture(
    params=["numpy-built", "numpy-built/ctypes", "dlpack-built", "dlpack-built/ctypes", "pinned",
            "bf16"]
)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kind of tensor an export test builds (with :func:`_export_tensor`); "/ctypes" forces
    dlpack_ctypes' exporter where numpy's would be used (pinned and BF16 always use ours)."""
    kind, _, forced = str(request.param).partition("/")
    if forced:
        monkeypatch.setattr(_tensor_module, "_NUMPY_EXPORTS", False)
    return kind


def _export_tensor(path: str) -> tuple[Tensor, int]:
    """A tensor on each export path (numpy's exporter, or ours) and its data address.

    Built inside each test, not in a fixture: pytest keeps fixture values referenced until after
    the leak check has run.
    """
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    if path == "numpy-built":
        return Tensor("x", a), a.ctypes.data
    if path == "dlpack-built":
        return Tensor.from_dlpack("x", a), a.ctypes.data
    if path == "pinned":
        exporter = dl.BufferExporter(a, a.ctypes.data, a.shape, None, dl.DataType(2, 32, 1),
                                     (3, 0))
        return Tensor.from_dlpack("x", exporter), a.ctypes.data
    t, bits = _bf16_tensor([1.0, 2.0, 3.0])
    return t, bits.ctypes.data


def test_max_version_none_gives_legacy_capsule(path: str) -> None:
    t, data = _export_tensor(path)
    for capsule in (t.__dlpack__(), t.to_dlpack(), t.__dlpack__(max_version=None),
                    t.__dlpack__(max_version=(0, 8))):
        s = _struct(capsule)
        assert s["name"] == b"dltensor"
        assert s["data"] == data
        assert s["shape"] == tuple(t.shape())


@pytest.mark.parametrize("max_version", [(1, 0), (1, 3), (1, 99), (2, 0)])
def test_versioned_capsule_says_1_3(path: str, max_version: tuple[int, int]) -> None:
    t, data = _export_tensor(path)
    s = _struct(t.__dlpack__(max_version=max_version))
    assert s["name"] == b"dltensor_versioned"
    assert s["version"] == (1, 3)
    assert s["flags"] & (READ_ONLY | IS_COPIED) == 0
    assert s["data"] == data
    assert s["shape"] == tuple(t.shape())


def test_export_fields(path: str) -> None:
    t, _ = _export_tensor(path)
    s = _struct(t.__dlpack__(max_version=(1, 0)))
    expected_dtype = (4, 16, 1) if t.triton_dtype() is TritonDtype.TYPE_BF16 else (2, 32, 1)
    assert s["dtype"] == expected_dtype
    assert s["strides"] == ((3, 1) if t.shape() == [2, 3] else (1,))
    assert s["device"] == tuple(int(x) for x in t.__dlpack_device__())


def test_copy_true(path: str) -> None:
    t, data = _export_tensor(path)
    capsule = t.__dlpack__(max_version=(1, 0), copy=True)
    s = _struct(capsule)
    assert s["flags"] & IS_COPIED
    assert s["data"] != data
    imported = dl.consume(capsule)
    assert imported.is_copied
    raw = imported.numpy(raw=True)
    original = dl.from_dlpack(t).numpy(raw=True)
    np.testing.assert_array_equal(raw, original)
    assert not np.shares_memory(raw, original)
    raw[...] = 0  # independent memory
    assert original.any()
    # A legacy capsule can carry a copy too (without the flag).
    legacy = _struct(t.__dlpack__(copy=True))
    assert legacy["name"] == b"dltensor"
    assert legacy["data"] != data
    # copy=False never copies.
    assert _struct(t.__dlpack__(max_version=(1, 0), copy=False))["data"] == data


def test_dl_device(path: str) -> None:
    t, data = _export_tensor(path)
    assert _struct(t.__dlpack__(max_version=(1, 0), dl_device=(1, 0)))["data"] == data
    for bad in [(2, 0), (1, 1), (4, 0)]:
        with pytest.raises(TritonBufferError) as exc:
            t.__dlpack__(dl_device=bad)
        assert isinstance(exc.value, BufferError)
        assert isinstance(exc.value, TritonModelException)


def test_stream(path: str) -> None:
    t, data = _export_tensor(path)
    assert _struct(t.__dlpack__(stream=None))["data"] == data
    assert _struct(t.__dlpack__(stream=-1))["data"] == data
    assert _struct(t.__dlpack__(stream=-1, max_version=(1, 0)))["data"] == data
    for bad in (0, 1, 2, 5):
        with pytest.raises(ValueError, match="stream"):
            t.__dlpack__(stream=bad)
    with pytest.raises(TypeError):
        t.__dlpack__(stream="default")


def test_dlpack_is_idempotent(path: str) -> None:
    t, data = _export_tensor(path)
    first = dl.consume(t.__dlpack__(max_version=(1, 0)))
    second = dl.consume(t.__dlpack__(max_version=(1, 0)))
    assert first.data == second.data == data


def test_bad_max_version_type(exporter: str) -> None:
    t = Tensor("x", np.zeros(3))
    with pytest.raises(TypeError):
        t.__dlpack__(max_version=1)  # type: ignore[arg-type]


def test_read_only_input(exporter: str) -> None:
    a = np.arange(4, dtype=np.int32)
    a.flags.writeable = False
    t = Tensor("x", a)
    assert t.as_numpy() is a
    s = _struct(t.__dlpack__(max_version=(1, 0)))
    assert s["flags"] & READ_ONLY
    # A legacy capsule cannot say "read-only".
    with pytest.raises(TritonBufferError) as exc:
        t.to_dlpack()
    assert isinstance(exc.value, BufferError)
    # A copy is writable, so a legacy copy is fine.
    assert _struct(t.__dlpack__(copy=True))["name"] == b"dltensor"
    out = np.from_dlpack(t)
    assert not out.flags.writeable
    assert np.shares_memory(out, a)


def test_read_only_import_stays_read_only(exporter: str) -> None:
    a = np.arange(4, dtype=np.int32)
    a.flags.writeable = False
    t = Tensor.from_dlpack("x", a)
    out = t.as_numpy()
    assert not out.flags.writeable
    assert _struct(t.__dlpack__(max_version=(1, 0)))["flags"] & READ_ONLY
    with pytest.raises(TritonBufferError):
        t.to_dlpack()


def test_np_from_dlpack_zero_copy(exporter: str) -> None:
    # Upstream test_dlpack_cpu_numpy, and zero copy on every path.
    a = np.arange(12, dtype=np.float16).reshape(3, 4)
    for t in (Tensor("x", a), Tensor.from_dlpack("x", a), Tensor.from_dlpack("x", Tensor("y", a))):
        out = np.from_dlpack(t)
        assert np.shares_memory(out, a)
        np.testing.assert_array_equal(out, a)
        assert t.is_cpu()
        assert t.__dlpack_device__() == a.__dlpack_device__()


def test_exports_outlive_the_tensor(exporter: str) -> None:
    a = np.arange(6, dtype=np.float64)
    exporter = dl.BufferExporter.from_numpy(a)
    t = Tensor.from_dlpack("x", exporter)
    assert dl.live_exports() == 1  # the Tensor owns our producer's export
    out = np.from_dlpack(t)
    capsule = t.__dlpack__(max_version=(1, 0))
    del t, exporter
    np.testing.assert_array_equal(out, np.arange(6.0))
    imported = dl.consume(capsule)
    np.testing.assert_array_equal(imported.numpy(), np.arange(6.0))
    assert dl.live_exports() >= 1
    del out, imported, capsule
    assert dl.live_exports() == 0


# ================================================================================================
# BF16


def test_bf16_with_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t, bits = _bf16_tensor([1.5, -2.25, 3.0])
    assert t.triton_dtype() is TritonDtype.TYPE_BF16
    assert t.byte_size == 6
    assert repr(t) == "Tensor(name='bf16', dtype=BF16, shape=[3], device=CPU)"
    out = t.as_numpy()
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    # A new view of the same memory each call: not cached, since pb_tensor.numpy_policy decides
    # per call whether BF16 converts (inside a served model it does not).
    assert np.shares_memory(t.as_numpy(), out)
    assert np.shares_memory(out, bits)
    np.testing.assert_array_equal(out.astype(np.float32), [1.5, -2.25, 3.0])
    # Exporting still works after as_numpy() made the ml_dtypes view (numpy's exporter cannot
    # describe bfloat16, so it must not be used for it).
    for max_version in (None, (1, 0)):
        s = _struct(t.__dlpack__(max_version=max_version))
        assert s["dtype"] == (4, 16, 1)
        assert s["data"] == bits.ctypes.data
    back = Tensor.from_dlpack("again", t)
    assert back.triton_dtype() is TritonDtype.TYPE_BF16
    np.testing.assert_array_equal(back.as_numpy(), out)


def test_bf16_wrong_bits_rejected(make_capsule: Any) -> None:
    capsule, _ = make_capsule(np.zeros(8, np.uint8), shape=(2,), dtype=(4, 32, 1))
    with pytest.raises(TritonModelException):
        Tensor.from_dlpack("x", capsule)


_BF16_NO_ML_DTYPES = """
import sys
sys.modules["ml_dtypes"] = None  # as if it were not installed
import numpy as np
import dlpack_ctypes as dl
from pb_tensor import Tensor, TritonModelException, TritonDtype

bits = np.array([0x3FC0, 0xC010, 0x4040], dtype=np.uint16)  # 1.5, -2.25, 3.0
exporter = dl.BufferExporter(bits, bits.ctypes.data, bits.shape, None, dl.DataType(4, 16, 1))
t = Tensor.from_dlpack("bf16", exporter)
assert t.triton_dtype() is TritonDtype.TYPE_BF16
for _ in range(2):
    try:
        t.as_numpy()
    except TritonModelException as exc:
        assert str(exc) == sys.argv[1], str(exc)
    else:
        raise AssertionError("as_numpy() did not raise")
for max_version in (None, (1, 0)):
    imported = dl.consume(t.__dlpack__(max_version=max_version))
    assert imported.dtype == (4, 16, 1)
    raw = imported.numpy(raw=True)
    assert raw.dtype == np.uint16 and raw.tolist() == bits.tolist()
    assert np.shares_memory(raw, bits)
    del imported, raw
back = Tensor.from_dlpack("again", t)
assert back.triton_dtype() is TritonDtype.TYPE_BF16
del t, back, exporter
assert dl.live_exports() == 0, dl.live_exports()
print("ok")
"""


def test_bf16_without_ml_dtypes(run_python: Any) -> None:
    proc = run_python(_BF16_NO_ML_DTYPES, BF16_NUMPY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("bits", [8, 32])
def test_bf16_bits_message_matches_upstream(make_capsule: Any, bits: int) -> None:
    # Triton's own text for a kDLBfloat tensor that is not 16 bits, raised before the capsule
    # is consumed (our generic DLPack validation would reject it too, with another text).
    capsule, info = make_capsule(np.zeros(16, dtype=np.uint8), shape=(2,), dtype=(4, bits, 1),
                                 version=(1, 3))
    exc = _error(Tensor.from_dlpack, "x", capsule)
    assert isinstance(exc, TritonModelException)
    assert str(exc) == f"Expected BF16 tensor to have 16 bits, but had: {bits}"
    assert capsule_name(capsule) == b"dltensor_versioned"
    del capsule
    assert info.calls == 1


def test_numpy_input_wrapped_directly_matches_dlpack_path() -> None:
    # numpy arrays skip the capsule round trip; the result must be what DLPack gives.
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    direct = Tensor.from_dlpack("x", a)
    via_capsule = Tensor.from_dlpack("x", a.__dlpack__(max_version=(1, 0)))
    for t in (direct, via_capsule):
        assert t.triton_dtype() == TritonDtype.TYPE_INT16
        assert t.shape() == [2, 3]
        assert t.data_ptr == a.ctypes.data
        assert np.shares_memory(t.as_numpy(), a)
    ro = a.copy()
    ro.flags.writeable = False
    assert not Tensor.from_dlpack("ro", ro).as_numpy().flags.writeable
    with pytest.raises(TritonModelException, match="not contiguous"):
        Tensor.from_dlpack("strided", a[:, ::2])
    with pytest.raises(TritonBufferError):
        Tensor.from_dlpack("swapped", a.astype(">i2"))
