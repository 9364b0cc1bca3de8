"""Tensor on a real CUDA device (marked ``gpu``; skipped without one).

Upstream's GPU DLPack tests (Triton server's ``qa/python_models/dlpack_test``)
ported as behaviours: torch and CuPy round trips for every dtype both ways, through capsules and
through the protocol; work queued on a side stream or a non-blocking stream is complete right
after ``from_dlpack``; data on device 1 imported while device 0 is current; exports outliving the
Tensor; GPU tensors across processes through the shared-memory pool; device memory back to its
baseline after 100 iterations. Needs no hypothesis (the GPU machine may lack it).
"""

from __future__ import annotations

import gc
import importlib
import subprocess
import warnings
import zlib
from typing import Any

import numpy as np
import pytest
from conftest import run_python_code

import dlpack_ctypes as dl
from pb_tensor import Tensor, cuda
from pb_tensor.dtypes import MemoryType, TritonDtype
from pb_tensor.shm import SharedMemoryPool, load_record

# Skipped by mark rather than in a fixture: no per-test setup/teardown cost on CPU machines.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("real_cuda"),
    pytest.mark.skipif(not cuda.is_available(), reason=cuda.unavailable_reason() or "no GPU"),
]

MIB = 1 << 20


def _optional(name: str) -> Any:
    # Third-party import-time warnings (CUDA path probes ...) are not this suite's business.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except Exception:  # ImportError, or a broken CUDA install raising at import
            return None


torch: Any = _optional("torch")
cupy: Any = _optional("cupy")


def need_torch() -> Any:
    if torch is None or not torch.cuda.is_available():
        pytest.skip("torch with CUDA is not installed")
    return torch


def need_cupy() -> Any:
    if cupy is None:
        pytest.skip("CuPy is not installed")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        pytest.skip(f"CuPy cannot use CUDA: {exc}")
    return cupy


def need_gpus(count: int) -> None:
    if cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs, found {cuda.device_count()}")


def free_device_memory() -> int:
    runtime: Any = importlib.import_module("cuda.bindings.runtime")
    err, free, _total = runtime.cudaMemGetInfo()
    assert int(err) == 0
    return int(free)


def pb_host_bytes(tensor: Tensor) -> bytes:
    """The tensor's data as bytes, copied to the host by ``to_host`` (works for BF16 too)."""
    host = tensor.to_host()
    with dl.from_dlpack(host) as imported:
        return imported.numpy(raw=True).tobytes()


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_python_code(code, *args, timeout=120, dev_mode=False, warnings_as_errors=False)


# ---------------------------------------------------------------------------------------------
# torch: every dtype, both directions, capsule and protocol (test_pytorch_dlpack,
# test_dlpack_gpu_tensors, test_dlpack_gpu_numpy)

TORCH_DTYPES = {
    "bool": TritonDtype.TYPE_BOOL,
    "uint8": TritonDtype.TYPE_UINT8,
    "uint16": TritonDtype.TYPE_UINT16,
    "uint32": TritonDtype.TYPE_UINT32,
    "uint64": TritonDtype.TYPE_UINT64,
    "int8": TritonDtype.TYPE_INT8,
    "int16": TritonDtype.TYPE_INT16,
    "int32": TritonDtype.TYPE_INT32,
    "int64": TritonDtype.TYPE_INT64,
    "float16": TritonDtype.TYPE_FP16,
    "float32": TritonDtype.TYPE_FP32,
    "float64": TritonDtype.TYPE_FP64,
    "bfloat16": TritonDtype.TYPE_BF16,
}


def torch_bytes(t: Any) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())


def torch_tensor(name: str, device: str = "cuda") -> Any:
    """100 values 0..6 of dtype ``name`` on ``device``; skips what this torch cannot export."""
    dtype = getattr(torch, name)
    values = torch.arange(100, dtype=torch.int64, device=device) % (2 if name == "bool" else 7)
    try:
        x = values.to(dtype)
        torch.utils.dlpack.to_dlpack(x)
    except (RuntimeError, TypeError, BufferError) as exc:
        pytest.skip(f"torch {torch.__version__} cannot export {name} on {device}: {exc}")
    return x


