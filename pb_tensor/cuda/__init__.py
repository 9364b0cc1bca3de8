"""Typed facade over cuda-python: everything pb_tensor does on a GPU goes through here.

Importing this module never imports ``cuda``; cuda-python (``cuda.bindings.runtime``, and
``cuda.bindings.driver`` for two facts the runtime API cannot give) is imported by the first
GPU entry point. Without cuda-python, without a driver or without a device, every entry point
raises :class:`CudaUnavailableError` (a :class:`~pb_tensor.errors.TritonModelException`) that
says which of these is missing; the probes :func:`is_available`, :func:`device_count` and
:func:`unavailable_reason` never raise.

Every CUDA failure raises :class:`CudaError` whose message keeps python_backend's prefix where
it has one and ends with CUDA's error name and string.

Choices made here:

* **Device scope** (:func:`device_scope`) switches only when the device differs, and on exit
  switches back only if the previous device's primary context is active, as python_backend's
  ``ScopedSetDevice`` does. ``cudaSetDevice`` creates a primary context (hundreds of MiB of
  device memory) on a device nobody in the process has used yet; restoring to such a device
  would cost that for nothing, so the tensor's device stays current instead. When the driver
  library cannot be asked, the scope restores unconditionally.
* **Proxy streams** (:func:`proxy_stream`) are blocking streams (``cudaStreamCreate``) created
  the first time a device needs one, *while that device is current*, and cached under that
  device. python_backend keys them by the caller's device, so after a cross-device import the
  cache entry for device 0 can be a device-1 stream; keying by the tensor's device fixes that.
  They are destroyed at interpreter exit (failures ignored) and forgotten after ``fork``.
* **IPC** uses the legacy ``cudaIpc*MemHandle`` calls as python_backend does: a 64-byte
  handle names a whole allocation, so :func:`ipc_export` also returns the pointer's offset in
  it, and :class:`IpcMapping` closes what :func:`ipc_import` opened (CUDA reference-counts
  repeated opens of one handle in a process).
* **Empty tensors** never reach CUDA: NULL pointers and 0-byte ranges are answered without a
  CUDA call (python_backend fixed the same crash in server#4865).

Tests replace the raw layer with :func:`set_runtime`; see :class:`CudaRuntime`.

Layout: this module holds the streams and the DLPack import and re-exports the rest, which lives
in private modules: ``_runtime`` (errors, the :class:`CudaRuntime` protocol and the
cuda-python adapter), ``_backend`` (installed runtime, probes, device scope) and
``_mem`` (pointers, copies, device buffers, IPC).
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import TYPE_CHECKING, Protocol, TypeAlias

from pb_tensor.cuda._backend import (
    Backend,
    DeviceScope,
    active_backend,
    cuda_error,
    current_device,
    device_count,
    device_scope,
    is_available,
    require_backend,
    set_runtime,
    unavailable_reason,
)
from pb_tensor.cuda._mem import (
    DeviceBuffer,
    IpcMapping,
    allocation_offset,
    copy_device_to_host,
    device_copy,
    free,
    ipc_close_mem_handle,
    ipc_export,
    ipc_get_mem_handle,
    ipc_import,
    ipc_open_mem_handle,
    malloc,
    memcpy,
    pointer_device,
)
from pb_tensor.cuda._runtime import (
    IPC_HANDLE_SIZE,
    SUCCESS,
    CudaError,
    CudaRuntime,
    CudaUnavailableError,
    MemcpyKind,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from dlpack_ctypes import DLPackTensor

__all__ = [
    "CudaError",
    "CudaRuntime",
    "CudaUnavailableError",
    "DeviceBuffer",
    "DeviceScope",
    "DlpackImport",
    "IPC_HANDLE_SIZE",
    "IpcMapping",
    "MemcpyKind",
    "StreamLike",
    "SupportsCudaStream",
    "allocation_offset",
    "copy_device_to_host",
    "current_device",
    "device_copy",
    "device_count",
    "device_scope",
    "dlpack_import",
    "free",
    "import_from_producer",
    "ipc_close_mem_handle",
    "ipc_export",
    "ipc_get_mem_handle",
    "ipc_import",
    "ipc_open_mem_handle",
    "is_available",
    "malloc",
    "memcpy",
    "pointer_device",
    "proxy_stream",
    "release_proxy_streams",
    "set_runtime",
    "stream_handle",
    "synchronize",
    "unavailable_reason",
]

_log = logging.getLogger(__name__)


class SupportsCudaStream(Protocol):
    """An object exposing the CUDA stream protocol (``cuda.core``'s ``Stream``, ...)."""

    def __cuda_stream__(self) -> tuple[int, int]:
        """``(version, handle)``; version 0 is the only one defined."""
        ...


#: What stream arguments accept: a ``cudaStream_t`` as an int, or a stream-protocol object.
StreamLike: TypeAlias = int | SupportsCudaStream


# --------------------------------------------------------------------------------------------
# Streams.


def stream_handle(stream: StreamLike) -> int:
    """The ``cudaStream_t`` value of ``stream``: an int as is, or the handle an object's
    ``__cuda_stream__()`` reports.

    Raises:
        TypeError: ``stream`` is neither, or ``__cuda_stream__`` does not return two ints.
        ValueError: a negative handle, or a ``__cuda_stream__`` version other than 0.
    """
    if isinstance(stream, int) and not isinstance(stream, bool):
        handle = stream
    else:
        protocol = getattr(stream, "__cuda_stream__", None)
        if protocol is None:
            raise TypeError(
                "a CUDA stream must be an int or an object with __cuda_stream__, "
                f"not {type(stream).__name__}"
            )
        # cuda.core defines a method; accept a plain attribute holding the tuple too.
        info = protocol() if callable(protocol) else protocol
        if (
            not isinstance(info, tuple)
            or len(info) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in info)
        ):
            raise TypeError(f"__cuda_stream__ must return (version, handle), got {info!r}")
        version, handle = info
        if version != 0:
            raise ValueError(f"unsupported __cuda_stream__ version {version} (expected 0)")
    if handle < 0:
        raise ValueError(f"invalid CUDA stream handle {handle}")
    return handle


