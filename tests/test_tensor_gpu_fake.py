"""Tensor's GPU paths without a GPU: a fake CUDA producer against the recording fake runtime.

Covers the GPU import rules at the Tensor level (the exact CUDA call sequence of
``from_dlpack``, device restored on every error, the TypeError fallback, raw capsules without
CUDA), GPU tensor properties and export (stream rules, host copies, device copies),
``to_host``, kDLCUDAHost as CPU_PINNED, missing cuda-python / driver, and GPU records in the
shared-memory pool.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from cuda_fake import FakeCudaRuntime

import dlpack_ctypes as dl
from dlpack_ctypes import DLDeviceType
from pb_tensor import cuda
from pb_tensor.cuda import _backend as cuda_backend
from pb_tensor.dtypes import MemoryType, TritonDtype
from pb_tensor.errors import TritonBufferError, TritonModelException
from pb_tensor.shm import SharedMemoryPool, load_record, save_record
from pb_tensor.shm import _tensors as _tensor_shm
from pb_tensor.tensor import Tensor

GPU_NUMPY = "Tensor is stored in GPU and cannot be converted to NumPy."
GPU_UNAVAILABLE = (
    "DLPack capsule passed pointer to memory allocated on GPU device, when GPU is not available: "
)
NOT_CONTIGUOUS = (
    "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in C-Order "
    "are supported."
)
FP32 = dl.DataType(2, 32, 1)
DEVICE_TO_HOST = int(cuda.MemcpyKind.DEVICE_TO_HOST)


def upload(
    fake: FakeCudaRuntime, host: np.ndarray[Any, Any], *, device: int = 1, offset: int = 0
) -> int:
    """Fake device memory holding ``host`` at ``offset`` into its allocation; the pointer."""
    base = cuda.malloc(host.nbytes + offset, device=device)
    ptr = base + offset
    if host.nbytes:
        cuda.memcpy(
            ptr, host.ctypes.data, host.nbytes, cuda.MemcpyKind.HOST_TO_DEVICE, device=device
        )
    fake.take()
    return ptr


def download(ptr: int, like: np.ndarray[Any, Any], *, device: int = 1) -> np.ndarray[Any, Any]:
    out = np.empty_like(like)
    cuda.copy_device_to_host(out, ptr, device=device)
    return out


class FakeGpuProducer:
    """A CUDA DLPack producer over fake device memory that records what it is asked.

    ``legacy`` producers take only ``stream`` (so ``max_version`` raises TypeError, as in
    DLPack 0.x); ``export_device`` makes the capsule disagree with ``__dlpack_device__``.
    """

    def __init__(
        self,
        fake: FakeCudaRuntime,
        ptr: int,
        shape: tuple[int, ...],
        dtype: dl.DataType = FP32,
        *,
        device: int = 1,
        strides: tuple[int, ...] | None = None,
        error: BaseException | None = None,
        legacy: bool = False,
        export_device: tuple[int, int] | None = None,
    ) -> None:
        self.fake = fake
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.strides = strides
        self.error = error
        self.legacy = legacy
        self.export_device = export_device or (2, device)
        self.requests: list[dict[str, Any]] = []

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        return DLDeviceType.kDLCUDA, self.device

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.requests.append(kwargs)
        self.fake.calls.append(("producer.__dlpack__", kwargs.get("stream"), self.fake.current))
        if self.legacy and set(kwargs) - {"stream"}:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        if self.error is not None:
            raise self.error
        exporter = dl.BufferExporter(
            self, self.ptr, self.shape, self.strides, self.dtype, device=self.export_device
        )
        return exporter.__dlpack__(max_version=kwargs.get("max_version"))


def import_sequence(stream: int, *, on: int = 0, device: int = 1) -> list[tuple[Any, ...]]:
    """The calls of a first GPU import from a tensor on ``device`` while ``on`` is current."""
    return [
        ("cudaGetDevice",),
        ("cudaSetDevice", device),
        ("cudaStreamCreate",),
        ("producer.__dlpack__", stream, device),
        ("cudaStreamSynchronize", stream),
        ("cuDevicePrimaryCtxGetState", on),
        ("cudaSetDevice", on),
    ]


def make_gpu_tensor(fake: FakeCudaRuntime) -> tuple[Tensor, np.ndarray[Any, Any], int]:
    """A (2, 3) FP32 GPU tensor on device 1 imported through the protocol, its data, pointer.

    (Not a fixture: pytest keeps fixture values alive past the autouse leak check.)"""
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    ptr = upload(fake, host)
    tensor = Tensor.from_dlpack("gpu", FakeGpuProducer(fake, ptr, host.shape))
    fake.take()
    return tensor, host, ptr


# ---------------------------------------------------------------------------------------------
# Import through the protocol: the CUDA sequence


def test_import_call_sequence(fake: FakeCudaRuntime) -> None:
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    ptr = upload(fake, host)
    producer = FakeGpuProducer(fake, ptr, host.shape)
    tensor = Tensor.from_dlpack("x", producer)
    calls = fake.take()
    stream = calls[3][1]
    assert calls == import_sequence(stream)
    assert fake.streams[stream] == 1  # created while the tensor's device was current
    assert producer.requests == [{"stream": stream, "max_version": (1, 3)}]
    assert cuda.proxy_stream(1) == stream  # cached under the tensor's device
    assert fake.take() == []
    assert fake.current == 0
    assert tensor.data_ptr == ptr
    assert tensor.__dlpack_device__() == (2, 1)

    # The second import reuses the stream; nothing is created.
    again = Tensor.from_dlpack("y", FakeGpuProducer(fake, ptr, host.shape))
    assert fake.take() == [c for c in import_sequence(stream) if c[0] != "cudaStreamCreate"]
    assert again.data_ptr == ptr


def test_import_on_current_device_does_not_switch(fake: FakeCudaRuntime) -> None:
    fake.current = 1
    ptr = upload(fake, np.ones(4, np.float32))
    Tensor.from_dlpack("x", FakeGpuProducer(fake, ptr, (4,)))
    calls = fake.take()
    stream = calls[2][1]
    assert calls == [
        ("cudaGetDevice",),
        ("cudaStreamCreate",),
        ("producer.__dlpack__", stream, 1),
        ("cudaStreamSynchronize", stream),
    ]
    assert fake.current == 1


def test_device_0_import_uses_its_own_stream(fake: FakeCudaRuntime) -> None:
    p1 = upload(fake, np.ones(4, np.float32), device=1)
    p0 = upload(fake, np.ones(4, np.float32), device=0)
    Tensor.from_dlpack("one", FakeGpuProducer(fake, p1, (4,), device=1))
    Tensor.from_dlpack("zero", FakeGpuProducer(fake, p0, (4,), device=0))
    streams = [c[1] for c in fake.calls if c[0] == "producer.__dlpack__"]
    assert streams[0] != streams[1]
    assert fake.streams[streams[0]] == 1
    assert fake.streams[streams[1]] == 0  # not the device-1 stream upstream would cache here


def test_typeerror_fallback(fake: FakeCudaRuntime) -> None:
    ptr = upload(fake, np.arange(3, dtype=np.float32))
    producer = FakeGpuProducer(fake, ptr, (3,), legacy=True)
    tensor = Tensor.from_dlpack("x", producer)
    stream = producer.requests[0]["stream"]
    assert producer.requests == [{"stream": stream, "max_version": (1, 3)}, {"stream": stream}]
    names = fake.names()
    assert names.count("producer.__dlpack__") == 2
    assert names.index("cudaStreamSynchronize") > names.index("producer.__dlpack__")
    assert fake.current == 0
    np.testing.assert_array_equal(tensor.to_host().as_numpy(), np.arange(3, dtype=np.float32))


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (BufferError("cannot export"), BufferError),
        (RuntimeError("producer failed"), RuntimeError),
        (TypeError("bad"), TypeError),  # the legacy retry raises it again
    ],
)
def test_device_restored_when_producer_raises(
    fake: FakeCudaRuntime, error: BaseException, expected: type[BaseException]
) -> None:
    ptr = upload(fake, np.ones(4, np.float32))
    with pytest.raises(expected):
        Tensor.from_dlpack("x", FakeGpuProducer(fake, ptr, (4,), error=error))
    assert fake.current == 0
    names = fake.names()
    assert "cudaStreamSynchronize" not in names  # nothing to wait for: no tensor
    assert names[-2:] == ["cuDevicePrimaryCtxGetState", "cudaSetDevice"]


def test_producer_buffer_error_is_a_triton_buffer_error(fake: FakeCudaRuntime) -> None:
    ptr = upload(fake, np.ones(4, np.float32))
    with pytest.raises(TritonBufferError, match="cannot export"):
        Tensor.from_dlpack(
            "x", FakeGpuProducer(fake, ptr, (4,), error=BufferError("cannot export"))
        )


@pytest.mark.parametrize(
    ("shape", "strides", "dtype", "message"),
    [
        ((3, 4), (1, 3), FP32, NOT_CONTIGUOUS),  # a transposed view
        ((4,), (2,), FP32, NOT_CONTIGUOUS),  # a strided 1-D view (upstream accepts it)
        ((4,), None, dl.DataType(5, 64, 1), "Dtype is invalid."),  # complex64
    ],
)
def test_device_restored_when_check_rejects(
    fake: FakeCudaRuntime,
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    dtype: dl.DataType,
    message: str,
) -> None:
    ptr = upload(fake, np.ones(64, np.float32))
    producer = FakeGpuProducer(fake, ptr, shape, dtype, strides=strides)
    with pytest.raises(TritonModelException) as info:
        Tensor.from_dlpack("x", producer)
    assert str(info.value).startswith(message)
    assert fake.current == 0
    assert "cudaStreamSynchronize" not in fake.names()
    assert fake.names()[-1] == "cudaSetDevice"
    # The rejected capsule was not consumed: the producer's destructor freed it (the autouse
    # leak check asserts no export is left alive).


def test_capsule_on_another_device_is_rejected(fake: FakeCudaRuntime) -> None:
    ptr = upload(fake, np.ones(4, np.float32))
    producer = FakeGpuProducer(fake, ptr, (4,), export_device=(2, 0))
    with pytest.raises(
        TritonModelException, match=r"reported device \(kDLCUDA, 1\) but .* \(2, 0\)"
    ):
        Tensor.from_dlpack("x", producer)
    assert fake.current == 0


def test_sync_failure_raises_and_restores(fake: FakeCudaRuntime) -> None:
    ptr = upload(fake, np.ones(4, np.float32))
    fake.fail("cudaStreamSynchronize", 719)
    with pytest.raises(cuda.CudaError) as info:
        Tensor.from_dlpack("x", FakeGpuProducer(fake, ptr, (4,)))
    assert str(info.value) == (
        "Failed to synchronize CUDA device with id 1: cudaErrorLaunchFailure: "
        "unspecified launch failure"
    )
    assert isinstance(info.value, TritonModelException)
    assert fake.current == 0


def test_set_device_failure(fake: FakeCudaRuntime) -> None:
    ptr = upload(fake, np.ones(4, np.float32))
    fake.fail("cudaSetDevice", 101)
    producer = FakeGpuProducer(fake, ptr, (4,))
    with pytest.raises(cuda.CudaError, match=r"^Failed to set the CUDA device to 1\. error: "):
        Tensor.from_dlpack("x", producer)
    assert producer.requests == []
    assert fake.current == 0


# ---------------------------------------------------------------------------------------------
# Raw capsules: no CUDA at all


def gpu_capsule(
    ptr: int,
    shape: tuple[int, ...],
    *,
    device: int = 1,
    max_version: tuple[int, int] | None = (1, 3),
) -> Any:
    owner = object()
    return dl.BufferExporter(owner, ptr, shape, None, FP32, device=(2, device)).__dlpack__(
        max_version=max_version
    )


@pytest.mark.parametrize("max_version", [None, (1, 3)])
def test_raw_capsule_makes_no_cuda_call(
    fake: FakeCudaRuntime, max_version: tuple[int, int] | None
) -> None:
    tensor = Tensor.from_dlpack("x", gpu_capsule(0x7F00_0000_1000, (2, 2), max_version=max_version))
    assert fake.calls == []
    assert tensor.__dlpack_device__() == (2, 1)
    assert tensor.data_ptr == 0x7F00_0000_1000


def test_raw_capsule_works_without_cuda() -> None:
    previous = cuda.set_runtime(FakeCudaRuntime(no_driver=True))
    try:
        tensor = Tensor.from_dlpack("x", gpu_capsule(0x1000, (4,), device=0))
        assert not tensor.is_cpu()
        assert tensor.__dlpack_device__() == (2, 0)
        capsule = tensor.__dlpack__(max_version=(1, 3))
        with dl.consume(capsule) as back:
            assert back.data == 0x1000
        with pytest.raises(TritonModelException, match="^" + GPU_NUMPY):
            tensor.as_numpy()
    finally:
        cuda.set_runtime(previous)


# ---------------------------------------------------------------------------------------------
# GPU tensor properties


def test_gpu_tensor_properties(fake: FakeCudaRuntime) -> None:
    tensor, host, ptr = make_gpu_tensor(fake)
    assert tensor.name() == "gpu"
    assert tensor.shape() == [2, 3]
    assert tensor.triton_dtype() == TritonDtype.TYPE_FP32
    assert tensor.is_cpu() is False
    assert tensor.__dlpack_device__() == (DLDeviceType.kDLCUDA, 1)
    assert tensor.memory_type == MemoryType.GPU
    assert tensor.memory_type_id == 1
    assert tensor.data_ptr == ptr
    assert tensor.byte_size == host.nbytes
    assert repr(tensor) == "Tensor(name='gpu', dtype=FP32, shape=[2, 3], device=GPU:1)"
    with pytest.raises(TritonModelException) as info:
        tensor.as_numpy()
    assert str(info.value) == GPU_NUMPY


def test_gpu_bf16_as_numpy_reports_gpu_first(fake: FakeCudaRuntime) -> None:
    ptr = upload(fake, np.ones(4, np.uint16))
    tensor = Tensor.from_dlpack("x", FakeGpuProducer(fake, ptr, (4,), dl.DataType(4, 16, 1)))
    assert tensor.triton_dtype() == TritonDtype.TYPE_BF16
    with pytest.raises(TritonModelException) as info:
        tensor.as_numpy()
    assert str(info.value) == GPU_NUMPY


# ---------------------------------------------------------------------------------------------
# Export of GPU tensors


@pytest.mark.parametrize("max_version", [None, (1, 0), (1, 3), (2, 0)])
def test_export_same_memory(
    fake: FakeCudaRuntime,
    max_version: tuple[int, int] | None,
) -> None:
    tensor, _host, ptr = make_gpu_tensor(fake)
    capsule = tensor.__dlpack__(max_version=max_version)
    with dl.consume(capsule) as back:
        assert back.device == (DLDeviceType.kDLCUDA, 1)
        assert back.data == ptr
        assert back.shape == (2, 3)
        assert back.strides == (3, 1)
        assert back.version == (None if max_version is None else (1, 3))
        assert not back.is_copied
    assert fake.calls == []  # no pending work, no CUDA


def test_to_dlpack_is_legacy(fake: FakeCudaRuntime) -> None:
    tensor, _host, ptr = make_gpu_tensor(fake)
    with dl.consume(tensor.to_dlpack()) as back:
        assert back.version is None
        assert back.data == ptr
        assert back.device == (2, 1)


@pytest.mark.parametrize("stream", [None, -1, 1, 2, 0x5000, 0xDEAD_BEEF])
def test_export_accepts_consumer_streams(
    fake: FakeCudaRuntime,
    stream: int | None,
) -> None:
    tensor, _host, ptr = make_gpu_tensor(fake)
    with dl.consume(tensor.__dlpack__(stream=stream, max_version=(1, 3))) as back:
        assert back.data == ptr
    assert fake.calls == []  # the tensor carries no pending work: no wait on any stream


def test_export_rejects_bad_streams(fake: FakeCudaRuntime) -> None:
    tensor, _host, _ptr = make_gpu_tensor(fake)
    with pytest.raises(ValueError, match="stream=0 is ambiguous"):
        tensor.__dlpack__(stream=0)
    with pytest.raises(ValueError, match="stream must be -1, None or a stream handle"):
        tensor.__dlpack__(stream=-2)
    with pytest.raises(TypeError, match="stream must be an int or None"):
        tensor.__dlpack__(stream="default")


@pytest.mark.parametrize("max_version", [None, (1, 3)])
@pytest.mark.parametrize("copy", [None, True])
def test_export_host_copy(
    fake: FakeCudaRuntime,
    max_version: tuple[int, int] | None,
    copy: bool | None,
) -> None:
    tensor, host, ptr = make_gpu_tensor(fake)
    capsule = tensor.__dlpack__(dl_device=(1, 0), copy=copy, max_version=max_version)
    copies = [c for c in fake.calls if c[0] == "cudaMemcpy"]
    assert len(copies) == 1
    assert copies[0][2:] == (ptr, host.nbytes, DEVICE_TO_HOST)
    assert fake.calls[:2] == [("cudaGetDevice",), ("cudaSetDevice", 1)]  # under device 1
    assert fake.current == 0
    with dl.consume(capsule) as back:
        assert back.device == (DLDeviceType.kDLCPU, 0)
        assert back.data != ptr
        assert back.is_copied == (max_version is not None)  # legacy capsules have no flags
        np.testing.assert_array_equal(back.numpy(), host)


def test_numpy_from_dlpack_with_cpu_device(fake: FakeCudaRuntime) -> None:
    tensor, host, _ptr = make_gpu_tensor(fake)
    try:
        out = np.from_dlpack(tensor, device="cpu")
    except TypeError:  # numpy < 2.1 has no device keyword
        pytest.skip("numpy.from_dlpack without device=")
    np.testing.assert_array_equal(out, host)
    del out


def test_export_host_copy_refusals(
    fake: FakeCudaRuntime,
) -> None:
    tensor, _host, _ptr = make_gpu_tensor(fake)
    with pytest.raises(BufferError, match="copy=False") as info:
        tensor.__dlpack__(dl_device=(1, 0), copy=False)
    assert isinstance(info.value, TritonBufferError)
    with pytest.raises(ValueError, match="has no streams"):
        tensor.__dlpack__(dl_device=(1, 0), stream=0x5000)
    with pytest.raises(TypeError, match="max_version"):
        tensor.__dlpack__(dl_device=(1, 0), max_version="1.3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="copy must be"):
        tensor.__dlpack__(dl_device=(1, 0), copy="yes")  # type: ignore[arg-type]
    for other in [(2, 0), (3, 1), (1, 1)]:
        with pytest.raises(BufferError, match="unsupported device"):
            tensor.__dlpack__(dl_device=other)
    assert "cudaMemcpy" not in fake.names()
    # -1 (no synchronisation) is accepted for a host copy, which is synchronous anyway.
    with dl.consume(tensor.__dlpack__(dl_device=(1, 0), stream=-1)) as back:
        assert back.device == (1, 0)


def test_export_device_copy(
    fake: FakeCudaRuntime,
) -> None:
    tensor, host, ptr = make_gpu_tensor(fake)
    capsule = tensor.__dlpack__(copy=True, max_version=(1, 3), dl_device=(2, 1))
    mallocs = [c for c in fake.calls if c[0] == "cudaMalloc"]
    assert mallocs == [("cudaMalloc", host.nbytes)]
    with dl.consume(capsule) as back:
        assert back.device == (2, 1)
        assert back.is_copied
        assert back.data != ptr
        assert fake.allocations[back.data][0] == 1  # on the tensor's device
        np.testing.assert_array_equal(download(back.data, host), host)
        copied = back.data
    del back, capsule
    gc.collect()
    assert copied not in fake.allocations  # the copy is freed with its capsule's consumer
    assert fake.current == 0


# ---------------------------------------------------------------------------------------------
# to_host


def test_to_host(fake: FakeCudaRuntime) -> None:
    tensor, host, ptr = make_gpu_tensor(fake)
    cpu = tensor.to_host()
    assert cpu.is_cpu()
    assert cpu.memory_type == MemoryType.CPU
    assert cpu.__dlpack_device__() == (1, 0)
    assert cpu.name() == "gpu"
    assert cpu.shape() == [2, 3]
    np.testing.assert_array_equal(cpu.as_numpy(), host)
    assert fake.take() == [
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),
        ("cudaMemcpy", cpu.data_ptr, ptr, host.nbytes, DEVICE_TO_HOST),
        ("cuDevicePrimaryCtxGetState", 0),
        ("cudaSetDevice", 0),
    ]
    assert not tensor.is_cpu()  # the GPU tensor is unchanged
    assert cpu.to_host() is cpu


def test_to_host_bf16(fake: FakeCudaRuntime) -> None:
    bits = np.array([0x3F80, 0x4000, 0xC040], dtype=np.uint16)  # 1.0, 2.0, -3.0
    ptr = upload(fake, bits)
    tensor = Tensor.from_dlpack("x", FakeGpuProducer(fake, ptr, (3,), dl.DataType(4, 16, 1)))
    cpu = tensor.to_host()
    assert cpu.triton_dtype() == TritonDtype.TYPE_BF16
    with dl.consume(cpu.__dlpack__(max_version=(1, 3))) as back:
        assert back.dtype == (4, 16, 1)
        np.testing.assert_array_equal(back.numpy(raw=True), bits)


def test_empty_gpu_tensor_needs_no_cuda(fake: FakeCudaRuntime) -> None:
    tensor = Tensor.from_dlpack("empty", gpu_capsule(0, (0, 3)))
    assert tensor.byte_size == 0
    cpu = tensor.to_host()
    assert cpu.as_numpy().shape == (0, 3)
    with dl.consume(tensor.__dlpack__(dl_device=(1, 0), max_version=(1, 3))) as back:
        assert back.shape == (0, 3)
    with dl.consume(tensor.__dlpack__(copy=True, max_version=(1, 3))) as back:
        assert back.shape == (0, 3)
    assert fake.calls == []


# ---------------------------------------------------------------------------------------------
# kDLCUDAHost: CPU_PINNED (upstream imports it as plain CPU)


class PinnedProducer:
    def __init__(self, array: np.ndarray[Any, Any], device: int = 0) -> None:
        self.exporter = dl.BufferExporter(
            array,
            array.ctypes.data,
            array.shape,
            None,
            dl.from_numpy_dtype(array.dtype),
            device=(3, device),
        )
        self.requests: list[dict[str, Any]] = []

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        return self.exporter.__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.requests.append(kwargs)
        return self.exporter.__dlpack__(**kwargs)


@pytest.mark.parametrize("raw_capsule", [False, True])
def test_cuda_host_imports_as_pinned(fake: FakeCudaRuntime, raw_capsule: bool) -> None:
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    producer = PinnedProducer(array, device=1)
    source = producer.__dlpack__(max_version=(1, 3)) if raw_capsule else producer
    tensor = Tensor.from_dlpack("pinned", source)
    assert tensor.memory_type == MemoryType.CPU_PINNED
    assert tensor.memory_type_id == 1
    assert tensor.is_cpu()
    assert tensor.__dlpack_device__() == (DLDeviceType.kDLCUDAHost, 1)
    assert repr(tensor) == "Tensor(name='pinned', dtype=INT32, shape=[2, 3], device=CPU_PINNED:1)"
    np.testing.assert_array_equal(tensor.as_numpy(), array)
    assert tensor.to_host() is tensor
    with dl.consume(tensor.__dlpack__(max_version=(1, 3))) as back:
        assert back.device == (DLDeviceType.kDLCUDAHost, 1)
        assert back.data == array.ctypes.data
    with dl.consume(tensor.__dlpack__(dl_device=(1, 0), max_version=(1, 3))) as back:
        assert back.device == (DLDeviceType.kDLCPU, 0)  # host-accessible: relabelled, no copy
        assert back.data == array.ctypes.data
    assert fake.calls == []  # pinned memory needs no CUDA call
    if not raw_capsule:
        assert producer.requests[0] == {"max_version": (1, 3)}  # no stream: nothing to order


# ---------------------------------------------------------------------------------------------
# Without cuda-python, without a driver


def test_without_cuda_python(run_python: Any) -> None:
    result = run_python(
        """
        import sys
        sys.modules["cuda"] = None  # hides cuda-python: `import cuda...` raises ImportError
        import numpy as np
        import dlpack_ctypes as dl
        from pb_tensor import Tensor, TritonModelException, cuda

        class Producer:
            called = False
            def __dlpack_device__(self):
                return (2, 0)
            def __dlpack__(self, **kwargs):
                Producer.called = True
                raise AssertionError("must not be asked")

        try:
            Tensor.from_dlpack("x", Producer())
        except TritonModelException as exc:
            assert isinstance(exc, cuda.CudaUnavailableError)
            print(exc)
        assert not Producer.called
        # CPU features are unaffected.
        t = Tensor("cpu", np.arange(3, dtype=np.float32))
        assert np.from_dlpack(t).tolist() == [0.0, 1.0, 2.0]
        # A raw GPU capsule is wrapped without CUDA, as upstream; only its host copy needs it.
        owner = object()
        capsule = dl.BufferExporter(owner, 0x1000, (4,), None, dl.DataType(2, 32, 1),
                                    device=(2, 0)).__dlpack__()
        g = Tensor.from_dlpack("g", capsule)
        assert g.__dlpack_device__() == (2, 0)
        try:
            g.to_host()
        except cuda.CudaUnavailableError as exc:
            assert "cuda-python is not installed" in str(exc)
        else:
            raise AssertionError("to_host without CUDA")
        assert "cuda" not in [m for m in sys.modules if sys.modules[m] is not None]
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        GPU_UNAVAILABLE + "CUDA is not available: cuda-python is not installed"
    ), result.stdout


