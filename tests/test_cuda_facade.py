"""pb_tensor.cuda without a GPU: lazy import, missing cuda-python, missing driver, and the
facade's call sequences against the recording fake in ``cuda_fake.py``."""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import threading

import numpy as np
import pytest
from conftest import run_python_code
from cuda_fake import CudaStream, FakeCudaRuntime, entry_points

from pb_tensor import cuda
from pb_tensor.cuda import _backend as cuda_backend
from pb_tensor.errors import TritonModelException

HAS_CUDA_PYTHON = importlib.util.find_spec("cuda") is not None and (
    importlib.util.find_spec("cuda.bindings") is not None
)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return run_python_code(code, timeout=120, dev_mode=False, warnings_as_errors=False)


# ---------------------------------------------------------------------------------------------
# Lazy import and unavailable CUDA


def test_import_does_not_import_cuda() -> None:
    result = run_python(
        """
        import sys
        import pb_tensor
        import pb_tensor.cuda as c
        assert not any(m == "cuda" or m.startswith("cuda.") for m in sys.modules), sorted(
            m for m in sys.modules if m.startswith("cuda"))
        c.is_available()  # the first GPU entry point loads cuda-python when it is installed
        print("loaded" if "cuda.bindings.runtime" in sys.modules else "absent")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("loaded" if HAS_CUDA_PYTHON else "absent")


def test_without_cuda_python_every_entry_point_raises() -> None:
    result = run_python(
        """
        import sys
        sys.modules["cuda"] = None  # hides cuda-python: `import cuda...` raises ImportError
        from cuda_fake import entry_points
        from pb_tensor import cuda
        from pb_tensor.errors import TritonModelException

        assert cuda.is_available() is False
        assert cuda.device_count() == 0
        reason = cuda.unavailable_reason()
        from pb_tensor._hints import install_hint  # a clone's extra, or the package's name

        assert reason.startswith(
            "CUDA is not available: cuda-python is not installed "
            f"({install_hint('cuda', 'cuda-python')})"
        ), reason
        for name, call in entry_points(cuda):
            try:
                call()
            except TritonModelException as exc:
                assert isinstance(exc, cuda.CudaUnavailableError), name
                assert "cuda-python is not installed" in str(exc), (name, str(exc))
                assert exc.code is None and exc.error_name is None
            else:
                raise AssertionError(f"{name} did not raise")
        # Trivial cases need no CUDA at all, so they still work.
        assert cuda.pointer_device(0) is None
        assert cuda.allocation_offset(0x1000, 0, device=0) == 0
        assert cuda.ipc_export(0, 0, device=0) == (bytes(64), 0)
        cuda.memcpy(1, 2, 0, cuda.MemcpyKind.HOST_TO_DEVICE, device=0)
        assert cuda.malloc(0, device=0) == 0
        cuda.release_proxy_streams()
        assert "cuda" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(not HAS_CUDA_PYTHON, reason="cuda-python is not installed")
def test_cuda_python_without_driver_or_device() -> None:
    previous = cuda.set_runtime(None)
    try:
        if cuda.is_available():
            pytest.skip("a CUDA device is present")
        assert cuda.device_count() == 0
        reason = cuda.unavailable_reason()
        assert reason is not None
        if cuda_backend.driver_library_present():
            pytest.skip("libcuda is installed: the no-driver message cannot be checked here")
        expected = "no CUDA driver is installed (libcuda.so.1 cannot be loaded)"
        assert reason.startswith(f"CUDA is not available: {expected} (cudaError"), reason
        assert cuda.unavailable_reason(short=True) == expected
        for name, call in entry_points(cuda):
            with pytest.raises(cuda.CudaUnavailableError) as info:
                call()
            message = str(info.value)
            assert message == reason, name
            assert info.value.error_name is not None
            assert info.value.error_name.startswith("cudaError")
            assert f"({info.value.error_name}: " in message
    finally:
        cuda.set_runtime(previous)


@pytest.mark.skipif(not HAS_CUDA_PYTHON, reason="cuda-python is not installed")
def test_default_runtime_converts_cuda_python_results() -> None:
    from pb_tensor.cuda._runtime import _CudaPythonRuntime

    runtime = _CudaPythonRuntime()
    err, name = runtime.cudaGetErrorName(35)
    assert (err, name) == (0, b"cudaErrorInsufficientDriver")
    if cuda.is_available():
        pytest.skip("the no-driver results below need a machine without a driver")
    assert runtime.cudaGetDevice() == (35, 0)
    assert runtime.cudaStreamCreate() == (35, 0)
    assert runtime.cudaSetDevice(0) == (35,)
    assert runtime.cudaPointerGetAttributes(0x1000) == (35, 0, -1)
    assert runtime.cudaIpcGetMemHandle(0x1000) == (35, b"")
    assert runtime.cudaIpcOpenMemHandle(bytes(range(64)), 1) == (35, 0)
    assert runtime.cudaMemcpy(0, 0, 0, 2) == (35,)
    # Driver calls cannot load libcuda: a clear TritonModelException, not a RuntimeError.
    with pytest.raises(cuda.CudaUnavailableError, match="CUDA driver library cannot be loaded"):
        runtime.cuDevicePrimaryCtxGetState(0)
    with pytest.raises(cuda.CudaUnavailableError, match="CUDA driver library cannot be loaded"):
        runtime.cuPointerGetAttribute(11, 0x1000)


@pytest.mark.parametrize(
    ("library_present", "cause"),
    [
        (False, "no CUDA driver is installed (libcuda.so.1 cannot be loaded)"),
        (True, "the CUDA driver is too old for this cuda-python"),
    ],
)
def test_fake_without_driver_reports_error_name(
    monkeypatch: pytest.MonkeyPatch, library_present: bool, cause: str
) -> None:
    monkeypatch.setattr(cuda_backend, "_driver_present", library_present)
    previous = cuda.set_runtime(FakeCudaRuntime(no_driver=True))
    try:
        assert not cuda.is_available()
        assert cuda.device_count() == 0
        assert cuda.unavailable_reason(short=True) == cause
        with pytest.raises(cuda.CudaUnavailableError) as info:
            cuda.proxy_stream(0)
        assert str(info.value) == (
            f"CUDA is not available: {cause} (cudaErrorInsufficientDriver: "
            "CUDA driver version is insufficient for CUDA runtime version)"
        )
        assert info.value.cause == cause
        assert isinstance(info.value, TritonModelException)
        assert info.value.code == 35
    finally:
        cuda.set_runtime(previous)


def test_fake_without_devices() -> None:
    runtime = FakeCudaRuntime(devices=0)
    previous = cuda.set_runtime(runtime)
    try:
        assert cuda.device_count() == 0
        assert cuda.unavailable_reason() == (
            "CUDA is not available: no CUDA device is visible to this process "
            "(cudaErrorNoDevice: no CUDA-capable device is detected)"
        )
        assert cuda.unavailable_reason(short=True) == "no CUDA device is visible to this process"
        with pytest.raises(cuda.CudaUnavailableError, match="cudaErrorNoDevice"):
            cuda.current_device()
    finally:
        cuda.set_runtime(previous)


# ---------------------------------------------------------------------------------------------
# Runtime injection and availability


def test_set_runtime_returns_previous() -> None:
    first, second = FakeCudaRuntime(), FakeCudaRuntime()
    original = cuda.set_runtime(first)
    try:
        assert cuda.set_runtime(second) is first
        assert cuda.set_runtime(first) is second
    finally:
        assert cuda.set_runtime(original) is first


def test_availability_probe_runs_once(fake: FakeCudaRuntime) -> None:
    fresh = FakeCudaRuntime(devices=3)
    cuda.set_runtime(fresh)
    assert cuda.device_count() == 3
    assert cuda.unavailable_reason() is None
    fresh.take()
    assert cuda.current_device() == 0
    assert cuda.current_device() == 0
    assert fresh.names() == ["cudaGetDevice", "cudaGetDevice"]


def test_first_entry_point_probes_availability() -> None:
    runtime = FakeCudaRuntime()
    previous = cuda.set_runtime(runtime)
    try:
        cuda.current_device()
        assert runtime.names() == ["cudaGetDeviceCount", "cudaGetDevice"]
    finally:
        cuda.set_runtime(previous)


def test_current_device_error(fake: FakeCudaRuntime) -> None:
    fake.fail("cudaGetDevice", 3)
    with pytest.raises(cuda.CudaError) as info:
        cuda.current_device()
    assert str(info.value).startswith("Failed to get current CUDA device id. error: ")
    assert isinstance(info.value, TritonModelException)
    assert info.value.code == 3


# ---------------------------------------------------------------------------------------------
# Device scope


def test_scope_on_current_device_does_not_switch(fake: FakeCudaRuntime) -> None:
    with cuda.device_scope(0) as previous:
        assert previous == 0
    assert fake.take() == [("cudaGetDevice",)]


def test_scope_switches_and_restores(fake: FakeCudaRuntime) -> None:
    with cuda.device_scope(1) as previous:
        assert previous == 0
        assert fake.current == 1
    assert fake.current == 0
    assert fake.take() == [
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),
        ("cuDevicePrimaryCtxGetState", 0),
        ("cudaSetDevice", 0),
    ]


