"""pb_tensor.cuda on a real CUDA device (marked ``gpu``; skipped without one)."""

from __future__ import annotations

import gc
import importlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from conftest import run_python_code

from pb_tensor import cuda

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("real_cuda")]

MIB = 1 << 20


class Stream:
    """A stream-protocol object (as cuda.core's Stream)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def runtime() -> Any:
    """cuda.bindings.runtime, untyped: tests call more of it than typings/ declares."""
    return importlib.import_module("cuda.bindings.runtime")


def free_device_memory() -> int:
    err, free, _total = runtime().cudaMemGetInfo()
    assert int(err) == 0
    return int(free)


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_python_code(code, *args, timeout=300, dev_mode=False, warnings_as_errors=False)


def test_device_count() -> None:
    err, count = runtime().cudaGetDeviceCount()
    assert int(err) == 0
    assert cuda.device_count() == count > 0
    assert cuda.unavailable_reason() is None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        assert torch.cuda.device_count() == count


def test_scope_sets_and_restores() -> None:
    start = cuda.current_device()
    cuda.proxy_stream(start)  # makes the start device's primary context active
    for device in range(cuda.device_count()):
        with cuda.device_scope(device) as previous:
            assert previous == start
            assert cuda.current_device() == device
        assert cuda.current_device() == start
    with pytest.raises(RuntimeError), cuda.device_scope(0):
        raise RuntimeError("inside")
    assert cuda.current_device() == start


def test_scope_invalid_device() -> None:
    start = cuda.current_device()
    with (
        pytest.raises(cuda.CudaError, match="cudaErrorInvalidDevice"),
        cuda.device_scope(cuda.device_count()),
    ):
        pytest.fail("the block must not run")
    assert cuda.current_device() == start


def test_proxy_stream_per_device() -> None:
    rt = runtime()
    start = cuda.current_device()
    streams = {}
    for device in range(cuda.device_count()):
        stream = cuda.proxy_stream(device)
        assert stream > 2
        assert cuda.proxy_stream(device) == stream
        streams[device] = stream
        if hasattr(rt, "cudaStreamGetDevice"):  # CUDA 12.8+
            err, owner = rt.cudaStreamGetDevice(stream)
            assert int(err) == 0
            assert int(owner) == device
        cuda.synchronize(stream, device=device)

        cuda.synchronize(Stream(stream), device=device)
        with cuda.dlpack_import(device) as handle:
            assert handle == stream
    assert len(set(streams.values())) == len(streams)
    assert cuda.current_device() == start


def test_memcpy_round_trip() -> None:
    host = np.arange(1 << 16, dtype=np.float32)
    for device in range(cuda.device_count()):
        with cuda.DeviceBuffer(host.nbytes, device=device) as buffer:
            cuda.memcpy(
                buffer.ptr,
                host.ctypes.data,
                host.nbytes,
                cuda.MemcpyKind.HOST_TO_DEVICE,
                device=device,
            )
            assert cuda.pointer_device(buffer.ptr) == device
            assert cuda.allocation_offset(buffer.ptr + 1024, 4, device=device) == 1024
            copy = cuda.device_copy(buffer.ptr, host.nbytes, device=device)
            back = np.zeros_like(host)
            cuda.copy_device_to_host(back, copy.ptr, device=device)
            np.testing.assert_array_equal(back, host)
            back[:] = 0
            cuda.memcpy(
                back.ctypes.data,
                copy.ptr,
                host.nbytes,
                cuda.MemcpyKind.DEVICE_TO_HOST,
                device=device,
            )
            np.testing.assert_array_equal(back, host)
            copy.free()
    assert cuda.pointer_device(np.zeros(4).ctypes.data) is None


def test_real_error_texts() -> None:
    with pytest.raises(cuda.CudaError, match=r"^Failed to open the cudaIpcHandle\. error: cuda"):
        cuda.ipc_open_mem_handle(bytes(64), device=0)
    with pytest.raises(cuda.CudaError, match="range start address"):
        cuda.allocation_offset(np.zeros(4).ctypes.data, 4, device=0)


def test_dlpack_import_torch_side_stream() -> None:
    torch: Any = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(1 << 22, device="cuda")
        for _ in range(20):
            x = x + 1.0
        x += 2
        # torch makes the consumer's stream wait for its *current* stream (here: side).
        with cuda.dlpack_import(x.device.index) as stream:
            capsule = x.__dlpack__(stream=stream)
        assert side.query()  # the producer's work finished before the import returned
    y = torch.utils.dlpack.from_dlpack(capsule)
    assert bool(torch.all(y == 22))
    imported = cuda.import_from_producer(x, x.device.index)
    assert imported.data == x.data_ptr()
    del imported


def test_dlpack_import_cupy_non_blocking_stream() -> None:
    cp: Any = pytest.importorskip("cupy")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.ones(1 << 22, dtype=cp.float32)
        for _ in range(20):
            a = a * 1.0
        a += 1
        imported = cuda.import_from_producer(a, a.device.id)
        assert stream.done
    assert imported.data == a.data.ptr
    del imported


def test_ipc_across_processes() -> None:
    pattern = (np.arange(1 << 16) % 251).astype(np.uint8)
    with cuda.DeviceBuffer(MIB, device=0) as buffer:
        cuda.memcpy(
            buffer.ptr + 4096,
            pattern.ctypes.data,
            pattern.nbytes,
            cuda.MemcpyKind.HOST_TO_DEVICE,
            device=0,
        )
        handle, offset = cuda.ipc_export(buffer.ptr + 4096, pattern.nbytes, device=0)
        assert len(handle) == cuda.IPC_HANDLE_SIZE
        assert offset == 4096
        result = run_python(
            """
            import sys
            import numpy as np
            from cuda.bindings import runtime
            from pb_tensor import cuda

            handle, offset, nbytes = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
            with cuda.ipc_import(handle, offset, nbytes, device=0) as mapping:
                out = np.empty(nbytes, np.uint8)
                cuda.copy_device_to_host(out, mapping.ptr, device=0)
            print(out.tobytes().hex())

            def free():
                return int(runtime.cudaMemGetInfo()[1])

            baseline = free()
            for _ in range(100):
                mapping = cuda.ipc_import(handle, offset, nbytes, device=0)
                base = cuda.ipc_open_mem_handle(handle, device=0)  # CUDA ref-counts re-opens
                assert base == mapping.base
                cuda.ipc_close_mem_handle(base, device=0)
                mapping.close()
            print(baseline - free())
            """,
            handle.hex(),
            str(offset),
            str(pattern.nbytes),
        )
    assert result.returncode == 0, result.stderr
    data_hex, leaked = result.stdout.split()
    assert bytes.fromhex(data_hex) == pattern.tobytes()
    assert int(leaked) < 4 * MIB


def test_memory_back_to_baseline() -> None:
    host = np.ones(MIB // 4, dtype=np.float32)
    back = np.empty_like(host)

    def once() -> None:
        with cuda.DeviceBuffer(host.nbytes, device=0) as buffer:
            cuda.memcpy(
                buffer.ptr,
                host.ctypes.data,
                host.nbytes,
                cuda.MemcpyKind.HOST_TO_DEVICE,
                device=0,
            )
            copy = cuda.device_copy(buffer.ptr, host.nbytes, device=0)
            cuda.copy_device_to_host(back, copy.ptr, device=0)
            cuda.ipc_export(copy.ptr + 64, 64, device=0)
            with cuda.dlpack_import(0):
                pass
            del copy  # freed by garbage collection

    once()  # warm up: context, proxy stream, driver state
    gc.collect()
    baseline = free_device_memory()
    for _ in range(100):
        once()
    gc.collect()
    assert baseline - free_device_memory() < 4 * MIB
    np.testing.assert_array_equal(back, host)


def test_torch_import_memory_back_to_baseline() -> None:
    torch: Any = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(100):
        x = torch.ones(MIB, device="cuda")
        imported = cuda.import_from_producer(x, x.device.index)
        del imported, x
    gc.collect()
    assert torch.cuda.memory_allocated() == baseline
