"""What :meth:`pb_tensor.Tensor.from_dlpack` accepts: Triton's DLPack input rules, the tables
that map DLPack devices and dtypes to Triton's, and the GPU import steps.

Shared with :mod:`pb_tensor.tensor` only; it never builds a ``Tensor`` (no import cycle).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import numpy as np

import dlpack_ctypes as dl
from dlpack_ctypes.abi import DLDeviceType
from pb_tensor.dtypes import (
    MemoryType,
    TritonDtype,
    triton_from_dlpack,
    triton_to_dlpack,
)
from pb_tensor.errors import TritonModelException
from pb_tensor.extras_policy import extras_allowed

if TYPE_CHECKING:
    from dlpack_ctypes.exchange import ExchangeAPI

__all__ = [
    "DEVICE_OF_MEMORY",
    "DTYPE_OF_DL",
    "KDL_CPU",
    "KDL_CUDA",
    "KDL_CUDA_HOST",
    "MEMORY_OF_DEVICE",
    "NOT_A_PRODUCER",
    "bind_torch",
    "check_importable",
    "device_error",
    "import_gpu",
    "torch_array",
    "wait_for_producer",
]

NOT_A_PRODUCER: Final = (
    "Provided tensor is not supported. Tensor must be a DLPack capsule or have `__dlpack__` "
    "and `__dlpack_device__` attributes"
)
_NOT_CONTIGUOUS: Final = (
    "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in C-Order "
    "are supported."
)
_GPU_UNAVAILABLE: Final = (
    "DLPack capsule passed pointer to memory allocated on GPU device, when GPU is not available"
)

KDL_CPU: Final = int(DLDeviceType.kDLCPU)
KDL_CUDA: Final = int(DLDeviceType.kDLCUDA)
KDL_CUDA_HOST: Final = int(DLDeviceType.kDLCUDAHost)
DEVICE_OF_MEMORY: Final = {
    MemoryType.CPU: DLDeviceType.kDLCPU,
    MemoryType.CPU_PINNED: DLDeviceType.kDLCUDAHost,
    MemoryType.GPU: DLDeviceType.kDLCUDA,
}
MEMORY_OF_DEVICE: Final = {
    KDL_CPU: MemoryType.CPU,
    KDL_CUDA_HOST: MemoryType.CPU_PINNED,
    KDL_CUDA: MemoryType.GPU,
}


def _bind_c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    # The first call binds dlpack_ctypes' memoised C strides in place of this function: the
    # producer module is loaded by the consumer that calls check_importable, never by
    # ``import pb_tensor.tensor`` (a Tensor made from numpy does not need it).
    global _c_strides
    _c_strides = dl.c_strides
    return _c_strides(shape)


_c_strides: Callable[[tuple[int, ...]], tuple[int, ...]] = _bind_c_strides

DTYPE_OF_DL: dict[tuple[int, int, int], TritonDtype] = {}
for _td in TritonDtype:
    if _td not in (TritonDtype.TYPE_INVALID, TritonDtype.TYPE_BYTES):
        DTYPE_OF_DL[triton_to_dlpack(_td)] = _td


def device_error(device_type: int) -> TritonModelException:
    """Upstream's error for a DLPack device Python backend does not support."""
    return TritonModelException(f"DLDevice type {device_type} is not supported by Python backend.")


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """C order, ignoring size-1 dims; every empty tensor passes (fixes upstream's check, which
    skips ``strides[0]`` and 1-D tensors and rejects empty ones)."""
    if 0 in shape:
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if s != expected:
                return False
            expected *= n
    return True


def _triton_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """python_backend's own check, verbatim: it skips ``strides[0]`` (so row-strided views
    pass, which :func:`_c_contiguous` refuses) and rejects some empty tensors (which
    :func:`_c_contiguous` accepts). Applied on top of ours where pb-tensor's extras are off
    (:mod:`pb_tensor.extras_policy`), so a model is refused here wherever Triton refuses it."""
    expected = 1
    ndim = len(shape)
    for i in range(1, ndim):
        n = shape[ndim - i]
        if n != 1:
            if strides[ndim - i] != expected:
                return False
            expected *= n
    return True


def check_importable(t: dl.DLPackTensor) -> None:
    """Triton's rules for DLPack input, applied before the capsule is consumed.

    Raises:
        TritonModelException: an unsupported device or dtype, or a tensor that is not
            C-contiguous.
    """
    strides = t.strides
    if (
        t.dtype in DTYPE_OF_DL
        and t.device[0] in MEMORY_OF_DEVICE
        and (strides == _c_strides(t.shape) or _c_contiguous(t.shape, strides))
        and (0 not in t.shape or extras_allowed() or _triton_contiguous(t.shape, strides))
    ):
        return  # the common case, decided with three lookups
    device_type = int(t.device[0])
    if device_type not in MEMORY_OF_DEVICE:
        raise device_error(device_type)
    if t.dtype not in DTYPE_OF_DL:
        dtype = triton_from_dlpack(*t.dtype)  # raises upstream's BF16 bit-width message
        if dtype == TritonDtype.TYPE_INVALID:
            code, bits, lanes = t.dtype
            raise TritonModelException(
                f"Dtype is invalid. DLPack data type (code={code}, bits={bits}, lanes={lanes}) "
                "has no Triton equivalent."
            )
    if not (strides == _c_strides(t.shape) or _c_contiguous(t.shape, strides)):
        raise TritonModelException(_NOT_CONTIGUOUS)
    if not extras_allowed() and not _triton_contiguous(t.shape, strides):
        raise TritonModelException(_NOT_CONTIGUOUS)