def test_scope_restores_on_error(fake: FakeCudaRuntime) -> None:
    with pytest.raises(KeyError), cuda.device_scope(1):
        raise KeyError("inside")
    assert fake.current == 0
    assert fake.names()[-1] == "cudaSetDevice"


def test_scope_keeps_device_when_previous_context_inactive(fake: FakeCudaRuntime) -> None:
    # Restoring would create a primary context on a device the process never used.
    fake.active.clear()
    with cuda.device_scope(1):
        pass
    assert fake.current == 1
    assert fake.names() == ["cudaGetDevice", "cudaSetDevice", "cuDevicePrimaryCtxGetState"]


def test_scope_restores_when_driver_cannot_be_asked(fake: FakeCudaRuntime) -> None:
    fake.raises["cuDevicePrimaryCtxGetState"] = cuda.CudaUnavailableError("no libcuda")
    with cuda.device_scope(1):
        pass
    assert fake.current == 0


def test_scope_set_failure(fake: FakeCudaRuntime) -> None:
    with pytest.raises(cuda.CudaError) as info, cuda.device_scope(5):
        pytest.fail("the block must not run")
    assert str(info.value) == (
        "Failed to set the CUDA device to 5. error: cudaErrorInvalidDevice: invalid device ordinal"
    )
    assert fake.names() == ["cudaGetDevice", "cudaSetDevice"]