def test_without_driver(fake: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_backend, "_driver_present", False)
    cuda.set_runtime(FakeCudaRuntime(no_driver=True))
    producer = FakeGpuProducer(fake, 0x1000, (4,))
    with pytest.raises(TritonModelException) as info:
        Tensor.from_dlpack("x", producer)
    assert isinstance(info.value, cuda.CudaUnavailableError)
    assert str(info.value) == (
        GPU_UNAVAILABLE + "CUDA is not available: no CUDA driver is installed (libcuda.so.1 "
        "cannot be loaded) (cudaErrorInsufficientDriver: CUDA driver version is insufficient for "
        "CUDA runtime version)"
    )
    assert info.value.error_name == "cudaErrorInsufficientDriver"
    assert producer.requests == []


def test_without_driver_real_cuda_python() -> None:
    pytest.importorskip("cuda.bindings.runtime")
    previous = cuda.set_runtime(None)
    try:
        if cuda.is_available():
            pytest.skip("a CUDA device is present")
        producer = FakeGpuProducer(FakeCudaRuntime(), 0x1000, (4,))
        with pytest.raises(cuda.CudaUnavailableError) as info:
            Tensor.from_dlpack("x", producer)
        assert str(info.value).startswith(GPU_UNAVAILABLE + "CUDA is not available: ")
        assert producer.requests == []
    finally:
        cuda.set_runtime(previous)


