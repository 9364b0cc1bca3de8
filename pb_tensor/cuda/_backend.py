"""Backend state of :mod:`pb_tensor.cuda`: the installed runtime and its caches, CUDA error
formatting, the availability probes and the device scope.

Private: import these names from :mod:`pb_tensor.cuda`.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import TYPE_CHECKING, Final

from pb_tensor.cuda._runtime import (
    _NOT_INSTALLED,
    SUCCESS,
    CudaError,
    CudaRuntime,
    CudaUnavailableError,
    _CudaPythonRuntime,
)
from pb_tensor.errors import TritonModelException

if TYPE_CHECKING:
    from types import TracebackType


# --------------------------------------------------------------------------------------------
# Backend state: a runtime plus what the facade caches for it.


class Backend:
    __slots__ = (
        "__weakref__",
        "atexit_registered",
        "confirmed",
        "lock",
        "pid",
        "runtime",
        "streams",
    )

    def __init__(self, runtime: CudaRuntime) -> None:
        self.runtime = runtime
        self.lock = threading.Lock()
        self.streams: dict[int, int] = {}  # device -> proxy stream handle
        self.pid = os.getpid()
        self.confirmed = False  # a device was seen: skip the availability probe
        self.atexit_registered = False
        _BACKENDS.add(self)

    def check_fork(self) -> None:
        # A forked child inherits handles that mean nothing in its own CUDA context.
        pid = os.getpid()
        if pid != self.pid:
            with self.lock:
                self.streams.clear()
                self.pid = pid


_lock = threading.Lock()
_BACKENDS: weakref.WeakSet[Backend] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A lock held by another thread at fork() stays held forever in the child (that thread does
    # not exist there), and the parent's stream handles mean nothing in the child's context:
    # start the child with fresh locks and empty caches.
    global _lock
    _lock = threading.Lock()
    pid = os.getpid()
    for backend in list(_BACKENDS):
        backend.lock = threading.Lock()
        backend.streams.clear()
        backend.pid = pid
        reinit = getattr(backend.runtime, "after_fork_in_child", None)
        if reinit is not None:
            reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_custom: Backend | None = None  # installed by set_runtime
_default: Backend | None = None  # cuda-python, created on first use
_default_failure: CudaUnavailableError | None = None  # why cuda-python could not be imported


def set_runtime(runtime: CudaRuntime | None) -> CudaRuntime | None:
    """Install ``runtime`` as the raw CUDA layer (None: back to cuda-python); return the
    previously installed one (None when it was cuda-python), so ``set_runtime(previous)``
    undoes the call.

    The new runtime starts with its own empty proxy-stream cache; cuda-python's cache survives
    the swap. Meant for tests. Raises nothing.
    """
    global _custom
    with _lock:
        previous = _custom.runtime if _custom is not None else None
        _custom = Backend(runtime) if runtime is not None else None
    return previous


def active_backend() -> Backend:
    backend = _custom or _default
    if backend is not None:
        return backend
    return _load_default()


def _load_default() -> Backend:
    global _default, _default_failure
    with _lock:
        if _default is None and _default_failure is None:
            try:
                _default = Backend(_CudaPythonRuntime())
            except ImportError as exc:
                _default_failure = CudaUnavailableError(
                    f"{_NOT_INSTALLED}: {exc}", cause="cuda-python is not installed"
                )
            except Exception as exc:  # a broken install must not crash CPU-only users
                _default_failure = CudaUnavailableError(
                    f"CUDA is not available: cuda-python cannot be imported: {exc}",
                    cause="cuda-python cannot be imported",
                )
        if _default is None:
            failure = _default_failure
            if failure is None:  # unreachable: the lock block sets one of the two
                raise CudaUnavailableError("CUDA is not available")
            raise CudaUnavailableError(str(failure), cause=failure.cause)
        return _default


def _describe(backend: Backend, code: int, *, driver: bool) -> tuple[str, str]:
    runtime = backend.runtime
    name = text = b""
    try:
        name_err, name = (runtime.cuGetErrorName if driver else runtime.cudaGetErrorName)(code)
        text_err, text = (runtime.cuGetErrorString if driver else runtime.cudaGetErrorString)(code)
    except TritonModelException:
        name_err = text_err = 1
    if name_err != SUCCESS or not name:
        name = f"{'CUresult' if driver else 'cudaError_t'} {code}".encode()
    if text_err != SUCCESS or not text:
        text = b"unknown error"
    return name.decode("utf-8", "replace"), text.decode("utf-8", "replace")


def cuda_error(backend: Backend, code: int, prefix: str, *, driver: bool = False) -> CudaError:
    """``CudaError("<prefix> <name>: <string>")`` for a failed call's code."""
    name, text = _describe(backend, code, driver=driver)
    return CudaError(f"{prefix} {name}: {text}", code, name)


_NO_DEVICE: Final = 100  # cudaErrorNoDevice
_INSUFFICIENT_DRIVER: Final = 35  # cudaErrorInsufficientDriver: also what "no libcuda" reports


def driver_library_present() -> bool:
    """Whether the CUDA driver library (``libcuda.so.1``) can be loaded. Never raises.

    cuda-python reports a missing driver and a too-old one with the same error code; this tells
    them apart."""
    global _driver_present
    if _driver_present is None:
        try:
            ctypes.CDLL("libcuda.so.1")
            _driver_present = True
        except OSError:
            _driver_present = False
    return _driver_present


