"""Functions that run in other processes (multiprocessing pools, Ray workers) for the travel
tests: importable by name there, so they live in a module of their own, not in a test file."""

from __future__ import annotations

import hashlib

import numpy as np

import dlpack_ctypes as dl
from pb_tensor import Tensor, TritonDtype, serialize_byte_tensor
from pb_tensor.shm import SharedMemoryPool

BF16 = dl.DataType(4, 16, 1)

Description = tuple[str, int, list[int], int, bool, str]


def raw_bytes(t: Tensor) -> bytes:
    """A tensor's host bytes: BYTES as wire bytes, BF16 as its 16-bit words."""
    if t.triton_dtype() is TritonDtype.TYPE_BYTES:
        wire = serialize_byte_tensor(t.as_numpy())
        return wire if isinstance(wire, bytes) else b""
    return bytes(dl.from_dlpack(t).numpy(raw=True).tobytes())


def writable(t: Tensor) -> bool:
    """Whether the tensor's data may be written (BYTES: its elements array)."""
    if t.triton_dtype() is TritonDtype.TYPE_BF16:
        with dl.consume(t.__dlpack__(max_version=(1, 3))) as imported:
            return not imported.readonly
    return bool(t.as_numpy().flags.writeable)


def describe(t: Tensor) -> Description:
    """What a receiving process sees: name, dtype, shape, memory type, writable, data digest."""
    return (t.name(), int(t.triton_dtype()), t.shape(), int(t.memory_type), writable(t),
            hashlib.sha256(raw_bytes(t)).hexdigest())


def double(t: Tensor) -> Tensor:
    """A new tensor: numeric data times two, BYTES elements repeated twice."""
    if t.triton_dtype() is TritonDtype.TYPE_BYTES:
        doubled = np.array([x * 2 for x in t.as_numpy().flat], dtype=object)
        return Tensor(t.name() + "_out", doubled.reshape(t.shape()))
    return Tensor(t.name() + "_out", np.asarray(t.as_numpy() * 2))


def make(name: str, n: int) -> Tensor:
    """A float32 tensor of ``n`` elements 0..n-1, built in the worker."""
    return Tensor(name, np.arange(n, dtype=np.float32))


def make_bf16(values: list[float]) -> Tensor:
    """A BF16 tensor (the top halves of float32 values) over uint16 host memory."""
    f32 = np.array(values, dtype=np.float32)
    bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
    return Tensor.from_dlpack(
        "bf16", dl.BufferExporter(bits, bits.ctypes.data, bits.shape, None, BF16)
    )


def load_from_pool(pool_name: str, handle: int) -> tuple[str, float]:
    """The shared-memory recipe's receiving side: attach, load (zero-copy), reduce."""
    with SharedMemoryPool.attach(pool_name) as pool:
        t = Tensor.load_from_shared_memory(pool, handle)
        result = (t.name(), float(t.as_numpy().sum()))
        del t
    return result


def data_address(t: Tensor) -> int:
    """Where the tensor's data lives in the receiving process."""
    return t.data_ptr


class Accumulator:
    """A Ray actor's class: keeps a running sum of the Tensors it is sent."""

    def __init__(self, n: int) -> None:
        self.total = np.zeros(n, dtype=np.float64)

    def add(self, t: Tensor) -> Tensor:
        self.total += t.as_numpy()
        return Tensor("total", self.total.copy())