def test_without_devices(fake: FakeCudaRuntime) -> None:
    cuda.set_runtime(FakeCudaRuntime(devices=0))
    with pytest.raises(cuda.CudaUnavailableError, match="cudaErrorNoDevice"):
        Tensor.from_dlpack("x", FakeGpuProducer(fake, 0x1000, (4,)))


# ---------------------------------------------------------------------------------------------
# GPU records in the shared-memory pool


@pytest.fixture
def pool() -> Iterator[SharedMemoryPool]:
    with SharedMemoryPool.create(1 << 16) as created:
        yield created


def as_another_process() -> None:
    """Make the next loads behave as in a process that did not save the tensors (so CUDA IPC
    is used): forget which GPU tensors this process saved."""
    _tensor_shm._saved_here.clear()


def saved_gpu_tensor(
    fake: FakeCudaRuntime, *, offset: int = 256
) -> tuple[Tensor, np.ndarray[Any, Any], int]:
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    ptr = upload(fake, host, offset=offset)
    tensor = Tensor.from_dlpack("gpu_out", FakeGpuProducer(fake, ptr, host.shape))
    fake.take()
    return tensor, host, ptr


def test_save_records_ipc_handle_and_offset(fake: FakeCudaRuntime, pool: SharedMemoryPool) -> None:
    tensor, host, ptr = saved_gpu_tensor(fake, offset=256)
    handle = tensor.save_to_shared_memory(pool)
    base = ptr - 256
    assert fake.take() == [
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),
        ("cuPointerGetAttribute", 11, ptr),  # the allocation base: an IPC handle names it
        ("cudaIpcGetMemHandle", base),
        ("cuDevicePrimaryCtxGetState", 0),
        ("cudaSetDevice", 0),
    ]
    record = load_record(pool, handle)
    assert record.name == "gpu_out"
    assert record.dims == (3, 4)
    assert record.dtype == int(TritonDtype.TYPE_FP32)
    assert (record.memory_type, record.memory_type_id) == (int(MemoryType.GPU), 1)
    assert record.byte_size == host.nbytes
    assert record.gpu_pointer_offset == 256
    assert record.ipc_handle == fake.cudaIpcGetMemHandle(base)[1]
    del record
    # Idempotent in the same pool, and the GPU data is not moved.
    assert tensor.save_to_shared_memory(pool) == handle
    assert tensor.data_ptr == ptr
    assert not tensor.is_cpu()
    # The tensor holds the record (as for CPU data), beside the two saves' messages.
    assert (pool.refcount(handle), pool.pending_messages(handle)) == (3, 2)
    pool.release(handle)
    pool.release(handle)
    del tensor
    gc.collect()
    assert pool.stats().allocations == 0