@pytest.mark.parametrize("path", ["protocol", "capsule"])
@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_torch_round_trip(name: str, path: str) -> None:
    need_torch()
    x = torch_tensor(name)
    source = x if path == "protocol" else torch.utils.dlpack.to_dlpack(x)
    pb = Tensor.from_dlpack("test_tensor", source)
    assert pb.triton_dtype() == TORCH_DTYPES[name]
    assert not pb.is_cpu()
    assert pb.memory_type == MemoryType.GPU
    device_type, device_id = x.__dlpack_device__()
    assert pb.__dlpack_device__() == (int(device_type), int(device_id))
    assert pb.data_ptr == x.data_ptr()  # zero-copy
    assert pb.shape() == [100]
    with pytest.raises(Exception, match="Tensor is stored in GPU and cannot be converted to NumPy"):
        pb.as_numpy()

    if path == "protocol":
        back = torch.from_dlpack(pb)
    else:
        back = torch.utils.dlpack.from_dlpack(pb.to_dlpack())
    assert back.dtype == x.dtype
    assert back.device == x.device
    assert back.data_ptr() == x.data_ptr()
    assert torch_bytes(back) == torch_bytes(x)
    assert pb_host_bytes(pb) == torch_bytes(x)


def test_torch_cpu_tensor_stays_on_cpu() -> None:
    need_torch()
    x = torch.ones(8, dtype=torch.float16)
    pb = Tensor.from_dlpack("tensor", x)
    assert pb.is_cpu()
    assert pb.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(pb), x.numpy())


def test_torch_to_host_and_host_copy_export() -> None:
    need_torch()
    x = torch.arange(4096, dtype=torch.float32, device="cuda").reshape(64, 64)
    pb = Tensor.from_dlpack("tensor", x)
    expected = x.cpu().numpy()
    np.testing.assert_array_equal(pb.to_host().as_numpy(), expected)
    with dl.consume(pb.__dlpack__(dl_device=(1, 0), max_version=(1, 3))) as host:
        assert host.is_copied
        assert host.device == (1, 0)
        np.testing.assert_array_equal(host.numpy(), expected)
    try:
        from_numpy = np.from_dlpack(pb, device="cpu")
    except TypeError:  # numpy < 2.1: no device keyword
        from_numpy = expected
    np.testing.assert_array_equal(from_numpy, expected)


def test_torch_device_copy_export() -> None:
    need_torch()
    x = torch.arange(1 << 16, dtype=torch.int32, device="cuda")
    pb = Tensor.from_dlpack("tensor", x)
    copy = torch.from_dlpack(pb.__dlpack__(copy=True, max_version=(1, 3)))
    assert copy.data_ptr() != x.data_ptr()
    assert copy.device == x.device
    x.zero_()
    torch.cuda.synchronize()
    assert torch.equal(copy, torch.arange(1 << 16, dtype=torch.int32, device="cuda"))


def test_torch_empty_tensor() -> None:
    need_torch()
    x = torch.ones((0,), device="cuda")  # upstream's dlpack_empty_output (server#4865)
    pb = Tensor.from_dlpack("OUTPUT", torch.utils.dlpack.to_dlpack(x))
    assert pb.shape() == [0]
    assert pb.byte_size == 0
    assert torch.from_dlpack(pb).shape == (0,)
    assert pb.to_host().as_numpy().shape == (0,)


# ---------------------------------------------------------------------------------------------
# CuPy: every dtype, both directions

# CuPy has no bfloat16.
CUPY_DTYPES = {k: v for k, v in TORCH_DTYPES.items() if k != "bfloat16"}