def import_gpu(producer: object, device_id: int) -> dl.DLPackTensor:
    """python_backend's GPU import through :func:`cuda.import_from_producer`:
    device ``device_id`` current, ``__dlpack__(stream=<its proxy stream>)``, then the proxy
    stream synchronised and the caller's device restored (also when anything fails).

    Raises:
        TritonModelException: the producer exported memory of another device, or the tensor
            breaks :func:`check_importable`; ``CudaUnavailableError`` without CUDA.
    """
    from pb_tensor import cuda

    def check(t: dl.DLPackTensor) -> None:
        if t.device != (KDL_CUDA, device_id):
            # The producer said (kDLCUDA, id) but exported other memory: trusting the capsule
            # would skip the synchronisation it was scoped for.
            raise TritonModelException(
                f"DLPack producer reported device (kDLCUDA, {device_id}) but exported a tensor "
                f"on device ({int(t.device[0])}, {t.device[1]})"
            )
        check_importable(t)

    try:
        return cuda.import_from_producer(producer, device_id, check)
    except cuda.CudaUnavailableError as exc:
        # Upstream's text for a CPU-only build, then why CUDA cannot be used here.
        raise cuda.CudaUnavailableError(
            f"{_GPU_UNAVAILABLE}: {exc}", exc.code, exc.error_name
        ) from exc


def wait_for_producer(api: ExchangeAPI, imported: dl.DLPackTensor) -> None:
    """Order a GPU tensor imported through the exchange API (which does no synchronisation)
    as python_backend's protocol import does: on return the data is ready for any stream.

    ``__dlpack__(stream=proxy)`` makes the proxy stream wait for the producer's current stream
    and the import then synchronises the proxy, i.e. the host waits for the work queued on the
    producer's current stream. Here the host waits for that stream directly (its handle from
    ``current_work_stream``), with the tensor's device current and the caller's device restored,
    and with the protocol path's error texts. On failure the tensor is released first.

    Raises:
        CudaUnavailableError: CUDA cannot be used; other CUDA errors as raised.
    """
    from pb_tensor import cuda

    device_id = imported.device[1]
    try:
        cuda.synchronize(api.current_work_stream(KDL_CUDA, device_id), device=device_id)
    except cuda.CudaUnavailableError as exc:
        imported.close()
        raise cuda.CudaUnavailableError(
            f"{_GPU_UNAVAILABLE}: {exc}", exc.code, exc.error_name
        ) from exc
    except BaseException:
        imported.close()
        raise


def _declines(t: object) -> bool:
    return True


# torch, seen through torch_array (bound by bind_torch when the package meets torch.Tensor).
# bind_torch stores the function before the dtypes: a thread that finds a dtype listed also
# finds the real function.
_torch_dtypes: frozenset[object] = frozenset()
_torch_has_function: Callable[[Any], bool] = _declines


def bind_torch() -> type | None:
    """``torch.Tensor`` if torch is imported (binding what :func:`torch_array` needs), else
    None. Never imports torch and never raises (a torch still being imported is seen later).
    """
    global _torch_dtypes, _torch_has_function
    torch: Any = sys.modules.get("torch")
    if torch is None:
        # Tested first: Tensor.from_dlpack asks again on every import of another producer
        # until torch appears, and the AttributeError below would cost it about 0.7 us each.
        return None
    try:
        tensor_type: type = torch.Tensor
        names = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64",
                 "int64", "float16", "float32", "float64")  # fmt: skip
        dtypes = frozenset(getattr(torch, name) for name in names if hasattr(torch, name))
        has_function = torch.overrides.has_torch_function_unary
    except AttributeError:  # a torch not fully imported yet
        return None
    _torch_has_function = has_function
    _torch_dtypes = dtypes
    return tensor_type


def torch_array(t: Any) -> np.ndarray[Any, Any] | None:
    """A CPU ``torch.Tensor``'s memory through torch's own numpy bridge, or None to import it
    through DLPack instead (which then decides, with its errors).

    ``Tensor.numpy()`` is one C call and shares the memory, as DLPack does; it also keeps the
    storage alive should the tensor later be ``set_()`` to other memory (the view's base is an
    alias of the tensor) and makes the storage non-resizable, where every DLPack consumer,
    numpy's included, is left with freed memory. Taken only for what DLPack would import the
    same way: a plain CPU tensor (not pinned: DLPack reports that memory as CUDA host memory)
    of a dtype numpy has, without autograd and without ``__torch_function__`` overrides or
    modes (which ``__dlpack__`` honours). Anything else, and anything ``numpy()`` refuses
    (the negative bit, sparse layouts), returns None.

    Raises:
        MemoryError: as raised by ``numpy()``.
    """
    if (
        t.dtype not in _torch_dtypes
        or t.requires_grad
        or not t.is_cpu
        or _torch_has_function(t)
        or t.is_pinned()
    ):
        return None
    try:
        array: np.ndarray[Any, Any] = t.numpy()
    except (RuntimeError, TypeError):
        # What numpy() refuses (the negative bit, sparse and mkldnn layouts): DLPack may still
        # import it, or refuse it in its own words. A MemoryError propagates.
        return None
    return array