def test_load_opens_handle_on_device_and_closes_with_last_reference(
    fake: FakeCudaRuntime, pool: SharedMemoryPool
) -> None:
    saver, host, ptr = saved_gpu_tensor(fake, offset=256)
    handle = saver.save_to_shared_memory(pool)
    ipc = fake.cudaIpcGetMemHandle(ptr - 256)[1]
    as_another_process()
    fake.take()
    loaded = Tensor.load_from_shared_memory(pool, handle)
    calls = fake.take()
    assert calls[:3] == [
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),  # the record's device
        ("cudaIpcOpenMemHandle", ipc, 1),
    ]
    assert fake.current == 0
    mapped = next(iter(fake.ipc_open))
    assert loaded.data_ptr == mapped + 256
    assert loaded.__dlpack_device__() == (2, 1)
    assert loaded.name() == "gpu_out"
    assert loaded.shape() == [3, 4]
    assert not loaded.is_cpu()
    np.testing.assert_array_equal(loaded.to_host().as_numpy(), host)
    assert pool.refcount(handle) == 2  # the saver's and the loader's

    consumer = dl.from_dlpack(loaded)  # an export keeps the mapping alive
    del loaded
    gc.collect()
    assert fake.ipc_open == {mapped: 1}
    assert "cudaIpcCloseMemHandle" not in fake.names()
    del consumer
    gc.collect()
    assert fake.ipc_open == {}
    closes = [i for i, c in enumerate(fake.calls) if c[0] == "cudaIpcCloseMemHandle"]
    assert len(closes) == 1
    assert fake.calls[closes[0]] == ("cudaIpcCloseMemHandle", mapped)
    assert fake.calls[closes[0] - 1] == ("cudaSetDevice", 1)  # closed under its device
    assert pool.refcount(handle) == 1


