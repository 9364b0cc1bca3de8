"""The raw CUDA layer under :mod:`pb_tensor.cuda`: its errors, the :class:`CudaRuntime`
protocol (what the facade calls, integers at the boundary) and the default implementation over
cuda-python (``cuda.bindings``), which is imported only when that implementation is built.

Private: import these names from :mod:`pb_tensor.cuda`.
"""

from __future__ import annotations

import ctypes
import threading
from enum import IntEnum
from typing import Final, Protocol, SupportsInt

from pb_tensor._hints import install_hint
from pb_tensor.errors import TritonModelException

#: Size of a ``cudaIpcMemHandle_t`` in bytes.
IPC_HANDLE_SIZE: Final = 64

SUCCESS: Final = 0
# cudaIpcMemLazyEnablePeerAccess and CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: fixed by the CUDA
# headers; kept here so the facade (and fakes) need no cuda-python to name them.
_IPC_LAZY_ENABLE_PEER_ACCESS: Final = 1
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: Final = 11
_MEMORY_TYPE_UNREGISTERED: Final = 0
_NOT_INSTALLED: Final = (
    "CUDA is not available: cuda-python is not installed "
    f"({install_hint('cuda', 'cuda-python')})"
)


class CudaError(TritonModelException):
    """A CUDA call failed, or CUDA cannot be used at all.

    ``code`` and ``error_name`` are CUDA's (``cudaError_t`` or ``CUresult``), or None when no
    CUDA call was made (cuda-python missing).
    """

    def __init__(self, message: str, code: int | None = None, error_name: str | None = None):
        super().__init__(message)
        self.code = code
        self.error_name = error_name


class CudaUnavailableError(CudaError):
    """CUDA cannot be used in this process: no cuda-python, no driver, or no device.

    ``cause`` is one short sentence saying which (for tables and logs); the message adds CUDA's
    own error name and text where a CUDA call reported the problem.
    """

    def __init__(self, message: str, code: int | None = None, error_name: str | None = None,
                 *, cause: str | None = None):
        super().__init__(message, code, error_name)
        self.cause = cause if cause is not None else message


class CudaRuntime(Protocol):
    """The raw CUDA calls the facade makes, with integers at the boundary.

    Each method mirrors the CUDA function it is named after and returns cuda-python's
    ``(error_code, value...)`` tuple with plain ints/bytes; values are unspecified when the code
    is not 0. Methods may also raise :class:`~pb_tensor.errors.TritonModelException` (the
    default implementation does when the driver library cannot be loaded). Names starting with
    ``cu`` are driver-API calls whose codes are ``CUresult`` values.
    """

    def cudaGetErrorName(self, error: int) -> tuple[int, bytes]: ...
    def cudaGetErrorString(self, error: int) -> tuple[int, bytes]: ...
    def cudaGetDeviceCount(self) -> tuple[int, int]: ...
    def cudaGetDevice(self) -> tuple[int, int]: ...
    def cudaSetDevice(self, device: int) -> tuple[int]: ...
    def cudaStreamCreate(self) -> tuple[int, int]: ...
    def cudaStreamDestroy(self, stream: int) -> tuple[int]: ...
    def cudaStreamSynchronize(self, stream: int) -> tuple[int]: ...
    def cudaPointerGetAttributes(self, ptr: int) -> tuple[int, int, int]:
        """``(error, memory_type, device)``."""
        ...

    def cudaMalloc(self, size: int) -> tuple[int, int]: ...
    def cudaFree(self, ptr: int) -> tuple[int]: ...
    def cudaMemcpy(self, dst: int, src: int, count: int, kind: int) -> tuple[int]: ...
    def cudaIpcGetMemHandle(self, ptr: int) -> tuple[int, bytes]: ...
    def cudaIpcOpenMemHandle(self, handle: bytes, flags: int) -> tuple[int, int]: ...
    def cudaIpcCloseMemHandle(self, ptr: int) -> tuple[int]: ...
    def cuGetErrorName(self, error: int) -> tuple[int, bytes]: ...
    def cuGetErrorString(self, error: int) -> tuple[int, bytes]: ...
    def cuDevicePrimaryCtxGetState(self, device: int) -> tuple[int, int, int]:
        """``(error, flags, active)`` for the device with this runtime ordinal."""
        ...

    def cuPointerGetAttribute(self, attribute: int, ptr: int) -> tuple[int, int]: ...


class MemcpyKind(IntEnum):
    """Direction of :func:`memcpy` (the values of ``cudaMemcpyKind``)."""

    HOST_TO_HOST = 0
    HOST_TO_DEVICE = 1
    DEVICE_TO_HOST = 2
    DEVICE_TO_DEVICE = 3
    DEFAULT = 4


# --------------------------------------------------------------------------------------------
# The default runtime: cuda-python, imported on first use.


def _int(value: SupportsInt | None) -> int:
    return 0 if value is None else int(value)