def cupy_legacy(call: Any, *args: Any) -> Any:
    """CuPy's capsule API, which newer releases deprecate."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args)


@pytest.mark.parametrize("path", ["protocol", "capsule"])
@pytest.mark.parametrize("name", list(CUPY_DTYPES))
def test_cupy_round_trip(name: str, path: str) -> None:
    cp = need_cupy()
    x = (cp.arange(100) % (2 if name == "bool" else 7)).astype(name)
    source = x if path == "protocol" else cupy_legacy(x.toDlpack)
    pb = Tensor.from_dlpack("test_tensor", source)
    assert pb.triton_dtype() == CUPY_DTYPES[name]
    assert not pb.is_cpu()
    assert pb.__dlpack_device__() == tuple(int(v) for v in x.__dlpack_device__())
    assert pb.data_ptr == x.data.ptr

    exported = pb if path == "protocol" else pb.to_dlpack()
    back = cupy_legacy(cp.from_dlpack, exported)
    assert back.dtype == x.dtype
    assert back.data.ptr == x.data.ptr
    assert bool((back == x).all())
    assert pb_host_bytes(pb) == x.get().tobytes()


# ---------------------------------------------------------------------------------------------
# Streams: pending producer work is finished when from_dlpack returns


def queue_work(t: Any, x: Any) -> None:
    """Keep the current torch stream busy for a while (no timing is asserted)."""
    sleep = getattr(t.cuda, "_sleep", None)
    if sleep is not None:
        sleep(50_000_000)
    else:
        m = t.rand(1024, 1024, device=x.device)
        for _ in range(20):
            m = m @ m


def test_cuda_multi_stream_torch() -> None:
    t = need_torch()
    side = t.cuda.Stream()
    with t.cuda.stream(side):
        x = t.zeros(4, device="cuda")
        queue_work(t, x)
        x += 2
        pb = Tensor.from_dlpack("tensor", x)
        assert side.query()  # the producer stream has no pending work left
        assert t.equal(t.from_dlpack(pb), t.full((4,), 2.0, device="cuda"))
        # The capsule path does not synchronise, but consumers on the same stream see the data.
        y = t.zeros(4, device="cuda")
        queue_work(t, y)
        y += 2
        pb_capsule = Tensor.from_dlpack("tensor", t.utils.dlpack.to_dlpack(y))
        assert t.equal(t.from_dlpack(pb_capsule), t.full((4,), 2.0, device="cuda"))
    assert pb.__dlpack_device__() == (2, x.device.index)


def test_cuda_non_blocking_multi_stream_cupy() -> None:
    cp = need_cupy()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.ones(1 << 22, dtype=cp.float32)
        for _ in range(50):
            a = a * 1.0
        a += 1
        pb = Tensor.from_dlpack("tensor", a[:4])
        assert stream.done  # "Verify that non-blocking stream has no pending jobs left"
    assert pb.__dlpack_device__() == tuple(int(v) for v in a.__dlpack_device__())
    assert bool((cp.from_dlpack(pb) == 2).all())


def test_cuda_blocking_stream_cupy() -> None:
    cp = need_cupy()
    stream = cp.cuda.Stream()
    with stream:
        a = cp.zeros(1 << 22, dtype=cp.float32)
        for _ in range(50):
            a = a + 0.0
        a += 2
        pb = Tensor.from_dlpack("tensor", a)
        assert stream.done
    assert float(cp.from_dlpack(pb)[0]) == 2.0


# ---------------------------------------------------------------------------------------------
# Several GPUs (skipped with fewer than 2)


@pytest.mark.parametrize("kind", ["null", "blocking", "non_blocking"])
def test_cuda_multi_gpu_cupy(kind: str) -> None:
    """Data made on GPU 1 imported while GPU 0 is current (test_cuda_multi_gpu,
    test_cuda_blocking_stream_multi_gpu, test_cuda_non_blocking_stream_multi_gpu)."""
    cp = need_cupy()
    need_gpus(2)
    with cp.cuda.Device(1):
        if kind == "null":
            stream = cp.cuda.Stream.null
        else:
            stream = cp.cuda.Stream(non_blocking=kind == "non_blocking")
        # The producer orders its *current* stream: the import runs while it is current.
        with stream:
            a = cp.ones(1 << 22, dtype=cp.float32)
            for _ in range(50):
                a = a * 1.0
            a += 1
            with cp.cuda.Device(0):
                pb = Tensor.from_dlpack("tensor", a)
                assert cuda.current_device() == 0  # restored
                assert cp.cuda.runtime.getDevice() == 0
        assert stream.done
    assert pb.__dlpack_device__() == (2, 1)
    assert pb.memory_type_id == 1
    with cp.cuda.Device(1):
        assert bool((cp.from_dlpack(pb) == 2).all())
    assert np.all(pb.to_host().as_numpy() == 2)


def test_cuda_multi_gpu_torch() -> None:
    t = need_torch()
    need_gpus(2)
    t.cuda.set_device(0)
    with t.cuda.device(1):  # work on GPU 1's default stream, which torch orders on export
        x = t.zeros(4, device="cuda:1")
        queue_work(t, x)
        x += 2
    pb = Tensor.from_dlpack("tensor", x)  # device 0 current, data on device 1
    assert t.cuda.default_stream(1).query()
    assert t.cuda.current_device() == 0
    assert cuda.current_device() == 0
    assert pb.__dlpack_device__() == (2, 1)
    # The proxy stream used for device 1 belongs to device 1 (upstream's keying bug, fixed).
    stream = cuda.proxy_stream(1)
    runtime: Any = importlib.import_module("cuda.bindings.runtime")
    if hasattr(runtime, "cudaStreamGetDevice"):
        err, owner = runtime.cudaStreamGetDevice(stream)
        assert int(err) == 0
        assert int(owner) == 1
    assert t.equal(t.from_dlpack(pb), t.full((4,), 2.0, device="cuda:1"))


# ---------------------------------------------------------------------------------------------
# Lifetime (test_bls_tensor_lifecycle)


def test_exports_outlive_the_tensor() -> None:
    t = need_torch()
    expected = t.arange(1 << 20, dtype=t.float32, device="cuda")
    x = expected.clone()
    pb = Tensor.from_dlpack("OUTPUT0", x)
    through_protocol = t.from_dlpack(pb)
    through_capsule = t.utils.dlpack.from_dlpack(pb.to_dlpack())
    versioned = t.from_dlpack(pb.__dlpack__(max_version=(1, 3)))
    del pb, x
    gc.collect()
    for y in (through_protocol, through_capsule, versioned):
        assert t.equal(y, expected)


# ---------------------------------------------------------------------------------------------
# Shared-memory pool: CUDA IPC across processes


CHILD = """
    import sys, zlib
    from pb_tensor import Tensor
    from pb_tensor.shm import SharedMemoryPool

    with SharedMemoryPool.attach(sys.argv[1]) as pool:
        for handle in sys.argv[2:]:
            t = Tensor.load_from_shared_memory(pool, int(handle))
            host = t.to_host().as_numpy()
            print(t.name(), t.shape(), t.__dlpack_device__()[1], t.is_cpu(),
                  zlib.crc32(host.tobytes()), flush=True)
            del t, host