def test_scope_restore_failure_raises_after_clean_block(fake: FakeCudaRuntime) -> None:
    scope = cuda.device_scope(1)
    scope.__enter__()
    fake.fail("cudaSetDevice", 719)
    with pytest.raises(cuda.CudaError, match=r"^Failed to set the CUDA device to 0\. error: "):
        scope.__exit__(None, None, None)


def test_scope_restore_failure_does_not_hide_block_error(fake: FakeCudaRuntime) -> None:
    def block() -> None:
        with cuda.device_scope(1):
            fake.fail("cudaSetDevice", 719)
            raise KeyError("inside")

    with pytest.raises(KeyError):
        block()


def test_scope_primary_context_error(fake: FakeCudaRuntime) -> None:
    scope = cuda.device_scope(1)
    scope.__enter__()
    fake.fail("cuDevicePrimaryCtxGetState", 201)
    with pytest.raises(cuda.CudaError) as info:
        scope.__exit__(None, None, None)
    assert str(info.value) == (
        "failed to get primary context state: CUDA_ERROR_INVALID_CONTEXT: invalid device context"
    )
    assert info.value.error_name == "CUDA_ERROR_INVALID_CONTEXT"


# ---------------------------------------------------------------------------------------------
# Proxy streams and the DLPack import sequence


def test_proxy_stream_created_once_per_device_on_that_device(fake: FakeCudaRuntime) -> None:
    s1 = cuda.proxy_stream(1)
    assert fake.streams[s1] == 1
    assert fake.current == 0
    assert fake.take() == [
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),
        ("cudaStreamCreate",),
        ("cuDevicePrimaryCtxGetState", 0),
        ("cudaSetDevice", 0),
    ]
    assert cuda.proxy_stream(1) == s1
    assert fake.take() == []  # cached: no CUDA call at all
    s0 = cuda.proxy_stream(0)
    assert s0 != s1
    assert fake.streams[s0] == 0