class _CudaPythonRuntime:
    """:class:`CudaRuntime` over ``cuda.bindings``; importing it is deferred to construction."""

    def __init__(self) -> None:
        # Raises ImportError when cuda-python is missing; the caller turns that into the
        # CudaUnavailableError every entry point reports.
        import cuda.bindings.runtime  # noqa: F401

        self._driver_lock = threading.Lock()
        self._driver_ready = False

    def after_fork_in_child(self) -> None:
        """Forget the parent's driver state and lock (called in a forked child)."""
        self._driver_lock = threading.Lock()
        self._driver_ready = False

    # Each method re-imports its module: after the first import that is a sys.modules lookup,
    # and it keeps every call typed by the stubs in typings/ (a module cannot be an attribute
    # type).

    def cudaGetErrorName(self, error: int) -> tuple[int, bytes]:
        from cuda.bindings import runtime

        err, name = runtime.cudaGetErrorName(error)
        return int(err), name

    def cudaGetErrorString(self, error: int) -> tuple[int, bytes]:
        from cuda.bindings import runtime

        err, text = runtime.cudaGetErrorString(error)
        return int(err), text

    def cudaGetDeviceCount(self) -> tuple[int, int]:
        from cuda.bindings import runtime

        err, count = runtime.cudaGetDeviceCount()
        return int(err), _int(count)

    def cudaGetDevice(self) -> tuple[int, int]:
        from cuda.bindings import runtime

        err, device = runtime.cudaGetDevice()
        return int(err), _int(device)

    def cudaSetDevice(self, device: int) -> tuple[int]:
        from cuda.bindings import runtime

        return (int(runtime.cudaSetDevice(device)[0]),)

    def cudaStreamCreate(self) -> tuple[int, int]:
        from cuda.bindings import runtime

        err, stream = runtime.cudaStreamCreate()
        return int(err), _int(stream)

    def cudaStreamDestroy(self, stream: int) -> tuple[int]:
        from cuda.bindings import runtime

        return (int(runtime.cudaStreamDestroy(stream)[0]),)

    def cudaStreamSynchronize(self, stream: int) -> tuple[int]:
        from cuda.bindings import runtime

        return (int(runtime.cudaStreamSynchronize(stream)[0]),)

    def cudaPointerGetAttributes(self, ptr: int) -> tuple[int, int, int]:
        from cuda.bindings import runtime

        err, attributes = runtime.cudaPointerGetAttributes(ptr)
        if attributes is None:
            return int(err), _MEMORY_TYPE_UNREGISTERED, -1
        return int(err), int(attributes.type), int(attributes.device)

    def cudaMalloc(self, size: int) -> tuple[int, int]:
        from cuda.bindings import runtime

        err, ptr = runtime.cudaMalloc(size)
        return int(err), _int(ptr)

    def cudaFree(self, ptr: int) -> tuple[int]:
        from cuda.bindings import runtime

        return (int(runtime.cudaFree(ptr)[0]),)

    def cudaMemcpy(self, dst: int, src: int, count: int, kind: int) -> tuple[int]:
        from cuda.bindings import runtime

        return (int(runtime.cudaMemcpy(dst, src, count, runtime.cudaMemcpyKind(kind))[0]),)

    def cudaIpcGetMemHandle(self, ptr: int) -> tuple[int, bytes]:
        from cuda.bindings import runtime

        err, handle = runtime.cudaIpcGetMemHandle(ptr)
        if handle is None:
            return int(err), b""
        # cuda-bindings 13 exposes the handle's bytes only through its address.
        return int(err), ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)

    def cudaIpcOpenMemHandle(self, handle: bytes, flags: int) -> tuple[int, int]:
        from cuda.bindings import runtime

        native = runtime.cudaIpcMemHandle_t()
        ctypes.memmove(native.getPtr(), handle, IPC_HANDLE_SIZE)
        err, ptr = runtime.cudaIpcOpenMemHandle(native, flags)
        return int(err), _int(ptr)

    def cudaIpcCloseMemHandle(self, ptr: int) -> tuple[int]:
        from cuda.bindings import runtime

        return (int(runtime.cudaIpcCloseMemHandle(ptr)[0]),)

    def _driver_init(self) -> int:
        """Load libcuda and ``cuInit`` once; raise CudaUnavailableError when it cannot load."""
        if self._driver_ready:
            return SUCCESS
        try:
            from cuda.bindings import driver

            with self._driver_lock:
                (err,) = driver.cuInit(0)
        except RuntimeError as exc:  # cuda.pathfinder.DynamicLibNotFoundError
            raise CudaUnavailableError(
                f"CUDA is not available: the CUDA driver library cannot be loaded: {exc}"
            ) from exc
        self._driver_ready = int(err) == SUCCESS
        return int(err)

    def cuGetErrorName(self, error: int) -> tuple[int, bytes]:
        from cuda.bindings import driver

        try:
            err, name = driver.cuGetErrorName(driver.CUresult(error))
        except (ValueError, RuntimeError):  # a code cuda-python does not know
            return 1, b""
        return int(err), name or b""

    def cuGetErrorString(self, error: int) -> tuple[int, bytes]:
        from cuda.bindings import driver

        try:
            err, text = driver.cuGetErrorString(driver.CUresult(error))
        except (ValueError, RuntimeError):
            return 1, b""
        return int(err), text or b""

    def cuDevicePrimaryCtxGetState(self, device: int) -> tuple[int, int, int]:
        err = self._driver_init()
        if err != SUCCESS:
            return err, 0, 0
        from cuda.bindings import driver

        err_get, handle = driver.cuDeviceGet(device)
        if int(err_get) != SUCCESS or handle is None:
            return int(err_get), 0, 0
        err_state, flags, active = driver.cuDevicePrimaryCtxGetState(handle)
        return int(err_state), _int(flags), _int(active)

    def cuPointerGetAttribute(self, attribute: int, ptr: int) -> tuple[int, int]:
        err = self._driver_init()
        if err != SUCCESS:
            return err, 0
        from cuda.bindings import driver

        err, value = driver.cuPointerGetAttribute(driver.CUpointer_attribute(attribute), ptr)
        return int(err), _int(value)


# Public names are documented as pb_tensor.cuda's.
for _cls in (CudaError, CudaUnavailableError, CudaRuntime, MemcpyKind):
    _cls.__module__ = "pb_tensor.cuda"
del _cls