def _proxy_stream_on_current(backend: Backend, device: int) -> int:
    """The proxy stream of ``device``, which the caller has made current."""
    backend.check_fork()
    stream = backend.streams.get(device)
    if stream is not None:
        return stream
    with backend.lock:
        stream = backend.streams.get(device)
        if stream is None:
            err, stream = backend.runtime.cudaStreamCreate()
            if err != SUCCESS:
                raise cuda_error(
                    backend, err, "Failed to create a CUDA stream for a DLPack call. error:"
                )
            backend.streams[device] = stream
            if not backend.atexit_registered:
                # A weak reference: a test's fake runtime should not live until exit.
                atexit.register(_release_at_exit, weakref.ref(backend))
                backend.atexit_registered = True
    return stream


def proxy_stream(device: int) -> int:
    """The blocking stream pb_tensor hands to DLPack producers for tensors on ``device``.

    Created on first use with ``device`` current (the caller's device is restored), then
    cached for the process under ``device``. Thread-safe.

    Raises:
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: reading/setting the device or creating the stream failed ("Failed to create
            a CUDA stream for a DLPack call. ...").
    """
    backend = require_backend()
    backend.check_fork()
    stream = backend.streams.get(device)
    if stream is not None:
        return stream
    with DeviceScope._on(backend, device):
        return _proxy_stream_on_current(backend, device)


def _take_streams(backend: Backend) -> list[tuple[int, int]]:
    streams = list(backend.streams.items())
    backend.streams.clear()
    return streams


def _destroy_streams(backend: Backend, *, wait: bool = True) -> None:
    lock = backend.lock
    if wait:
        with lock:
            streams = _take_streams(backend)
    elif lock.acquire(blocking=False):
        try:
            streams = _take_streams(backend)
        finally:
            lock.release()
    else:
        # At exit: another thread is creating a stream (a driver call that may never return,
        # or a daemon thread about to be frozen). Waiting could hang the exit; the driver
        # destroys the process's streams with its context anyway.
        return
    for device, stream in streams:
        try:
            (err,) = backend.runtime.cudaStreamDestroy(stream)
        except Exception:  # shutting down: nothing useful can be done about it
            err = -1
        if err != SUCCESS:
            _log.debug("Failed to destroy dlpack CUDA proxy stream on device with id %d", device)