def test_dlpack_import_cross_device_uses_tensor_device_stream(fake: FakeCudaRuntime) -> None:
    # Device 0 is current, the tensor lives on device 1.
    with cuda.dlpack_import(1) as stream:
        assert fake.current == 1
        fake.calls.append(("producer.__dlpack__", stream))
    assert fake.streams[stream] == 1
    assert fake.current == 0
    assert fake.take() == [
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),
        ("cudaStreamCreate",),
        ("producer.__dlpack__", stream),
        ("cudaStreamSynchronize", stream),
        ("cuDevicePrimaryCtxGetState", 0),
        ("cudaSetDevice", 0),
    ]
    # Upstream cached that stream under device 0 (the caller's); here device 0 gets its own.
    with cuda.dlpack_import(0) as stream0:
        pass
    assert stream0 != stream
    assert fake.streams[stream0] == 0
    # Called from device 1 for a device-1 tensor: no switch, the same stream.
    fake.current = 1
    fake.take()
    with cuda.dlpack_import(1) as again:
        pass
    assert again == stream
    assert fake.take() == [("cudaGetDevice",), ("cudaStreamSynchronize", stream)]


def test_dlpack_import_sync_error(fake: FakeCudaRuntime) -> None:
    fake.fail("cudaStreamSynchronize", 719)
    with pytest.raises(cuda.CudaError) as info, cuda.dlpack_import(1):
        pass
    assert str(info.value) == (
        "Failed to synchronize CUDA device with id 1: cudaErrorLaunchFailure: "
        "unspecified launch failure"
    )
    assert info.value.error_name == "cudaErrorLaunchFailure"
    assert fake.current == 0


def test_dlpack_import_block_error_skips_sync(fake: FakeCudaRuntime) -> None:
    with pytest.raises(BufferError), cuda.dlpack_import(1):
        raise BufferError("producer refused")
    assert "cudaStreamSynchronize" not in fake.names()
    assert fake.current == 0


def test_dlpack_import_get_device_error(fake: FakeCudaRuntime) -> None:
    fake.fail("cudaGetDevice", 3)
    with (
        pytest.raises(cuda.CudaError, match=r"^Failed to get current CUDA device id\."),
        cuda.dlpack_import(1),
    ):
        pytest.fail("the block must not run")


def test_stream_creation_error_restores_and_retries(fake: FakeCudaRuntime) -> None:
    fake.fail("cudaStreamCreate", 2)
    with pytest.raises(cuda.CudaError) as info, cuda.dlpack_import(1):
        pytest.fail("the block must not run")
    assert str(info.value) == (
        "Failed to create a CUDA stream for a DLPack call. error: "
        "cudaErrorMemoryAllocation: out of memory"
    )
    assert fake.current == 0
    assert fake.streams == {}
    assert fake.streams[cuda.proxy_stream(1)] == 1  # not cached as failed


def test_proxy_stream_threads_create_one_stream(fake: FakeCudaRuntime) -> None:
    barrier = threading.Barrier(8)
    results: list[int] = []

    def worker() -> None:
        barrier.wait()
        results.append(cuda.proxy_stream(1))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1
    assert fake.names().count("cudaStreamCreate") == 1


def test_release_proxy_streams_ignores_failures(fake: FakeCudaRuntime) -> None:
    s0, s1 = cuda.proxy_stream(0), cuda.proxy_stream(1)
    fake.fail("cudaStreamDestroy", 400)
    cuda.release_proxy_streams()
    assert sorted(fake.destroyed) == sorted([s0, s1])
    fresh = cuda.proxy_stream(0)
    assert fresh not in (s0, s1)