"""


def test_ipc_across_processes_via_pool() -> None:
    t = need_torch()
    x = t.arange(1 << 16, dtype=t.int32, device="cuda") * 3
    part = x[256:]  # not at the start of its allocation: the offset must be recorded
    pb = Tensor.from_dlpack("OUTPUT0", part)
    empty = Tensor.from_dlpack("EMPTY", t.ones((0, 3), device="cuda"))
    with SharedMemoryPool.create(1 << 20) as pool:
        handle = pb.save_to_shared_memory(pool)
        empty_handle = empty.save_to_shared_memory(pool)
        record = load_record(pool, handle)
        assert record.memory_type == int(MemoryType.GPU)
        assert record.gpu_pointer_offset >= 256 * 4
        assert record.ipc_handle is not None
        assert any(record.ipc_handle)
        del record
        result = run_python(CHILD, pool.name, str(handle), str(empty_handle))
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        expected = zlib.crc32(part.cpu().numpy().tobytes())
        device = x.device.index
        assert lines[0] == f"OUTPUT0 [{part.numel()}] {device} False {expected}"
        assert lines[1] == f"EMPTY [0, 3] {device} False {zlib.crc32(b'')}"
        assert pool.refcount(handle) == 1  # the child's reference went with it
        del pb, empty
        gc.collect()
        assert pool.stats().allocations == 0


def test_pool_in_saving_process() -> None:
    t = need_torch()
    x = t.arange(1000, dtype=t.float32, device="cuda")
    pb = Tensor.from_dlpack("OUTPUT0", x)
    with SharedMemoryPool.create(1 << 16) as pool:
        handle = pb.save_to_shared_memory(pool)
        loaded = Tensor.load_from_shared_memory(pool, handle)
        assert loaded.data_ptr == x.data_ptr()  # no IPC within the saving process
        del pb
        y = t.from_dlpack(loaded)
        del loaded
        gc.collect()
        assert t.equal(y, t.arange(1000, dtype=t.float32, device="cuda"))
        del y
        gc.collect()
        assert pool.stats().allocations == 0


# ---------------------------------------------------------------------------------------------
# Memory returns to its baseline


def test_memory_back_to_baseline() -> None:
    t = need_torch()
    with SharedMemoryPool.create(1 << 20) as pool:

        def once() -> None:
            x = t.ones(1 << 18, device="cuda")
            pb = Tensor.from_dlpack("tensor", x)
            y = t.from_dlpack(pb)
            from_capsule = Tensor.from_dlpack("capsule", t.utils.dlpack.to_dlpack(x))
            copied = t.from_dlpack(pb.__dlpack__(copy=True, max_version=(1, 3)))
            host = pb.to_host()
            handle = pb.save_to_shared_memory(pool)
            loaded = Tensor.load_from_shared_memory(pool, handle)
            z = t.from_dlpack(loaded)
            assert float(y[0] + copied[-1] + z[1]) == 3.0
            assert host.as_numpy()[0] == 1.0
            del x, pb, y, from_capsule, copied, host, loaded, z

        once()  # warm up: proxy stream, contexts, torch's cache
        gc.collect()
        t.cuda.synchronize()
        allocated = t.cuda.memory_allocated()
        free = free_device_memory()
        for _ in range(100):
            once()
        gc.collect()
        t.cuda.synchronize()
        assert t.cuda.memory_allocated() == allocated
        assert free - free_device_memory() < 8 * MIB
        assert pool.stats().allocations == 0
        assert dl.live_exports() == 0


# ---------------------------------------------------------------------------------------------
# torch's numpy bridge is for plain CPU tensors only


def test_torch_pinned_and_cuda_tensors_take_dlpack() -> None:
    t = need_torch()
    Tensor.from_dlpack("warm", t.zeros(1))  # binds torch.Tensor for the bridge
    pinned = t.arange(6, dtype=t.float32).pin_memory()
    device_type = int(pinned.__dlpack_device__()[0])
    x = Tensor.from_dlpack("pinned", pinned)
    expected = MemoryType.CPU_PINNED if device_type == 3 else MemoryType.CPU
    assert (x.memory_type, x.data_ptr) == (expected, pinned.data_ptr())
    assert x.as_numpy().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    on_gpu = t.arange(6, dtype=t.float32, device="cuda")
    y = Tensor.from_dlpack("gpu", on_gpu)
    assert (y.memory_type, y.data_ptr) == (MemoryType.GPU, on_gpu.data_ptr())
    assert t.equal(t.from_dlpack(y), on_gpu)
