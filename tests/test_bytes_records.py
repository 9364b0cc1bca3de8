"""BYTES tensors in shared-memory records: the stored length index beside the payload.

The record keeps Triton's layout (the payload is exactly the wire bytes, ``byte_size`` long);
the index lies after it inside the allocation, is checked on every load and never turns into
wrong data; records without it (small tensors, plain Triton-layout writers) are walked.
"""

from __future__ import annotations

import gc
import os
import struct
import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from pb_tensor import Tensor, TritonModelException, bytes_codec, shm
from pb_tensor.shm import SharedMemoryPool

BYTES = 13  # TRITONSERVER_TYPE_BYTES
STORED = "Invalid bytes tensor data: stored element lengths"


@pytest.fixture
def pool() -> Iterator[SharedMemoryPool]:
    name = f"pbt_bytes_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    with SharedMemoryPool.create(1 << 20, growth=1 << 20, name=name) as p:
        yield p
        gc.collect()
        stats = p.stats()
        assert (stats.allocations, stats.used) == (0, 0), f"leaked allocations: {stats}"


def strings(count: int, seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    out = np.empty(count, dtype=object)
    out[:] = [rng.bytes(int(n)) for n in rng.integers(0, 33, count)]
    return out


def wire(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def index_of(items: list[bytes]) -> bytes:
    head = struct.pack("<8sQQ", b"pbtLENS1", len(items), len(wire(items)))
    return head + b"".join(struct.pack("<I", len(item)) for item in items)


def layout(pool: SharedMemoryPool, handle: int) -> tuple[int, int, int]:
    """(payload offset from the record start, byte_size, allocation size) of a record."""
    record = shm.load_record(pool, handle)
    poff = shm.record_payload_offset(len(record.dims), len(record.name.encode()))
    byte_size = record.byte_size
    del record
    return poff, byte_size, pool.nbytes(handle)


def test_saved_record_keeps_the_wire_bytes_and_stores_the_lengths_after_them(
    pool: SharedMemoryPool,
) -> None:
    array = strings(2000).reshape(40, 50)
    items = array.reshape(-1).tolist()
    tensor = Tensor("s", array)
    handle = tensor.save_to_shared_memory(pool)
    poff, byte_size, nbytes = layout(pool, handle)
    raw = pool.view(handle)
    # What Triton reads: the header's byte_size, then that many payload bytes.
    assert byte_size == len(wire(items))
    assert raw[poff : poff + byte_size].tobytes() == wire(items)
    assert raw[poff : poff + byte_size].tobytes() == bytes_codec.serialize_byte_tensor(array)
    # After it, 8-byte aligned and inside the allocation: the index, nothing else.
    at = poff + ((byte_size + 7) & -8)
    assert nbytes == at + len(index_of(items))
    assert raw[at:nbytes].tobytes() == index_of(items)
    record = shm.load_record(pool, handle)
    assert shm.load_appendix(pool, record) == index_of(items)
    del record, raw
    loaded = Tensor.load_from_shared_memory(pool, handle)
    assert loaded.as_numpy().shape == (40, 50)
    assert loaded.as_numpy().tolist() == array.tolist()
    assert all(type(x) is bytes for x in loaded.as_numpy().reshape(-1))


@pytest.mark.parametrize("count", [1, 6, 1024])
def test_few_elements_store_no_lengths(pool: SharedMemoryPool, count: int) -> None:
    array = strings(count)
    tensor = Tensor("s", array)
    assert tensor._lengths is None
    handle = tensor.save_to_shared_memory(pool)
    poff, byte_size, nbytes = layout(pool, handle)
    assert nbytes == poff + byte_size
    record = shm.load_record(pool, handle)
    assert shm.load_appendix(pool, record) == b""
    del record
    assert Tensor.load_from_shared_memory(pool, handle).as_numpy().tolist() == array.tolist()


def test_fixed_width_arrays_store_lengths(pool: SharedMemoryPool) -> None:
    array = np.array([b"a\x00", b"bcd", b""] * 700, dtype="S4").reshape(30, 70)
    expected = [item.rstrip(b"\x00") for item in array.reshape(-1).tolist()]
    tensor = Tensor("s", array)
    handle = tensor.save_to_shared_memory(pool)
    record = shm.load_record(pool, handle)
    assert shm.load_appendix(pool, record) == index_of(expected)
    del record
    assert Tensor.load_from_shared_memory(pool, handle).as_numpy().reshape(-1).tolist() == expected


def _plain_record(pool: SharedMemoryPool, items: list[bytes], appendix: bytes | None) -> int:
    data = wire(items)
    return shm.save_record(
        pool, name="plain", dtype=BYTES, dims=(len(items),), memory_type=shm.MEMORY_CPU,
        memory_type_id=0, payload=data, byte_size=len(data), appendix=appendix,
    )  # fmt: skip


@pytest.mark.parametrize(
    "appendix",
    [None, b"", b"not a length index, just bytes after the payload", bytes(64)],
    ids=["none", "empty", "foreign", "zeros"],
)
def test_records_without_an_index_are_walked(
    pool: SharedMemoryPool, appendix: bytes | None
) -> None:
    items = strings(3000, seed=1).tolist()
    handle = _plain_record(pool, items, appendix)
    record = shm.load_record(pool, handle)
    assert shm.load_appendix(pool, record) == (appendix or b"")
    del record
    assert Tensor.load_from_shared_memory(pool, handle).as_numpy().tolist() == items


def _swap_two_lengths(items: list[bytes]) -> bytes:
    """An index whose first two lengths are exchanged: same total, wrong places."""
    index = bytearray(index_of(items))
    first, second = index[24:28], index[28:32]
    index[24:28], index[28:32] = second, first
    return bytes(index)


@pytest.mark.parametrize(
    ("make_index", "message"),
    [
        (_swap_two_lengths,
         "do not match the data: element 0 is stored as 0 bytes, its length field says 5"),
        (lambda items: index_of(items[:-1]), "are for 2999 elements, the tensor has 3000"),
        (lambda items: index_of(items)[:-4], "are truncated: 12020 bytes, 12024 needed"),
        (lambda items: index_of([*items[:-1], items[-1] + b"x"]),
         "are for {size_plus_1} bytes of data, found {size}"),
    ],
    ids=["swapped", "other-count", "truncated", "other-size"],
)
def test_corrupted_lengths_raise(
    pool: SharedMemoryPool, make_index: Callable[[list[bytes]], bytes], message: str
) -> None:
    items = strings(3000, seed=1).tolist()
    items[0], items[1] = b"abcde", b""
    handle = _plain_record(pool, items, make_index(items))
    with pytest.raises(TritonModelException) as info:
        Tensor.load_from_shared_memory(pool, handle)
    size = len(wire(items))
    assert str(info.value) == (
        f"Corrupted tensor record at shared memory handle {handle}: BYTES payload "
        f"{STORED} {message.format(size=size, size_plus_1=size + 1)}"
    )
    # The failed load gave its message back: the record is still there, and its raw wire
    # bytes (what Triton reads) are intact.
    record = shm.load_record(pool, handle, take=True)
    assert record.payload.tobytes() == wire(items)
    del record


def test_corruption_after_save_is_detected(pool: SharedMemoryPool) -> None:
    """A stored length overwritten in shared memory after the save: an error, not wrong data."""
    array = strings(2048, seed=2)
    array[0] = b"abc"
    tensor = Tensor("s", array)
    handle = tensor.save_to_shared_memory(pool)
    poff, byte_size, _ = layout(pool, handle)
    raw = pool.view(handle)
    first = poff + ((byte_size + 7) & -8) + 24
    raw[first : first + 4] = np.frombuffer(struct.pack("<I", 2), dtype=np.uint8)
    raw[first + 4 : first + 8] = np.frombuffer(
        struct.pack("<I", len(array[1]) + 1), dtype=np.uint8
    )
    del raw
    with pytest.raises(TritonModelException) as info:
        Tensor.load_from_shared_memory(pool, handle)
    assert str(info.value).endswith(
        f"{STORED} do not match the data: element 0 is stored as 2 bytes, its length field says 3"
    )
    shm.release(pool, handle)  # the message the failed load gave back


def test_loaded_tensor_saves_again(pool: SharedMemoryPool) -> None:
    array = strings(1500, seed=3)
    tensor = Tensor("s", array)
    loaded = Tensor.load_from_shared_memory(pool, tensor.save_to_shared_memory(pool))
    with SharedMemoryPool.create(1 << 20) as other:
        again = Tensor.load_from_shared_memory(other, loaded.save_to_shared_memory(other))
        assert again.as_numpy().tolist() == array.tolist()
        del again


def test_appendix_rules(pool: SharedMemoryPool) -> None:
    with pytest.raises(TritonModelException) as info:
        shm.save_record(
            pool, name="g", dtype=1, dims=(4,), memory_type=shm.MEMORY_GPU, memory_type_id=0,
            payload=None, byte_size=4, appendix=b"x",
        )  # fmt: skip
    assert str(info.value) == "an appendix is only stored for CPU records"
    with pytest.raises(TritonModelException) as info:
        shm.save_record(
            pool, name="c", dtype=2, dims=(4,), memory_type=shm.MEMORY_CPU, memory_type_id=0,
            payload=bytes(4), byte_size=4, appendix=memoryview(bytes(16))[::2],
        )  # fmt: skip
    assert str(info.value) == "appendix must be a C-contiguous buffer, not memoryview"
    gpu = shm.save_record(
        pool, name="g", dtype=1, dims=(4,), memory_type=shm.MEMORY_GPU, memory_type_id=0,
        payload=None, byte_size=4,
    )  # fmt: skip
    record = shm.load_record(pool, gpu, take=True)
    assert shm.load_appendix(pool, record) == b""
    del record


def test_other_process_reads_the_indexed_record(
    pool: SharedMemoryPool, run_python: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    array = strings(5000, seed=4).reshape(50, 100)
    tensor = Tensor("s", array)
    handle = tensor.save_to_shared_memory(pool)
    result = run_python(
        """
        import hashlib, sys
        from pb_tensor import Tensor, shm
        from pb_tensor.shm import SharedMemoryPool
        pool = SharedMemoryPool.attach(sys.argv[1])
        handle = int(sys.argv[2])
        record = shm.load_record(pool, handle)
        assert shm.load_appendix(pool, record)[:8] == b"pbtLENS1"
        del record
        loaded = Tensor.load_from_shared_memory(pool, handle).as_numpy()
        print(loaded.shape, hashlib.sha256(b"|".join(loaded.reshape(-1))).hexdigest())
        del loaded
        pool.close()
        """,
        pool.name,
        str(handle),
    )
    assert result.returncode == 0, result.stderr
    digest = __import__("hashlib").sha256(b"|".join(array.reshape(-1))).hexdigest()
    assert result.stdout.split() == ["(50,", "100)", digest]