def test_proxy_streams_destroyed_at_exit() -> None:
    result = run_python(
        """
        from cuda_fake import FakeCudaRuntime
        from pb_tensor import cuda
        runtime = FakeCudaRuntime(on_destroy=lambda s: print("destroy", hex(s)))
        runtime.fail("cudaStreamDestroy", 400)  # the first failure is ignored
        cuda.set_runtime(runtime)
        print("created", hex(cuda.proxy_stream(0)), hex(cuda.proxy_stream(1)))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.split("\n")
    created = lines[0].split()[1:]
    assert sorted(line.split()[1] for line in lines[1:] if line) == sorted(created)


def test_fork_forgets_proxy_streams(fake: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    parent_stream = cuda.proxy_stream(0)
    monkeypatch.setattr(os, "getpid", lambda: -12345)
    child_stream = cuda.proxy_stream(0)
    assert child_stream != parent_stream
    monkeypatch.undo()


# ---------------------------------------------------------------------------------------------
# Streams given by the caller


def test_synchronize_accepts_int_and_cuda_stream_objects(fake: FakeCudaRuntime) -> None:
    stream = cuda.proxy_stream(0)
    fake.take()
    cuda.synchronize(stream)
    cuda.synchronize(CudaStream(stream))
    cuda.synchronize(0)  # the default stream
    assert fake.take() == [("cudaStreamSynchronize", stream)] * 2 + [("cudaStreamSynchronize", 0)]


def test_stream_handle_validation() -> None:
    assert cuda.stream_handle(7) == 7
    assert cuda.stream_handle(CudaStream(0x1234)) == 0x1234

    class Attribute:
        __cuda_stream__ = (0, 42)

    # A tuple attribute is not the typed protocol (a method), but is accepted at run time.
    assert cuda.stream_handle(Attribute()) == 42  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int or an object with __cuda_stream__"):
        cuda.stream_handle("stream")  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(TypeError):
        cuda.stream_handle(True)
    with pytest.raises(ValueError, match="version 1"):
        cuda.stream_handle(CudaStream(5, version=1))
    with pytest.raises(ValueError, match="invalid CUDA stream handle"):
        cuda.stream_handle(-3)

    class Broken:
        def __cuda_stream__(self) -> object:
            return [0, 1]

    with pytest.raises(TypeError, match=r"must return \(version, handle\)"):
        cuda.stream_handle(Broken())  # type: ignore[arg-type]  # a broken protocol on purpose


def test_synchronize_errors(fake: FakeCudaRuntime) -> None:
    fake.fail("cudaStreamSynchronize", 719, times=2)
    with pytest.raises(cuda.CudaError) as info:
        cuda.synchronize(CudaStream(0x5000), device=1)
    assert str(info.value) == (
        "Failed to synchronize CUDA device with id 1: cudaErrorLaunchFailure: "
        "unspecified launch failure"
    )
    assert fake.current == 0
    with pytest.raises(cuda.CudaError, match=r"^Failed to synchronize CUDA stream 0x5000: "):
        cuda.synchronize(0x5000)


# ---------------------------------------------------------------------------------------------
# Pointers, copies, allocations


def test_null_and_empty_pointers_skip_cuda(fake: FakeCudaRuntime) -> None:
    assert cuda.pointer_device(0) is None
    assert cuda.allocation_offset(0, 16, device=1) == 0
    assert cuda.allocation_offset(0x7F00_0000_0040, 0, device=1) == 0
    assert cuda.ipc_export(0, 16, device=1) == (bytes(64), 0)
    assert cuda.ipc_export(0x7F00_0000_0040, 0, device=1) == (bytes(64), 0)
    empty = cuda.ipc_import(bytes(64), 0, 0, device=1)
    assert empty.ptr == 0
    assert empty.closed
    empty.close()
    cuda.memcpy(0x10, 0x20, 0, cuda.MemcpyKind.DEVICE_TO_HOST, device=1)
    assert cuda.malloc(0, device=1) == 0
    cuda.free(0, device=1)
    cuda.ipc_close_mem_handle(0, device=1)
    assert fake.calls == []
    with pytest.raises(ValueError, match="NULL"):
        cuda.ipc_get_mem_handle(0, device=1)


def test_pointer_device(fake: FakeCudaRuntime) -> None:
    with cuda.device_scope(1):
        base = cuda.malloc(64, device=1)
    assert cuda.pointer_device(base + 8) == 1
    assert cuda.pointer_device(0x1234) is None  # host memory CUDA does not know
    fake.fail("cudaPointerGetAttributes", 1)
    with pytest.raises(cuda.CudaError, match="cudaErrorInvalidValue: invalid argument"):
        cuda.pointer_device(base)


def test_allocation_offset(fake: FakeCudaRuntime) -> None:
    base = cuda.malloc(256, device=1)
    fake.take()
    assert cuda.allocation_offset(base + 100, 4, device=1) == 100
    assert fake.take() == [
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),
        ("cuPointerGetAttribute", 11, base + 100),
        ("cuDevicePrimaryCtxGetState", 0),
        ("cudaSetDevice", 0),
    ]
    with pytest.raises(cuda.CudaError) as info:
        cuda.allocation_offset(0x1234, 4, device=1)
    assert str(info.value) == (
        "Failed to get the CUDA pointer range start address. error: "
        "CUDA_ERROR_INVALID_VALUE: invalid argument"
    )


def test_memcpy_round_trip(fake: FakeCudaRuntime) -> None:
    host = np.arange(16, dtype=np.float32)
    back = np.zeros_like(host)
    a = cuda.malloc(host.nbytes, device=1)
    b = cuda.malloc(host.nbytes, device=1)
    fake.take()
    cuda.memcpy(a, host.ctypes.data, host.nbytes, cuda.MemcpyKind.HOST_TO_DEVICE, device=1)
    cuda.memcpy(b, a, host.nbytes, cuda.MemcpyKind.DEVICE_TO_DEVICE, device=1)
    cuda.memcpy(back.ctypes.data, b, host.nbytes, cuda.MemcpyKind.DEVICE_TO_HOST, device=1)
    np.testing.assert_array_equal(back, host)
    copies = [c for c in fake.calls if c[0] in ("cudaMemcpy", "cudaStreamSynchronize")]
    assert [c[0] for c in copies] == [
        "cudaMemcpy",
        "cudaMemcpy",
        "cudaStreamSynchronize",  # device-to-device copies finish before memcpy returns
        "cudaMemcpy",
    ]
    assert copies[2] == ("cudaStreamSynchronize", 0)
    assert fake.current == 0
    cuda.free(a, device=1)
    cuda.free(b, device=1)
    assert fake.allocations == {}


def test_memcpy_and_allocation_errors(fake: FakeCudaRuntime) -> None:
    fake.fail("cudaMemcpy", 1)
    with pytest.raises(cuda.CudaError) as info:
        cuda.memcpy(0x10, 0x20, 4, cuda.MemcpyKind.DEVICE_TO_HOST, device=0)
    assert str(info.value) == "failed to copy data: cudaErrorInvalidValue: invalid argument"
    with pytest.raises(ValueError, match=">= 0"):
        cuda.memcpy(0x10, 0x20, -1, cuda.MemcpyKind.DEVICE_TO_HOST, device=0)
    fake.fail("cudaMalloc", 2)
    with pytest.raises(cuda.CudaError) as info:
        cuda.malloc(1 << 40, device=1)
    assert str(info.value) == (
        f"Failed to allocate {1 << 40} bytes of CUDA memory on device 1. error: "
        "cudaErrorMemoryAllocation: out of memory"
    )
    with pytest.raises(cuda.CudaError, match=r"^Failed to free CUDA memory\. error: "):
        cuda.free(0x1234, device=0)
    assert fake.current == 0


# ---------------------------------------------------------------------------------------------
# CUDA IPC


def test_ipc_export_import_close_sequence(fake: FakeCudaRuntime) -> None:
    base = cuda.malloc(1024, device=1)
    fake.take()
    handle, offset = cuda.ipc_export(base + 64, 128, device=1)
    assert len(handle) == cuda.IPC_HANDLE_SIZE
    assert offset == 64
    assert fake.take() == [
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),
        ("cuPointerGetAttribute", 11, base + 64),
        ("cudaIpcGetMemHandle", base),  # the handle names the allocation, not the pointer
        ("cuDevicePrimaryCtxGetState", 0),
        ("cudaSetDevice", 0),
    ]

    mapping = cuda.ipc_import(bytearray(handle), offset, 128, device=1)
    calls = fake.take()
    assert calls[:2] == [("cudaGetDevice",), ("cudaSetDevice", 1)]
    assert calls[2] == ("cudaIpcOpenMemHandle", handle, 1)  # cudaIpcMemLazyEnablePeerAccess
    assert mapping.ptr == mapping.base + 64
    assert fake.ipc_open == {mapping.base: 1}
    assert repr(mapping).startswith("<IpcMapping open device=1")  # so not .closed

    mapping.close()
    calls = fake.take()
    assert ("cudaIpcCloseMemHandle", mapping.base) in calls
    assert calls[1] == ("cudaSetDevice", 1)
    assert mapping.closed
    assert fake.ipc_open == {}
    mapping.close()  # idempotent
    assert fake.take() == []


def test_ipc_mapping_closes_when_collected(fake: FakeCudaRuntime) -> None:
    base = cuda.malloc(16, device=0)
    handle, offset = cuda.ipc_export(base, 16, device=0)
    with cuda.ipc_import(handle, offset, 16, device=0) as mapping:
        assert fake.ipc_open
    assert mapping.closed
    mapping = cuda.ipc_import(handle, offset, 16, device=0)
    mapped = mapping.base
    del mapping
    gc.collect()
    assert fake.ipc_open == {}
    assert ("cudaIpcCloseMemHandle", mapped) in fake.calls


def test_ipc_mapping_closes_through_its_own_runtime(fake: FakeCudaRuntime) -> None:
    base = cuda.malloc(16, device=0)
    mapping = cuda.ipc_import(*cuda.ipc_export(base, 16, device=0), 16, device=0)
    other = FakeCudaRuntime()
    previous = cuda.set_runtime(other)
    try:
        mapping.close()
    finally:
        cuda.set_runtime(previous)
    assert fake.ipc_open == {}
    assert other.calls == []


def test_ipc_raw_calls_and_errors(fake: FakeCudaRuntime) -> None:
    base = cuda.malloc(32, device=1)
    handle = cuda.ipc_get_mem_handle(base, device=1)
    opened = cuda.ipc_open_mem_handle(memoryview(handle), device=1)
    again = cuda.ipc_open_mem_handle(handle, device=1)
    assert opened == again
    cuda.ipc_close_mem_handle(opened, device=1)
    cuda.ipc_close_mem_handle(again, device=1)
    assert fake.ipc_open == {}

    with pytest.raises(cuda.CudaError) as info:
        cuda.ipc_open_mem_handle(bytes(64), device=1)
    assert str(info.value) == (
        "Failed to open the cudaIpcHandle. error: cudaErrorMapBufferObjectFailed: "
        "mapping of buffer object failed"
    )
    assert fake.current == 0
    with pytest.raises(cuda.CudaError, match=r"^Failed to get the cudaIpcHandle\. error: "):
        cuda.ipc_get_mem_handle(0x1234, device=1)
    with pytest.raises(cuda.CudaError, match=r"^Failed to close the cudaIpcHandle\. error: "):
        cuda.ipc_close_mem_handle(0x1234, device=1)
    with pytest.raises(ValueError, match="64 bytes"):
        cuda.ipc_open_mem_handle(b"short", device=1)
    with pytest.raises(ValueError, match="64 bytes"):
        cuda.ipc_import(b"short", 0, 4, device=1)
    with pytest.raises(ValueError, match="offset"):
        cuda.ipc_import(handle, -1, 4, device=1)


# ---------------------------------------------------------------------------------------------
# Helpers the Tensor uses: host copies, owned device buffers, the whole GPU import


def test_copy_device_to_host(fake: FakeCudaRuntime) -> None:
    source = np.arange(12, dtype=np.int32).reshape(3, 4)
    ptr = cuda.malloc(source.nbytes, device=1)
    cuda.memcpy(ptr, source.ctypes.data, source.nbytes, cuda.MemcpyKind.HOST_TO_DEVICE, device=1)
    out = np.empty_like(source)
    cuda.copy_device_to_host(out, ptr, device=1)
    np.testing.assert_array_equal(out, source)
    raw = bytearray(8)
    cuda.copy_device_to_host(raw, ptr + 4, device=1)
    assert bytes(raw) == source.tobytes()[4:12]
    fake.take()
    cuda.copy_device_to_host(np.empty(0, np.float32), ptr, device=1)
    assert fake.calls == []
    with pytest.raises(ValueError, match="writable C-contiguous"):
        cuda.copy_device_to_host(out.T, ptr, device=1)
    with pytest.raises(ValueError, match="writable C-contiguous"):
        cuda.copy_device_to_host(b"readonly", ptr, device=1)
    with pytest.raises(TypeError):
        cuda.copy_device_to_host(42, ptr, device=1)


def test_device_buffer_and_device_copy(fake: FakeCudaRuntime) -> None:
    host = np.arange(8, dtype=np.float64)
    src = cuda.malloc(host.nbytes, device=1)
    cuda.memcpy(src, host.ctypes.data, host.nbytes, cuda.MemcpyKind.HOST_TO_DEVICE, device=1)
    copy = cuda.device_copy(src, host.nbytes, device=1)
    assert copy.ptr != src
    assert fake.allocations[copy.ptr][0] == 1  # allocated on the tensor's device
    back = np.empty_like(host)
    cuda.copy_device_to_host(back, copy.ptr, device=1)
    np.testing.assert_array_equal(back, host)
    assert repr(copy).startswith("<DeviceBuffer live device=1")
    copy.free()
    copy.free()  # idempotent
    assert repr(copy).startswith("<DeviceBuffer freed")
    assert set(fake.allocations) == {src}

    with cuda.DeviceBuffer(16, device=0) as buffer:
        assert buffer.ptr in fake.allocations
    assert set(fake.allocations) == {src}
    collected = cuda.DeviceBuffer(16, device=0)
    address = collected.ptr
    del collected
    gc.collect()
    assert address not in fake.allocations

    fake.take()
    empty = cuda.device_copy(src, 0, device=1)
    assert empty.ptr == 0
    empty.free()
    assert fake.calls == []

    fake.fail("cudaMemcpy", 1)
    with pytest.raises(cuda.CudaError, match="failed to copy data"):
        cuda.device_copy(src, host.nbytes, device=1)
    assert set(fake.allocations) == {src}  # the failed copy's buffer was freed


class RecordingProducer:
    """Wraps a numpy array as if it were a GPU producer that records the stream it gets."""

    def __init__(self, fake: FakeCudaRuntime, error: BaseException | None = None) -> None:
        self.fake = fake
        self.error = error
        self.array = np.arange(6, dtype=np.float32)

    def __dlpack__(self, *, stream: int | None = None, **kwargs: object) -> object:
        self.fake.calls.append(("producer.__dlpack__", stream, self.fake.current))
        if self.error is not None:
            raise self.error
        return self.array.__dlpack__(**kwargs)  # type: ignore[arg-type]  # numpy's kwargs

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 1)


def test_import_from_producer_sequence(fake: FakeCudaRuntime) -> None:
    producer = RecordingProducer(fake)
    checked: list[object] = []
    tensor = cuda.import_from_producer(producer, 1, checked.append)
    assert checked == [tensor]
    stream = cuda.proxy_stream(1)
    assert fake.take() == [
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),
        ("cudaStreamCreate",),
        ("producer.__dlpack__", stream, 1),  # the tensor's device is current, its stream given
        ("cudaStreamSynchronize", stream),
        ("cuDevicePrimaryCtxGetState", 0),
        ("cudaSetDevice", 0),
    ]
    assert fake.current == 0
    del tensor


def test_import_from_producer_refusal_skips_sync(fake: FakeCudaRuntime) -> None:
    producer = RecordingProducer(fake, BufferError("cannot export"))
    with pytest.raises(BufferError, match="cannot export"):
        cuda.import_from_producer(producer, 1)
    assert "cudaStreamSynchronize" not in fake.names()
    assert fake.current == 0
