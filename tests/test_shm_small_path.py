"""The small-transfer paths of the pool: the one-call save of a small numeric tensor, the
one-read parse of a record header, and the one-expression block check.

Each must write and read exactly what the general path does, leave everything else to it, and
raise the same errors (the general paths themselves are tested in test_shm.py,
test_tensor_shm.py and test_shm_corruption.py).
"""

from __future__ import annotations

import gc
import os
import struct
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import dlpack_ctypes as dl
from pb_tensor import Tensor, TritonDtype, TritonModelException, shm
from pb_tensor.shm import SharedMemoryPool, _tensors
from pb_tensor.shm import _heap as heap

SMALL = 1 << 16  # the largest payload of the small save path
_TENSOR_SHM = struct.Struct("=qi4xQ")


@pytest.fixture
def pool() -> Iterator[SharedMemoryPool]:
    name = f"pbt_small_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    with SharedMemoryPool.create(1 << 20, growth=1 << 20, name=name) as p:
        yield p
        gc.collect()
        stats = p.stats()
        assert (stats.allocations, stats.used) == (0, 0), f"leaked allocations: {stats}"


@pytest.fixture
def small_saves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the saves that take the small path (the handles they made)."""
    calls: list[int] = []
    real = getattr(_tensors, "save_small_held")  # noqa: B009 - imported there, not exported

    def spy(pool: SharedMemoryPool, name: str, dtype: int, src: Any, cell: list[int]) -> Any:
        record = real(pool, name, dtype, src, cell)
        calls.append(record.handle)
        return record

    monkeypatch.setattr(_tensors, "save_small_held", spy)
    return calls


def _raw(pool: SharedMemoryPool, handle: int, ndim: int) -> bytes:
    """The whole allocation, record header and payload, less the name's address (the one
    field that depends on where the record is)."""
    raw = bytearray(pool.view(handle).tobytes())
    at = _TENSOR_SHM.size + 8 * ndim
    assert struct.unpack_from("=q", raw, at)[0] == handle + heap.PREFIX + at
    struct.pack_into("=q", raw, at, 0)
    return bytes(raw)


def _general(pool: SharedMemoryPool, name: str, array: np.ndarray[Any, Any], dtype: int) -> int:
    return shm.save_record(
        pool, name=name, dtype=dtype, dims=array.shape, memory_type=0, memory_type_id=0,
        payload=array, byte_size=array.nbytes,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(np.float32, (1024,)), (np.int64, (2, 3, 4)), (np.bool_, (7,)), (np.float16, ()),
     (np.uint8, (SMALL,)), (np.int16, (3, 1, 2, 1, 1))],
)  # fmt: skip
def test_small_save_writes_the_general_record(
    pool: SharedMemoryPool, small_saves: list[int], dtype: Any, shape: tuple[int, ...]
) -> None:
    array = (np.arange(int(np.prod(shape))) % 11).astype(dtype).reshape(shape)
    tensor = Tensor("INPUT0", array)
    handle = tensor.save_to_shared_memory(pool)
    assert small_saves == [handle]
    general = _general(pool, "INPUT0", array, int(tensor.triton_dtype()))
    assert _raw(pool, handle, len(shape)) == _raw(pool, general, len(shape))
    # The message and the saver's reference, as save_and_load_record gives.
    assert (pool.refcount(handle), pool.pending_messages(handle)) == (2, 1)
    # The saver's data is now the pool's copy, of the same dtype and shape.
    saved = tensor.as_numpy()
    assert saved.dtype == array.dtype
    assert saved.shape == shape
    assert np.shares_memory(saved, shm.load_record(pool, handle).payload)
    loaded = Tensor.load_from_shared_memory(pool, handle)
    assert (loaded.name(), loaded.triton_dtype(), loaded.shape()) == (
        "INPUT0", tensor.triton_dtype(), list(shape)
    )
    np.testing.assert_array_equal(loaded.as_numpy(), array)
    assert pool.pending_messages(handle) == 0
    pool.release(general)
    del tensor, saved, loaded
    gc.collect()


def test_second_save_adds_a_message_without_a_copy(
    pool: SharedMemoryPool, small_saves: list[int]
) -> None:
    tensor = Tensor("x", np.ones(16, np.float32))
    h1 = tensor.save_to_shared_memory(pool)
    h2 = tensor.save_to_shared_memory(pool)
    assert h1 == h2
    assert small_saves == [h1]
    assert pool.pending_messages(h1) == 2
    pool.release(h1)
    pool.release(h2)


def _bf16_tensor() -> Tensor:
    bits = np.arange(4, dtype=np.uint16)
    return Tensor.from_dlpack(
        "bf16", dl.BufferExporter(bits, bits.ctypes.data, (4,), None, dl.DataType(4, 16, 1))
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: Tensor("big", np.zeros(SMALL + 1, np.uint8)),  # over the size
        lambda: Tensor("bytes", np.array([b"ab", b"c"], dtype=object)),  # serialized
        lambda: Tensor("naïve", np.zeros(4, np.float32)),  # not ASCII
        _bf16_tensor,  # kept through DLPack
    ],
    ids=["large", "bytes", "non-ascii-name", "bf16"],
)
def test_other_tensors_take_the_general_path(
    pool: SharedMemoryPool, small_saves: list[int], make: Callable[[], Tensor]
) -> None:
    tensor = make()
    before = tensor.as_numpy().copy() if tensor.triton_dtype() != TritonDtype.TYPE_BF16 else None
    handle = tensor.save_to_shared_memory(pool)
    assert small_saves == []
    loaded = Tensor.load_from_shared_memory(pool, handle)
    assert (loaded.name(), loaded.triton_dtype(), loaded.shape()) == (
        tensor.name(), tensor.triton_dtype(), tensor.shape()
    )
    if before is not None:
        np.testing.assert_array_equal(loaded.as_numpy(), before)
    del tensor, loaded
    gc.collect()


def test_small_save_grows_the_pool(small_saves: list[int]) -> None:
    name = f"pbt_small_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        tensors = [Tensor(f"t{i}", np.full(SMALL // 4, i, np.float32)) for i in range(4)]
        handles = [t.save_to_shared_memory(pool) for t in tensors]
        assert small_saves == handles
        assert pool.stats().size > 1 << 16
        for i, h in enumerate(handles):
            loaded = Tensor.load_from_shared_memory(pool, h)
            assert loaded.as_numpy()[0] == i
            del loaded
        del tensors
        gc.collect()
        assert pool.stats().allocations == 0


def test_small_save_errors_are_the_general_ones(small_saves: list[int]) -> None:
    name = f"pbt_small_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, max_size=1 << 16, name=name) as pool:
        taken = pool.allocate(40 << 10)
        array = np.zeros(30 << 10, np.uint8)  # small enough for the path, not for the pool
        with pytest.raises(TritonModelException) as fast:
            Tensor("x", array).save_to_shared_memory(pool)
        with pytest.raises(TritonModelException) as general:
            _general(pool, "x", array, int(TritonDtype.TYPE_UINT8))
        assert str(fast.value) == str(general.value)
        assert "Failed to increase the shared memory pool size" in str(fast.value)
        assert small_saves == []
        assert pool.stats().allocations == 1
        pool.decref(taken)
    with pytest.raises(TritonModelException, match="is closed"):
        Tensor("x", np.zeros(4, np.float32)).save_to_shared_memory(pool)


# ------------------------------------------------------------------ one-read record parse


def _corrupt_and_load(pool: SharedMemoryPool, fmt: str, at: int, value: Any) -> str:
    """Save a record of the layout loaded just before, corrupt one field, load it."""
    warm = Tensor("INPUT0", np.zeros((2, 3), np.float32))
    Tensor.load_from_shared_memory(pool, warm.save_to_shared_memory(pool))
    handle = Tensor("INPUT0", np.ones((2, 3), np.float32)).save_to_shared_memory(pool)
    view = pool.view(handle)
    struct.pack_into(fmt, view.data, at, value)
    try:
        with pytest.raises(TritonModelException) as info:
            Tensor.load_from_shared_memory(pool, handle)
    finally:
        del view
        pool.release(handle)
    return str(info.value)


# Offsets in a record with 2 dims and a 6-byte name: TensorShm 24, dims 16, StringShm 16,
# name 6, then MemoryShm (Q ? 7x Q i 4x q Q Q) at 62.
@pytest.mark.parametrize(
    ("fmt", "at", "value", "expected"),
    [
        ("=q", 0, 4096, "memory handle 4096"),
        ("=i", 8, 99, "dtype 99 is not a TRITONSERVER_DataType"),
        ("=i", 8, 0, "dtype 0 (TYPE_INVALID)"),
        ("=q", 24, -2, "dims [-2, 3] has a negative dimension"),
        ("=q", 24, -1, "dims [-1, 3] has a negative dimension"),
        ("=B", 56, 0xFF, "name is not valid UTF-8"),
        ("=i", 62 + 24, 7, "memory_type 7 is not 0, 1 or 2"),
        ("=q", 62 + 32, -1, "memory_type_id -1 is negative"),
        ("=Q", 62 + 40, 20, "byte_size 20 does not match dims [2, 3] of dtype 11"),
        ("=Q", 62 + 40, 1 << 20, "runs past the end"),
    ],
)
def test_one_read_parse_names_the_corrupted_field(
    pool: SharedMemoryPool, fmt: str, at: int, value: Any, expected: str
) -> None:
    message = _corrupt_and_load(pool, fmt, at, value)
    assert message.startswith("Corrupted tensor record at shared memory handle ")
    assert expected in message
    gc.collect()


def test_one_read_parse_checks_bytes_records(pool: SharedMemoryPool) -> None:
    # A BYTES record of the layout just read: its byte_size must hold a length per element.
    strings = np.array([b"ab", b"c", b"", b"def"], dtype=object)
    warm = Tensor("S", strings)
    loaded = Tensor.load_from_shared_memory(pool, warm.save_to_shared_memory(pool))
    assert loaded.as_numpy().tolist() == strings.tolist()
    handle = Tensor("S", strings).save_to_shared_memory(pool)
    view = pool.view(handle)
    at = _TENSOR_SHM.size + 8 + 16 + 1 + 8 + 8 + 8 + 4 + 4 + 8  # MemoryShm byte_size, 1 dim
    assert struct.unpack_from("=Q", view.data, at)[0] == 4 * 4 + 6
    struct.pack_into("=Q", view.data, at, 15)
    with pytest.raises(TritonModelException, match="byte_size 15 cannot hold 4 BYTES elements"):
        Tensor.load_from_shared_memory(pool, handle)
    del view, warm, loaded
    pool.release(handle)
    gc.collect()


def test_one_read_parse_agrees_with_the_checked_read(pool: SharedMemoryPool) -> None:
    # Records of every layout, loaded in turn so that each is read both ways.
    arrays: list[np.ndarray[Any, Any]] = [
        np.zeros((2, 3), np.float32), np.arange(5, dtype=np.int8), np.array(2.5),
        np.zeros((0, 3), np.float64), np.ones((1, 1, 1, 2), np.uint16),
        np.array([b"x", b"yz"], dtype=object),
    ]
    for _ in range(2):
        for i, array in enumerate(arrays):
            handle = Tensor(f"t{i}", array).save_to_shared_memory(pool)
            first = shm.load_record(pool, handle)
            again = shm.load_record(pool, handle)  # the same layout as the one just read
            assert first[:-1] == again[:-1]
            assert (first.name, first.dims) == (f"t{i}", array.shape)
            np.testing.assert_array_equal(
                Tensor.load_from_shared_memory(pool, handle).as_numpy(), array
            )
            del first, again
            gc.collect()


# -------------------------------------------------------------------- one-expression check
class _Handle(int):
    pass


def test_block_check_takes_int_subclasses_and_refuses_bools(pool: SharedMemoryPool) -> None:
    handle = Tensor("x", np.zeros(4, np.float32)).save_to_shared_memory(pool)
    assert pool.refcount(_Handle(handle)) == 1
    with pytest.raises(TritonModelException, match="must be an int, not bool"):
        pool.refcount(True)
    with pytest.raises(TritonModelException, match=f"handle {handle + 64} is out of range|"
                       f"handle {handle + 64} does not point"):  # fmt: skip
        pool.refcount(handle + 64)
    pool.release(handle)
    with pytest.raises(TritonModelException, match="refers to freed memory"):
        pool.refcount(handle)


_FORK_CHECK = """
import os, sys
from pb_tensor.shm import _heap as heap
assert heap._pid[0] == os.getpid()
pid = os.fork()
if pid == 0:
    os._exit(0 if heap._pid[0] == os.getpid() else 1)
_, status = os.waitpid(pid, 0)
sys.exit(3 if not os.WIFEXITED(status) else os.WEXITSTATUS(status))
"""


def test_dirty_word_holds_this_process_id() -> None:
    # The cached id is this process's, in a forked child too (checked in a fresh interpreter:
    # this one may run threads that make fork unsafe).
    done = subprocess.run(
        [sys.executable, "-c", _FORK_CHECK], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