def test_load_in_saving_process_reuses_memory(
    fake: FakeCudaRuntime, pool: SharedMemoryPool
) -> None:
    saver, host, ptr = saved_gpu_tensor(fake)
    handle = saver.save_to_shared_memory(pool)
    fake.take()
    loaded = Tensor.load_from_shared_memory(pool, handle)
    assert fake.calls == []  # CUDA cannot open a handle in the process that made it
    assert loaded.data_ptr == ptr
    del saver  # the loaded tensor keeps the saver's memory (and the record) alive
    gc.collect()
    np.testing.assert_array_equal(loaded.to_host().as_numpy(), host)
    assert pool.refcount(handle) == 1
    del loaded
    gc.collect()
    assert pool.stats().allocations == 0


def test_loaded_tensor_saved_again_reuses_its_handle(
    fake: FakeCudaRuntime, pool: SharedMemoryPool
) -> None:
    saver, _host, _ptr = saved_gpu_tensor(fake)
    first = load_record(pool, saver.save_to_shared_memory(pool))
    as_another_process()
    loaded = Tensor.load_from_shared_memory(pool, first.handle)
    fake.take()
    with SharedMemoryPool.create(1 << 16) as second_pool:
        handle = loaded.save_to_shared_memory(second_pool)
        assert "cudaIpcGetMemHandle" not in fake.names()  # a mapping cannot be re-exported
        again = load_record(second_pool, handle)
        assert again.ipc_handle == first.ipc_handle
        assert again.gpu_pointer_offset == first.gpu_pointer_offset
        del again, loaded
        gc.collect()
    del first