_driver_present: bool | None = None


def _cause(code: int) -> str:
    if code == _NO_DEVICE:
        return "no CUDA device is visible to this process"
    if code == _INSUFFICIENT_DRIVER:
        if not driver_library_present():
            return "no CUDA driver is installed (libcuda.so.1 cannot be loaded)"
        return "the CUDA driver is too old for this cuda-python"
    return "the CUDA driver cannot be initialised"


def _probe(backend: Backend) -> CudaUnavailableError | None:
    err, count = backend.runtime.cudaGetDeviceCount()
    if err != SUCCESS:
        name, text = _describe(backend, err, driver=False)
        cause = _cause(err)
        return CudaUnavailableError(
            f"CUDA is not available: {cause} ({name}: {text})", err, name, cause=cause
        )
    if count <= 0:
        cause = "no CUDA device is visible to this process"
        return CudaUnavailableError(f"CUDA is not available: {cause}", cause=cause)
    backend.confirmed = True
    return None


def require_backend() -> Backend:
    """The backend, once CUDA is known to have a device; else raise CudaUnavailableError."""
    backend = active_backend()
    if not backend.confirmed:
        failure = _probe(backend)
        if failure is not None:
            raise failure
    return backend


# --------------------------------------------------------------------------------------------
# Probes (never raise).


def unavailable_reason(*, short: bool = False) -> str | None:
    """Why GPU entry points would raise :class:`CudaUnavailableError`, or None when CUDA has a
    device. ``short=True`` gives one short sentence (no CUDA error text). Never raises."""
    try:
        backend = active_backend()
    except CudaUnavailableError as exc:
        return exc.cause if short else str(exc)
    failure = None if backend.confirmed else _probe(backend)
    if failure is None:
        return None
    return failure.cause if short else str(failure)


def device_count() -> int:
    """Number of CUDA devices visible to this process; 0 without cuda-python, driver or device.
    Never raises."""
    try:
        backend = active_backend()
    except CudaUnavailableError:
        return 0
    err, count = backend.runtime.cudaGetDeviceCount()
    if err != SUCCESS or count <= 0:
        return 0
    backend.confirmed = True
    return count


def is_available() -> bool:
    """True when cuda-python, a driver and at least one device are present. Never raises."""
    return device_count() > 0


# --------------------------------------------------------------------------------------------
# Devices.


def _current_device(backend: Backend) -> int:
    err, device = backend.runtime.cudaGetDevice()
    if err != SUCCESS:
        raise cuda_error(backend, err, "Failed to get current CUDA device id. error:")
    return device


def _set_device(backend: Backend, device: int) -> None:
    (err,) = backend.runtime.cudaSetDevice(device)
    if err != SUCCESS:
        raise cuda_error(backend, err, f"Failed to set the CUDA device to {device}. error:")


def _primary_context_active(backend: Backend, device: int) -> bool:
    try:
        err, _flags, active = backend.runtime.cuDevicePrimaryCtxGetState(device)
    except CudaUnavailableError:
        return True  # cannot tell: restoring is the choice that keeps the caller's device
    if err != SUCCESS:
        raise cuda_error(backend, err, "failed to get primary context state:", driver=True)
    return active != 0


def current_device() -> int:
    """The calling thread's current CUDA device.

    Raises:
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: ``cudaGetDevice`` failed ("Failed to get current CUDA device id. ...").
    """
    return _current_device(require_backend())


class DeviceScope:
    """Context manager making ``device`` current for the block (see the module docstring for
    when the previous device is restored). ``__enter__`` returns the previous device.

    Single use; nest new instances. Raises :class:`CudaUnavailableError` or :class:`CudaError`
    on enter when the device cannot be read or set, and on exit when restoring fails (unless
    the block itself raised: then its exception is kept and the restore failure dropped).
    """

    __slots__ = ("_backend", "_device", "_previous", "_switched")

    def __init__(self, device: int) -> None:
        self._device = device
        self._previous = device
        self._switched = False
        self._backend: Backend | None = None

    @classmethod
    def _on(cls, backend: Backend, device: int) -> DeviceScope:
        """A scope bound to ``backend`` rather than to the runtime installed at enter."""
        scope = cls(device)
        scope._backend = backend
        return scope

    def __enter__(self) -> int:
        self._enter()
        return self._previous

    def _enter(self) -> Backend:
        backend = self._backend = self._backend or require_backend()
        self._previous = _current_device(backend)
        if self._previous != self._device:
            _set_device(backend, self._device)
            self._switched = True
        return backend

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._restore(quiet=exc_type is not None)

    def _restore(self, *, quiet: bool) -> None:
        if not self._switched or self._backend is None:
            return
        self._switched = False
        try:
            if _primary_context_active(self._backend, self._previous):
                _set_device(self._backend, self._previous)
        except TritonModelException:
            if not quiet:
                raise


def device_scope(device: int) -> DeviceScope:
    """``with device_scope(d) as previous:`` runs the block with device ``d`` current.

    Raises what :class:`DeviceScope` raises.
    """
    return DeviceScope(device)


DeviceScope.__module__ = "pb_tensor.cuda"