def release_proxy_streams() -> None:
    """Destroy the proxy streams of the installed runtime (they are re-created on demand).

    Runs at interpreter exit for every runtime that created one. CUDA failures are ignored.
    Raises nothing.
    """
    try:
        backend = active_backend()
    except CudaUnavailableError:
        return
    if backend.pid == os.getpid():
        _destroy_streams(backend)


def _release_at_exit(ref: weakref.ref[Backend]) -> None:
    backend = ref()
    if backend is not None and backend.pid == os.getpid():
        _destroy_streams(backend, wait=False)


def synchronize(stream: StreamLike, *, device: int | None = None) -> None:
    """Block the host until all work queued on ``stream`` has finished.

    With ``device``, the call runs with that device current (and names it in errors).

    Raises:
        TypeError, ValueError: ``stream`` is not a stream (see :func:`stream_handle`).
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: "Failed to synchronize CUDA device with id <device>: <name>: <string>".
    """
    handle = stream_handle(stream)
    backend = require_backend()
    if device is None:
        (err,) = backend.runtime.cudaStreamSynchronize(handle)
        if err != SUCCESS:
            raise cuda_error(backend, err, f"Failed to synchronize CUDA stream {handle:#x}:")
        return
    with DeviceScope._on(backend, device):
        (err,) = backend.runtime.cudaStreamSynchronize(handle)
        if err != SUCCESS:
            raise cuda_error(backend, err, f"Failed to synchronize CUDA device with id {device}:")


class DlpackImport(DeviceScope):
    """python_backend's GPU import sequence as a context manager; see :func:`dlpack_import`."""

    __slots__ = ("_stream",)

    def __init__(self, device: int) -> None:
        super().__init__(device)
        self._stream = 0

    def __enter__(self) -> int:
        backend = self._enter()
        try:
            self._stream = _proxy_stream_on_current(backend, self._device)
        except BaseException:
            self._restore(quiet=True)
            raise
        return self._stream

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None and self._backend is not None:
            (err,) = self._backend.runtime.cudaStreamSynchronize(self._stream)
            if err != SUCCESS:
                self._restore(quiet=True)
                raise cuda_error(
                    self._backend, err, f"Failed to synchronize CUDA device with id {self._device}:"
                )
        self._restore(quiet=exc_type is not None)


def dlpack_import(device: int) -> DlpackImport:
    """Scope for importing a GPU tensor on ``device`` from a DLPack producer::

        with cuda.dlpack_import(device_id) as stream:
            capsule = obj.__dlpack__(stream=stream, ...)

    Enter: read the current device ("Failed to get current CUDA device id."), make ``device``
    current, and yield its proxy stream (created on first use). The producer makes that stream
    wait for its pending work. Exit without an exception: synchronise the proxy stream, so the
    data is ready for any stream ("Failed to synchronize CUDA device with id <device>: ...").
    Always: restore the previous device as :class:`DeviceScope` does.

    Raises:
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: any of the CUDA steps above failed.
    """
    return DlpackImport(device)


def import_from_producer(
    producer: object,
    device: int,
    check: Callable[[DLPackTensor], None] | None = None,
) -> DLPackTensor:
    """Import a GPU tensor on ``device`` from a DLPack producer, python_backend's way: inside
    :func:`dlpack_import`, ``dlpack_ctypes.from_dlpack(producer, stream=<proxy stream>,
    check=check)``; the data is ready for any stream when this returns.

    Raises:
        CudaUnavailableError, CudaError: see :func:`dlpack_import`.
        TypeError, ValueError, BufferError: from ``dlpack_ctypes.from_dlpack`` (the producer
            refused, or ``check`` rejected the tensor); the proxy stream is not synchronised
            then, and the device is restored.
    """
    from dlpack_ctypes import from_dlpack

    with dlpack_import(device) as stream:
        return from_dlpack(producer, stream=stream, check=check)