def test_empty_gpu_tensor_in_pool_makes_no_cuda_call(
    fake: FakeCudaRuntime, pool: SharedMemoryPool
) -> None:
    tensor = Tensor.from_dlpack("empty", gpu_capsule(0, (0, 4)))
    handle = tensor.save_to_shared_memory(pool)
    record = load_record(pool, handle)
    assert record.byte_size == 0
    assert record.gpu_pointer_offset == 0
    assert record.ipc_handle == bytes(64)
    del record
    as_another_process()
    loaded = Tensor.load_from_shared_memory(pool, handle)
    assert loaded.shape() == [0, 4]
    assert loaded.__dlpack_device__() == (2, 1)
    assert loaded.to_host().as_numpy().shape == (0, 4)
    with dl.consume(loaded.__dlpack__(max_version=(1, 3))) as back:
        assert back.shape == (0, 4)
    assert fake.calls == []  # upstream server#4865


def test_load_errors(fake: FakeCudaRuntime, pool: SharedMemoryPool) -> None:
    # A record whose IPC slot was never filled (upstream's server saves some without one).
    handle = save_record(
        pool, name="x", dtype=int(TritonDtype.TYPE_FP32), dims=(4,), memory_type=2,
        memory_type_id=1, payload=None, byte_size=16,
    )  # fmt: skip
    with pytest.raises(TritonModelException, match="holds no CUDA IPC handle"):
        Tensor.load_from_shared_memory(pool, handle)
    assert fake.calls == []
    # The failed load gave back the message it took: the record is as it was.
    assert (pool.refcount(handle), pool.pending_messages(handle)) == (1, 1)

    saver, _host, _ptr = saved_gpu_tensor(fake)
    good = saver.save_to_shared_memory(pool)
    as_another_process()
    fake.take()
    fake.fail("cudaIpcOpenMemHandle", 205)
    with pytest.raises(cuda.CudaError) as info:
        Tensor.load_from_shared_memory(pool, good)
    assert str(info.value) == (
        "Failed to open the cudaIpcHandle. error: cudaErrorMapBufferObjectFailed: "
        "mapping of buffer object failed"
    )
    assert fake.current == 0
    del info  # its traceback holds the failed load's record
    gc.collect()
    assert (pool.refcount(good), pool.pending_messages(good)) == (2, 1)  # the saver's, pending


def test_save_without_cuda(fake: FakeCudaRuntime, pool: SharedMemoryPool) -> None:
    tensor, _host, _ptr = saved_gpu_tensor(fake)
    cuda.set_runtime(FakeCudaRuntime(no_driver=True))
    with pytest.raises(cuda.CudaUnavailableError):
        tensor.save_to_shared_memory(pool)
    assert pool.stats().allocations == 0
