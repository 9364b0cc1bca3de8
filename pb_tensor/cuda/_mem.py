"""Device memory and CUDA IPC for :mod:`pb_tensor.cuda`: pointer queries, copies, owned
device buffers, and the legacy ``cudaIpc*MemHandle`` calls python_backend uses.

Private: import these names from :mod:`pb_tensor.cuda`.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import TYPE_CHECKING, cast

from pb_tensor.cuda._backend import Backend, DeviceScope, cuda_error, require_backend
from pb_tensor.cuda._runtime import (
    _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    _IPC_LAZY_ENABLE_PEER_ACCESS,
    _MEMORY_TYPE_UNREGISTERED,
    IPC_HANDLE_SIZE,
    SUCCESS,
    CudaError,
    MemcpyKind,
)

if TYPE_CHECKING:
    from types import TracebackType

    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

_log = logging.getLogger("pb_tensor.cuda")


# --------------------------------------------------------------------------------------------
# Pointers and memory.


def pointer_device(ptr: int) -> int | None:
    """The device that owns CUDA memory at ``ptr``; None for NULL (no CUDA call) and for host
    memory CUDA does not know.

    Raises:
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: ``cudaPointerGetAttributes`` failed.
    """
    if ptr == 0:
        return None
    backend = require_backend()
    err, memory_type, device = backend.runtime.cudaPointerGetAttributes(ptr)
    if err != SUCCESS:
        raise cuda_error(backend, err, "Failed to get the CUDA pointer device attribute. error:")
    return None if memory_type == _MEMORY_TYPE_UNREGISTERED else device


def _range_start(backend: Backend, ptr: int) -> int:
    err, base = backend.runtime.cuPointerGetAttribute(_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr)
    if err != SUCCESS:
        raise cuda_error(
            backend, err, "Failed to get the CUDA pointer range start address. error:", driver=True
        )
    if not 0 < base <= ptr:
        raise CudaError(f"CUDA reported range start {base:#x} for pointer {ptr:#x}")
    return base


def allocation_offset(ptr: int, nbytes: int, *, device: int) -> int:
    """``ptr`` minus the start of the CUDA allocation containing it (what an IPC handle, which
    names the whole allocation, needs). 0 without a CUDA call when ``ptr`` is NULL or
    ``nbytes`` is 0.

    Raises:
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: the device cannot be set or the driver does not know the pointer.
    """
    if ptr == 0 or nbytes == 0:
        return 0
    backend = require_backend()
    with DeviceScope._on(backend, device):
        return ptr - _range_start(backend, ptr)


def _check_size(nbytes: int) -> None:
    if nbytes < 0:
        raise ValueError(f"byte count must be >= 0, got {nbytes}")


def _memcpy(
    backend: Backend, dst: int, src: int, nbytes: int, kind: MemcpyKind, device: int
) -> None:
    with DeviceScope._on(backend, device):
        (err,) = backend.runtime.cudaMemcpy(dst, src, nbytes, int(kind))
        if err != SUCCESS:
            raise cuda_error(backend, err, "failed to copy data:")
        if kind in (MemcpyKind.DEVICE_TO_DEVICE, MemcpyKind.DEFAULT):
            # cudaMemcpy may return before a device-to-device copy ran (python_backend syncs
            # the default stream here too).
            (err,) = backend.runtime.cudaStreamSynchronize(0)
            if err != SUCCESS:
                raise cuda_error(
                    backend, err, f"Failed to synchronize CUDA device with id {device}:"
                )


def memcpy(dst: int, src: int, nbytes: int, kind: MemcpyKind, *, device: int) -> None:
    """Copy ``nbytes`` from address ``src`` to ``dst`` with ``device`` current (the GPU side's
    device); returns when the copy has finished (device-to-device copies are synchronised).
    Nothing happens for 0 bytes.

    Raises:
        ValueError: ``nbytes`` < 0 or ``kind`` is not a :class:`MemcpyKind` value.
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: "failed to copy data: <name>: <string>", or the synchronisation failed.
    """
    _check_size(nbytes)
    kind = MemcpyKind(kind)
    if nbytes:
        _memcpy(require_backend(), dst, src, nbytes, kind, device)


def copy_device_to_host(dst: object, src: int, *, device: int) -> None:
    """Fill the writable, C-contiguous buffer ``dst`` (a numpy array, a ``bytearray`` ...)
    with its size in bytes from device memory at ``src``. An empty ``dst`` needs no CUDA call.

    Raises:
        TypeError: ``dst`` does not support the buffer protocol.
        ValueError: ``dst`` is read-only or not C-contiguous.
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: the copy failed (see :func:`memcpy`).
    """
    # Typed `object`: numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12, so a
    # Buffer parameter would reject arrays under python_version 3.10. memoryview checks it.
    with memoryview(cast("Buffer", dst)) as view:
        if view.readonly or not view.c_contiguous:
            raise ValueError("copy_device_to_host needs a writable C-contiguous buffer")
        if view.nbytes == 0:
            return
        with view.cast("B") as flat:
            target = (ctypes.c_char * flat.nbytes).from_buffer(flat)
            try:
                _memcpy(
                    require_backend(),
                    ctypes.addressof(target),
                    src,
                    flat.nbytes,
                    MemcpyKind.DEVICE_TO_HOST,
                    device,
                )
            finally:
                del target  # releases the buffer export so the views can close


def _malloc(backend: Backend, nbytes: int, device: int) -> int:
    with DeviceScope._on(backend, device):
        err, ptr = backend.runtime.cudaMalloc(nbytes)
        if err != SUCCESS:
            raise cuda_error(
                backend,
                err,
                f"Failed to allocate {nbytes} bytes of CUDA memory on device {device}. error:",
            )
    return ptr


def _free(backend: Backend, ptr: int, device: int) -> None:
    with DeviceScope._on(backend, device):
        (err,) = backend.runtime.cudaFree(ptr)
        if err != SUCCESS:
            raise cuda_error(backend, err, "Failed to free CUDA memory. error:")


def malloc(nbytes: int, *, device: int) -> int:
    """Allocate ``nbytes`` of device memory on ``device``; release it with :func:`free`
    (:class:`DeviceBuffer` does both). Returns 0 without a CUDA call for 0 bytes.

    Raises:
        ValueError: ``nbytes`` < 0.
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: ``cudaMalloc`` failed.
    """
    _check_size(nbytes)
    return _malloc(require_backend(), nbytes, device) if nbytes else 0


def free(ptr: int, *, device: int) -> None:
    """Release memory from :func:`malloc`; NULL is ignored without a CUDA call.

    Raises:
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: ``cudaFree`` failed.
    """
    if ptr:
        _free(require_backend(), ptr, device)


def _free_quietly(backend: Backend, ptr: int, device: int) -> None:
    # Runs from garbage collection or at exit, where raising helps nobody.
    try:
        _free(backend, ptr, device)
    except Exception:
        _log.debug("Failed to free CUDA memory at %#x on device %d", ptr, device)


class DeviceBuffer:
    """``nbytes`` of device memory owned by this object, e.g. as the owner of an exported copy.

    Freed by :meth:`free`, by leaving a ``with`` block, or when the object is garbage collected
    or the interpreter exits (then failures are only logged). ``ptr`` is 0 for 0 bytes, which
    allocate nothing.

    Raises (constructor): what :func:`malloc` raises.
    """

    __slots__ = ("__weakref__", "_backend", "_finalizer", "device", "nbytes", "ptr")

    def __init__(self, nbytes: int, *, device: int) -> None:
        _check_size(nbytes)
        self.nbytes = nbytes
        self.device = device
        self.ptr = 0
        self._backend: Backend | None = None
        self._finalizer: weakref.finalize[..., DeviceBuffer] | None = None
        if nbytes:
            backend = self._backend = require_backend()
            self.ptr = _malloc(backend, nbytes, device)
            self._finalizer = weakref.finalize(self, _free_quietly, backend, self.ptr, device)

    def free(self) -> None:
        """Release the memory now; later calls do nothing.

        Raises:
            CudaError: ``cudaFree`` failed (the buffer then counts as freed).
        """
        finalizer = self._finalizer
        if finalizer is None or finalizer.detach() is None or self._backend is None:
            return
        _free(self._backend, self.ptr, self.device)

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "live" if self._finalizer is not None and self._finalizer.alive else "freed"
        return f"<DeviceBuffer {state} device={self.device} ptr={self.ptr:#x} nbytes={self.nbytes}>"


def device_copy(src: int, nbytes: int, *, device: int) -> DeviceBuffer:
    """A new :class:`DeviceBuffer` on ``device`` holding a copy of ``nbytes`` at ``src``
    (finished when this returns). 0 bytes: an empty buffer, no CUDA call.

    Raises:
        ValueError: ``nbytes`` < 0.
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: the allocation or the copy failed (nothing is leaked).
    """
    buffer = DeviceBuffer(nbytes, device=device)
    if nbytes:
        try:
            _memcpy(require_backend(), buffer.ptr, src, nbytes, MemcpyKind.DEVICE_TO_DEVICE, device)
        except BaseException:
            buffer.free()
            raise
    return buffer


# --------------------------------------------------------------------------------------------
# CUDA IPC (legacy cudaIpc*MemHandle, as python_backend uses).


def _handle_bytes(handle: bytes | bytearray | memoryview) -> bytes:
    data = bytes(handle)
    if len(data) != IPC_HANDLE_SIZE:
        raise ValueError(f"a CUDA IPC handle has {IPC_HANDLE_SIZE} bytes, got {len(data)}")
    return data


def _get_handle(backend: Backend, ptr: int) -> bytes:
    err, handle = backend.runtime.cudaIpcGetMemHandle(ptr)
    if err != SUCCESS:
        raise cuda_error(backend, err, "Failed to get the cudaIpcHandle. error:")
    return _handle_bytes(handle)


def ipc_get_mem_handle(ptr: int, *, device: int) -> bytes:
    """The 64-byte IPC handle of the allocation that starts at ``ptr`` on ``device``.

    Raises:
        ValueError: ``ptr`` is NULL (no CUDA call).
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: "Failed to get the cudaIpcHandle. error: ...".
    """
    if ptr == 0:
        raise ValueError("cannot get a CUDA IPC handle for a NULL pointer")
    backend = require_backend()
    with DeviceScope._on(backend, device):
        return _get_handle(backend, ptr)


def ipc_open_mem_handle(handle: bytes | bytearray | memoryview, *, device: int) -> int:
    """Map another process's allocation into this one on ``device``
    (``cudaIpcMemLazyEnablePeerAccess``); returns its base. Pair with
    :func:`ipc_close_mem_handle` (CUDA reference-counts repeated opens of one handle).

    Raises:
        ValueError: ``handle`` is not 64 bytes.
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: "Failed to open the cudaIpcHandle. error: <name>: <string>".
    """
    data = _handle_bytes(handle)
    backend = require_backend()
    with DeviceScope._on(backend, device):
        err, base = backend.runtime.cudaIpcOpenMemHandle(data, _IPC_LAZY_ENABLE_PEER_ACCESS)
        if err != SUCCESS:
            raise cuda_error(backend, err, "Failed to open the cudaIpcHandle. error:")
    return base


def ipc_close_mem_handle(base: int, *, device: int) -> None:
    """Unmap a base returned by :func:`ipc_open_mem_handle`; NULL is ignored without a call.

    Raises:
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: "Failed to close the cudaIpcHandle. error: ...".
    """
    if base == 0:
        return
    backend = require_backend()
    with DeviceScope._on(backend, device):
        (err,) = backend.runtime.cudaIpcCloseMemHandle(base)
        if err != SUCCESS:
            raise cuda_error(backend, err, "Failed to close the cudaIpcHandle. error:")


def ipc_export(ptr: int, nbytes: int, *, device: int) -> tuple[bytes, int]:
    """``(handle, offset)`` letting another process reach ``nbytes`` at ``ptr`` on ``device``:
    the IPC handle of the enclosing allocation and ``ptr``'s offset in it (what a tensor's
    shared-memory record stores). For NULL or 0 bytes: 64 zero bytes and 0, no CUDA call.

    Raises:
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: the allocation start or the handle cannot be obtained.
    """
    if ptr == 0 or nbytes == 0:
        return bytes(IPC_HANDLE_SIZE), 0
    backend = require_backend()
    with DeviceScope._on(backend, device):
        base = _range_start(backend, ptr)
        return _get_handle(backend, base), ptr - base


def _close_quietly(backend: Backend, base: int, device: int) -> None:
    # Runs from garbage collection or at exit, where raising helps nobody. The mapping is
    # closed through the runtime that opened it, even if another one was installed since.
    err = -1
    try:
        with DeviceScope._on(backend, device):
            (err,) = backend.runtime.cudaIpcCloseMemHandle(base)
    except Exception:
        err = -1
    if err != SUCCESS:
        _log.debug("Failed to close the cudaIpcHandle at %#x on device %d", base, device)


class IpcMapping:
    """GPU memory of another process opened from an IPC handle; made by :func:`ipc_import`.

    ``ptr`` is the tensor's data (``base + offset``; 0 for an empty tensor, which opens
    nothing). The mapping is closed by :meth:`close`, by leaving a ``with`` block, or when the
    object is garbage collected or the interpreter exits (then failures are only logged).
    """

    __slots__ = ("__weakref__", "_backend", "_finalizer", "base", "device", "nbytes", "ptr")

    def __init__(self, base: int, offset: int, nbytes: int, device: int, backend: Backend | None):
        self._backend = backend
        self.base = base
        self.ptr = base + offset if base else 0
        self.nbytes = nbytes
        self.device = device
        self._finalizer = (
            weakref.finalize(self, _close_quietly, backend, base, device)
            if base and backend is not None
            else None
        )

    @property
    def closed(self) -> bool:
        """True once the mapping is closed (always for an empty tensor)."""
        return self._finalizer is None or not self._finalizer.alive

    def close(self) -> None:
        """Close the mapping; later calls do nothing.

        Raises:
            CudaError: "Failed to close the cudaIpcHandle. error: ..." (the mapping then counts
                as closed: CUDA will not accept the same close twice).
        """
        finalizer = self._finalizer
        if finalizer is None or finalizer.detach() is None or self._backend is None:
            return
        backend = self._backend
        with DeviceScope._on(backend, self.device):
            (err,) = backend.runtime.cudaIpcCloseMemHandle(self.base)
            if err != SUCCESS:
                raise cuda_error(backend, err, "Failed to close the cudaIpcHandle. error:")

    def __enter__(self) -> IpcMapping:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<IpcMapping {state} device={self.device} ptr={self.ptr:#x} nbytes={self.nbytes}>"


def ipc_import(
    handle: bytes | bytearray | memoryview, offset: int, nbytes: int, *, device: int
) -> IpcMapping:
    """Open the memory :func:`ipc_export` described in another process, on ``device``.

    For 0 bytes nothing is opened (python_backend skips it too) and ``ptr`` is 0.

    Raises:
        ValueError: ``handle`` is not 64 bytes, or ``offset``/``nbytes`` is negative.
        CudaUnavailableError: no cuda-python, driver or device.
        CudaError: "Failed to open the cudaIpcHandle. error: <name>: <string>".
    """
    _check_size(nbytes)
    if offset < 0:
        raise ValueError(f"IPC offset must be >= 0, got {offset}")
    data = _handle_bytes(handle)
    if nbytes == 0:
        return IpcMapping(0, 0, 0, device, None)
    backend = require_backend()
    with DeviceScope._on(backend, device):
        err, base = backend.runtime.cudaIpcOpenMemHandle(data, _IPC_LAZY_ENABLE_PEER_ACCESS)
        if err != SUCCESS:
            raise cuda_error(backend, err, "Failed to open the cudaIpcHandle. error:")
    return IpcMapping(base, offset, nbytes, device, backend)


for _cls in (DeviceBuffer, IpcMapping):
    _cls.__module__ = "pb_tensor.cuda"
del _cls
