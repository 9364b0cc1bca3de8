"""A recording fake of :class:`pb_tensor.cuda.CudaRuntime`, for testing the facade without a GPU.

It models what the facade relies on: a current device per thread, primary contexts that become
active when a device is set, streams that remember the device they were created on, device
allocations backed by ``bytearray`` (so copies can be checked), and IPC handles that name an
allocation. Every call is appended to :attr:`FakeCudaRuntime.calls` as ``(name, *args)``.
Errors are injected with :meth:`FakeCudaRuntime.fail`.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

# cudaError_t / CUresult names and strings as CUDA spells them (the subset the tests use).
RUNTIME_ERRORS: dict[int, tuple[str, str]] = {
    0: ("cudaSuccess", "no error"),
    1: ("cudaErrorInvalidValue", "invalid argument"),
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    35: (
        "cudaErrorInsufficientDriver",
        "CUDA driver version is insufficient for CUDA runtime version",
    ),
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    205: ("cudaErrorMapBufferObjectFailed", "mapping of buffer object failed"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    719: ("cudaErrorLaunchFailure", "unspecified launch failure"),
}
DRIVER_ERRORS: dict[int, tuple[str, str]] = {
    0: ("CUDA_SUCCESS", "no error"),
    1: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    3: ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
    201: ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
}

INSUFFICIENT_DRIVER = 35
_IPC_MAGIC = b"FAKEIPC\0"
_ALLOC_BASE = 0x7F00_0000_0000
_MAP_DELTA = 0x0100_0000_0000  # opened IPC mappings live at allocation base + this


class FakeCudaRuntime:
    """Records calls; ``devices`` GPUs, ``current`` the initial device of every thread,
    ``active`` the devices whose primary context is already active. ``no_driver=True`` makes
    every call fail with cudaErrorInsufficientDriver, as cuda-python does without a driver."""

    def __init__(
        self,
        devices: int = 2,
        *,
        current: int = 0,
        active: tuple[int, ...] = (0,),
        no_driver: bool = False,
        on_destroy: Callable[[int], None] | None = None,
    ) -> None:
        self.devices = devices
        self.initial_device = current
        self.active = set(active)
        self.no_driver = no_driver
        self.on_destroy = on_destroy
        self.calls: list[tuple[Any, ...]] = []
        self.failures: dict[str, list[int]] = {}
        self.raises: dict[str, BaseException] = {}
        self.streams: dict[int, int] = {}  # handle -> device it was created on
        self.destroyed: list[int] = []
        self.allocations: dict[int, tuple[int, bytearray]] = {}  # base -> (device, data)
        self.ipc_open: dict[int, int] = {}  # mapped base -> open count
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._next_stream = 0x5000
        self._next_alloc = _ALLOC_BASE

    # -- test helpers ------------------------------------------------------------------------

    def fail(self, method: str, code: int, times: int = 1) -> None:
        """Make the next ``times`` calls of ``method`` return error ``code``."""
        self.failures.setdefault(method, []).extend([code] * times)

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]

    def take(self) -> list[tuple[Any, ...]]:
        """The calls recorded so far; clears the record."""
        calls, self.calls = self.calls, []
        return calls

    @property
    def current(self) -> int:
        return int(getattr(self._tls, "device", self.initial_device))

    @current.setter
    def current(self, device: int) -> None:
        self._tls.device = device

    def _enter(self, name: str, *args: Any) -> int:
        with self._lock:
            self.calls.append((name, *args))
        if name in self.raises:
            raise self.raises[name]
        queue = self.failures.get(name)
        if queue:
            return queue.pop(0)
        if self.no_driver:
            return INSUFFICIENT_DRIVER
        return 0

    def _find(self, ptr: int) -> tuple[int, int, bytearray] | None:
        """(allocation base, device, data) for a pointer into an allocation or a mapping."""
        for mapped in self.ipc_open:
            base = mapped - _MAP_DELTA
            device, data = self.allocations.get(base, (0, bytearray()))
            if mapped <= ptr < mapped + len(data):
                return mapped, device, data
        for base, (device, data) in self.allocations.items():
            if base <= ptr < base + max(len(data), 1):
                return base, device, data
        return None

    # -- runtime API -------------------------------------------------------------------------

    def cudaGetErrorName(self, error: int) -> tuple[int, bytes]:
        return 0, RUNTIME_ERRORS.get(error, ("cudaErrorUnknown", ""))[0].encode()

    def cudaGetErrorString(self, error: int) -> tuple[int, bytes]:
        return 0, RUNTIME_ERRORS.get(error, ("", "unrecognized error code"))[1].encode()

    def cudaGetDeviceCount(self) -> tuple[int, int]:
        err = self._enter("cudaGetDeviceCount")
        if err == 0 and self.devices == 0:
            err = 100
        return err, self.devices if err == 0 else 0

    def cudaGetDevice(self) -> tuple[int, int]:
        err = self._enter("cudaGetDevice")
        return err, self.current if err == 0 else 0

    def cudaSetDevice(self, device: int) -> tuple[int]:
        err = self._enter("cudaSetDevice", device)
        if err == 0 and not 0 <= device < self.devices:
            err = 101
        if err == 0:
            self.current = device
            self.active.add(device)  # cudaSetDevice initialises the primary context
        return (err,)

    def cudaStreamCreate(self) -> tuple[int, int]:
        err = self._enter("cudaStreamCreate")
        if err:
            return err, 0
        with self._lock:
            handle = self._next_stream
            self._next_stream += 0x10
            self.streams[handle] = self.current
        return 0, handle

    def cudaStreamDestroy(self, stream: int) -> tuple[int]:
        err = self._enter("cudaStreamDestroy", stream)
        self.destroyed.append(stream)
        if self.on_destroy is not None:
            self.on_destroy(stream)
        return (err,)

    def cudaStreamSynchronize(self, stream: int) -> tuple[int]:
        err = self._enter("cudaStreamSynchronize", stream)
        if err == 0 and stream > 2 and stream not in self.streams:
            err = 400
        return (err,)

    def cudaPointerGetAttributes(self, ptr: int) -> tuple[int, int, int]:
        err = self._enter("cudaPointerGetAttributes", ptr)
        found = self._find(ptr)
        if found is None:
            return err, 0, -2  # unregistered host memory
        return err, 2, found[1]

    def cudaMalloc(self, size: int) -> tuple[int, int]:
        err = self._enter("cudaMalloc", size)
        if err:
            return err, 0
        with self._lock:
            base = self._next_alloc
            self._next_alloc += max(size, 1) + 0x10_0000
            self.allocations[base] = (self.current, bytearray(size))
        return 0, base

    def cudaFree(self, ptr: int) -> tuple[int]:
        err = self._enter("cudaFree", ptr)
        if err == 0 and self.allocations.pop(ptr, None) is None:
            err = 1
        return (err,)

    def _device_view(self, ptr: int, count: int) -> memoryview:
        found = self._find(ptr)
        if found is None:
            raise AssertionError(f"fake: {ptr:#x} is not device memory")
        base, _device, data = found
        return memoryview(data)[ptr - base : ptr - base + count]

    def cudaMemcpy(self, dst: int, src: int, count: int, kind: int) -> tuple[int]:
        err = self._enter("cudaMemcpy", dst, src, count, kind)
        if err:
            return (err,)
        src_dev = self._find(src) is not None
        dst_dev = self._find(dst) is not None
        if kind == 1:  # host to device
            self._device_view(dst, count)[:] = ctypes.string_at(src, count)
        elif kind == 2:  # device to host
            ctypes.memmove(dst, bytes(self._device_view(src, count)), count)
        elif kind in (3, 4) and src_dev and dst_dev:
            self._device_view(dst, count)[:] = bytes(self._device_view(src, count))
        else:
            return (1,)
        return (0,)

    def cudaIpcGetMemHandle(self, ptr: int) -> tuple[int, bytes]:
        err = self._enter("cudaIpcGetMemHandle", ptr)
        if err == 0 and ptr not in self.allocations:
            err = 1
        if err:
            return err, b""
        return 0, (_IPC_MAGIC + ptr.to_bytes(8, "little")).ljust(64, b"\0")

    def cudaIpcOpenMemHandle(self, handle: bytes, flags: int) -> tuple[int, int]:
        err = self._enter("cudaIpcOpenMemHandle", handle, flags)
        base = int.from_bytes(handle[8:16], "little")
        if err == 0 and (not handle.startswith(_IPC_MAGIC) or base not in self.allocations):
            err = 205
        if err:
            return err, 0
        mapped = base + _MAP_DELTA
        self.ipc_open[mapped] = self.ipc_open.get(mapped, 0) + 1  # CUDA ref-counts re-opens
        return 0, mapped

    def cudaIpcCloseMemHandle(self, ptr: int) -> tuple[int]:
        err = self._enter("cudaIpcCloseMemHandle", ptr)
        if err == 0:
            if ptr not in self.ipc_open:
                return (1,)
            self.ipc_open[ptr] -= 1
            if self.ipc_open[ptr] == 0:
                del self.ipc_open[ptr]
        return (err,)

    # -- driver API ----------------------------------------------------------------------------

    def cuGetErrorName(self, error: int) -> tuple[int, bytes]:
        return 0, DRIVER_ERRORS.get(error, ("CUDA_ERROR_UNKNOWN", ""))[0].encode()

    def cuGetErrorString(self, error: int) -> tuple[int, bytes]:
        return 0, DRIVER_ERRORS.get(error, ("", "unknown error"))[1].encode()

    def cuDevicePrimaryCtxGetState(self, device: int) -> tuple[int, int, int]:
        err = self._enter("cuDevicePrimaryCtxGetState", device)
        return err, 0, int(device in self.active)

    def cuPointerGetAttribute(self, attribute: int, ptr: int) -> tuple[int, int]:
        err = self._enter("cuPointerGetAttribute", attribute, ptr)
        if err:
            return err, 0
        found = self._find(ptr)
        if attribute != 11 or found is None:
            return 1, 0  # CUDA_ERROR_INVALID_VALUE
        return 0, found[0]


class CudaStream:
    """A minimal object speaking the ``__cuda_stream__`` protocol."""

    def __init__(self, handle: int, version: int = 0) -> None:
        self.handle = handle
        self.version = version

    def __cuda_stream__(self) -> tuple[int, int]:
        return self.version, self.handle


def entry_points(cuda: Any) -> list[tuple[str, Callable[[], object]]]:
    """Every GPU entry point of ``pb_tensor.cuda`` with arguments that need CUDA (non-NULL,
    non-empty), for the "CUDA unavailable" tests."""
    handle = b"\1" * 64

    def enter(manager: Any) -> object:
        with manager:
            return None

    return [
        ("current_device", cuda.current_device),
        ("device_scope", lambda: enter(cuda.device_scope(0))),
        ("proxy_stream", lambda: cuda.proxy_stream(0)),
        ("synchronize", lambda: cuda.synchronize(0x5000)),
        ("synchronize(device)", lambda: cuda.synchronize(0x5000, device=0)),
        ("dlpack_import", lambda: enter(cuda.dlpack_import(0))),
        ("pointer_device", lambda: cuda.pointer_device(0x1000)),
        ("allocation_offset", lambda: cuda.allocation_offset(0x1000, 4, device=0)),
        (
            "memcpy",
            lambda: cuda.memcpy(0x1000, 0x2000, 4, cuda.MemcpyKind.DEVICE_TO_DEVICE, device=0),
        ),
        ("malloc", lambda: cuda.malloc(16, device=0)),
        ("free", lambda: cuda.free(0x1000, device=0)),
        ("ipc_get_mem_handle", lambda: cuda.ipc_get_mem_handle(0x1000, device=0)),
        ("ipc_open_mem_handle", lambda: cuda.ipc_open_mem_handle(handle, device=0)),
        ("ipc_close_mem_handle", lambda: cuda.ipc_close_mem_handle(0x1000, device=0)),
        ("ipc_export", lambda: cuda.ipc_export(0x1000, 4, device=0)),
        ("ipc_import", lambda: cuda.ipc_import(handle, 0, 4, device=0)),
    ]
