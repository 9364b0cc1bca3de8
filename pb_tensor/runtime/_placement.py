"""Where tensors live when they move between models: BLS output placement, and the refusal of
GPU tensors that would have to cross between processes.

Triton's BLS response allocator puts each output where the caller's ``preferred_memory``
asks, and otherwise where the called model produced it: with no preference a GPU output stays
on its GPU (``is_cpu()`` is False) and a CPU output stays in CPU memory;
``PreferredMemory(TRITONSERVER_MEMORY_CPU)`` brings GPU outputs to the host;
``PreferredMemory(TRITONSERVER_MEMORY_GPU, device)`` puts every output on that GPU.
:func:`place` does the same with copies through :mod:`pb_tensor.cuda`.

In isolated mode tensors cross between processes through the shared-memory pool, which holds
host memory; GPU memory would need CUDA IPC with lifetimes tied to both processes, which the
runtime does not do. :func:`gpu_refusal` gives the error that replaces such a crossing.
"""

from __future__ import annotations

from collections.abc import Iterable

import dlpack_ctypes as dl
from pb_tensor import MemoryType, Tensor, TritonDtype
from pb_tensor.dtypes import triton_to_dlpack
from pb_tensor.runtime._seam import TRITONSERVER_MEMORY_CPU, PreferredMemory

__all__ = ["all_host", "gpu_refusal", "place", "to_device"]

_KDL_CUDA = int(dl.DLDeviceType.kDLCUDA)


def to_device(tensor: Tensor, device: int) -> Tensor:
    """A copy of ``tensor`` in the memory of GPU ``device`` (a GPU tensor on another device
    is copied through the host). The copy has finished when this returns.

    Raises:
        TritonModelException: CUDA is unavailable (``CudaUnavailableError``) or an allocation
            or copy failed (``CudaError``); nothing is leaked.
    """
    from pb_tensor import cuda  # here: only a copy onto a GPU needs the CUDA facade

    host = tensor.to_host()
    nbytes = host.byte_size
    buffer = cuda.DeviceBuffer(nbytes, device=device)
    if nbytes:
        try:
            cuda.memcpy(buffer.ptr, host.data_ptr, nbytes, cuda.MemcpyKind.HOST_TO_DEVICE,
                        device=device)  # fmt: skip
            # cudaMemcpy from pageable memory may return before the device has the data;
            # consumers on other streams must see all of it.
            cuda.synchronize(0, device=device)
        except BaseException:
            buffer.free()
            raise
    capsule = dl.export_buffer(
        buffer, buffer.ptr, host.shape(), None, dl.DataType(*triton_to_dlpack(host.dtype)),
        (_KDL_CUDA, device),
    )  # fmt: skip
    return Tensor.from_dlpack(tensor.name(), capsule)


def place(tensors: list[Tensor], preferred: PreferredMemory) -> list[Tensor]:
    """``tensors`` where a BLS caller preferring ``preferred`` receives them in Triton:
    unchanged without a preference (zero-copy); GPU tensors copied to the host for
    ``TRITONSERVER_MEMORY_CPU``; tensors not on GPU ``preferred_device_id`` copied there for
    ``TRITONSERVER_MEMORY_GPU``. BYTES tensors stay in CPU memory (a GPU copy of serialized
    strings could not be read).

    Raises:
        TritonModelException: a copy was needed and CUDA is unavailable or failed.
    """
    kind = preferred.preferred_memory_type
    if kind is None or not tensors:
        return tensors
    if kind == TRITONSERVER_MEMORY_CPU:
        return [t.to_host() if t.memory_type == MemoryType.GPU else t for t in tensors]
    device = preferred.preferred_device_id
    return [
        t
        if (t.memory_type == MemoryType.GPU and t.memory_type_id == device)
        or t.dtype == TritonDtype.TYPE_BYTES
        else to_device(t, device)
        for t in tensors
    ]


def all_host(tensors: Iterable[Tensor]) -> bool:
    """Whether every tensor is in host memory (:func:`gpu_refusal` then finds nothing)."""
    gpu = MemoryType.GPU
    return all(t.memory_type is not gpu for t in tensors)


def gpu_refusal(tensors: Iterable[Tensor], role: str, where: str) -> str | None:
    """The error text for the first GPU tensor of ``tensors`` that would cross to another
    process, named as ``"<role> '<name>' <where>"`` (e.g. ``"output 'OUT' of model 'm'"``),
    or None when every tensor is in host memory."""
    for t in tensors:
        if t.memory_type == MemoryType.GPU:
            return (
                f"{role} '{t.name()}' {where} is in GPU memory (device {t.memory_type_id}): a "
                "model loaded with isolated=True exchanges tensors through the shared-memory "
                "pool, which carries host memory only (CUDA IPC is not supported); copy the "
                "tensor to the host first (Tensor.to_host()), or load the model with "
                "isolated=False"
            )
    return None
