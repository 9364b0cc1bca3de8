"""Tensor.save_to_shared_memory / Tensor.load_from_shared_memory.

Round trips for every dtype (BYTES, BF16, 0-d and empty included), idempotent saves, zero-copy
loads, exports that keep the allocation alive, and both directions across a spawn child. The
pool and record layer itself is tested in test_shm.py / test_shm_multiprocess.py.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import dlpack_ctypes as dl
from pb_tensor import MemoryType, Tensor, TritonDtype, TritonModelException, shm
from pb_tensor.shm import SharedMemoryPool

NUMERIC = [np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32,
           np.int64, np.float16, np.float32, np.float64]
SHAPES = [(), (0,), (1, 0), (5,), (2, 3), (3, 1, 2)]
BF16 = dl.DataType(4, 16, 1)
CTX = mp.get_context("spawn")
TIMEOUT = 60


@pytest.fixture
def pool() -> Iterator[SharedMemoryPool]:
    name = f"pbt_tensor_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as p:
        yield p
        stats = p.stats()
        if stats.allocations:  # a reference cycle may still hold a view: collect, then judge
            gc.collect()
            stats = p.stats()
        assert (stats.allocations, stats.used) == (0, 0), f"leaked allocations: {stats}"
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name)), "segment left in /dev/shm"


def _values(dtype: Any, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    n = int(np.prod(shape))
    return (np.arange(n) % 7 + 1).astype(dtype).reshape(shape)


def _payload_view(pool: SharedMemoryPool, handle: int) -> np.ndarray[Any, Any]:
    return shm.load_record(pool, handle).payload


def _bf16(values: list[float], shape: tuple[int, ...]) -> tuple[Tensor, np.ndarray[Any, Any]]:
    """A BF16 Tensor (bfloat16 = the top half of a float32) over uint16 host memory."""
    f32 = np.array(values, dtype=np.float32).reshape(shape)
    bits = np.asarray((f32.view(np.uint32) >> 16).astype(np.uint16))
    t = Tensor.from_dlpack("bf16", dl.BufferExporter(bits, bits.ctypes.data, shape, None, BF16))
    return t, bits


def _raw(t: Tensor) -> np.ndarray[Any, Any]:
    """The tensor's bytes through DLPack (works for BF16 without ml_dtypes)."""
    return dl.from_dlpack(t).numpy(raw=True)


@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: np.dtype(d).name)
def test_round_trip_numeric(pool: SharedMemoryPool, dtype: Any) -> None:
    for shape in SHAPES:
        _check_round_trip(pool, _values(dtype, shape))


def _check_round_trip(pool: SharedMemoryPool, a: np.ndarray[Any, Any]) -> None:
    t = Tensor("INPUT0", a)
    handle = t.save_to_shared_memory(pool)
    loaded = Tensor.load_from_shared_memory(pool, handle)
    assert loaded.name() == "INPUT0"
    assert loaded.shape() == list(a.shape)
    assert loaded.triton_dtype() is t.triton_dtype()
    assert loaded.memory_type is MemoryType.CPU
    assert loaded.is_cpu()
    assert loaded.byte_size == a.nbytes
    out = loaded.as_numpy()
    assert out.dtype == a.dtype
    assert out.shape == a.shape
    np.testing.assert_array_equal(out, a)
    assert loaded.as_numpy() is out
    np.testing.assert_array_equal(np.from_dlpack(loaded), a)
    if a.size:
        payload = _payload_view(pool, handle)
        assert np.shares_memory(out, payload)  # zero copy out of the pool
        assert out.ctypes.data % shm.PAYLOAD_ALIGNMENT == 0
        assert loaded.data_ptr == payload.ctypes.data
        assert np.shares_memory(Tensor.load_from_shared_memory(pool, handle).as_numpy(), out)
        assert not np.shares_memory(out, a)  # saving copies once, into the pool


@pytest.mark.parametrize(
    "array",
    [
        np.array(["abc", b"d\x00e", 7, "\U0001f600"], dtype=object),
        np.array([[b"ab", b"c"], [b"", b"xyz"]]),
        np.array(b"zero-d", dtype=object),
        np.empty((2, 0), dtype=object),
        np.empty(0, dtype="S3"),
    ],
    ids=["object", "S-2d", "0-d", "empty-object", "empty-S"],
)
def test_round_trip_bytes(pool: SharedMemoryPool, array: np.ndarray[Any, Any]) -> None:
    t = Tensor("TEXT", array)
    size = t.byte_size
    handle = t.save_to_shared_memory(pool)
    loaded = Tensor.load_from_shared_memory(pool, handle)
    assert loaded.triton_dtype() is TritonDtype.TYPE_BYTES
    assert loaded.shape() == list(array.shape)
    assert loaded.byte_size == size
    out = loaded.as_numpy()
    # As upstream after a round trip: an object array of bytes with the tensor's dims.
    assert out.dtype == object
    assert out.shape == array.shape
    assert all(type(x) is bytes for x in out.reshape(-1))
    expected = [x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1).tolist()]
    assert out.reshape(-1).tolist() == expected
    with pytest.raises(TritonModelException, match="string tensors"):
        loaded.to_dlpack()


@pytest.mark.parametrize("shape", [(3,), (), (0,), (2, 0)], ids=str)
def test_round_trip_bf16(pool: SharedMemoryPool, shape: tuple[int, ...]) -> None:
    t, bits = _bf16([1.5, -2.25, 3.0][: int(np.prod(shape))], shape)
    handle = t.save_to_shared_memory(pool)
    loaded = Tensor.load_from_shared_memory(pool, handle)
    assert loaded.triton_dtype() is TritonDtype.TYPE_BF16
    assert loaded.shape() == list(shape)
    assert loaded.byte_size == 2 * int(np.prod(shape))
    raw = _raw(loaded)
    assert raw.tolist() == bits.tolist()
    if raw.size:
        assert np.shares_memory(raw, _payload_view(pool, handle))
    try:
        import ml_dtypes
    except ImportError:
        with pytest.raises(TritonModelException, match="BF16"):
            loaded.as_numpy()
    else:
        assert loaded.as_numpy().dtype == ml_dtypes.bfloat16
    del raw


def test_save_is_idempotent(pool: SharedMemoryPool) -> None:
    a = np.arange(6, dtype=np.int32)
    t = Tensor("x", a)
    handle = t.save_to_shared_memory(pool)
    assert t.save_to_shared_memory(pool) == handle
    assert t.save_to_shared_memory(pool) == handle
    assert pool.stats().allocations == 1
    # The tensor now views its pool copy, with the same values.
    np.testing.assert_array_equal(t.as_numpy(), a)
    assert np.shares_memory(t.as_numpy(), _payload_view(pool, handle))
    assert t.data_ptr == _payload_view(pool, handle).ctypes.data
    # One copy, but each save handed out a message: three loads (or releases) are owed.
    assert pool.pending_messages(handle) == 3
    for _ in range(3):
        pool.release(handle)
    assert pool.refcount(handle) == 1  # the tensor's own


def test_add_message_hands_out_a_loaded_record_again(pool: SharedMemoryPool) -> None:
    a = np.arange(4, dtype=np.float32)
    handle = Tensor("x", a).save_to_shared_memory(pool)
    loaded = Tensor.load_from_shared_memory(pool, handle)
    assert pool.pending_messages(handle) == 0
    assert pool.add_message(handle) == handle  # no copy: one more message on the record
    assert (pool.pending_messages(handle), pool.stats().allocations) == (1, 1)
    again = Tensor.load_from_shared_memory(pool, handle)
    assert again.data_ptr == loaded.data_ptr
    np.testing.assert_array_equal(again.as_numpy(), a)
    assert pool.add_message(handle) == handle
    pool.release(handle)
    del loaded, again
    assert pool.stats().allocations == 0
    with pytest.raises(TritonModelException, match=f"Shared memory handle {handle}"):
        pool.add_message(handle)


def test_save_to_two_pools(pool: SharedMemoryPool) -> None:
    t = Tensor("x", np.arange(3, dtype=np.float64))
    h1 = t.save_to_shared_memory(pool)
    with SharedMemoryPool.create(1 << 16, name=f"pbt_tensor2_{uuid.uuid4().hex[:12]}") as other:
        h2 = t.save_to_shared_memory(other)
        loaded = Tensor.load_from_shared_memory(other, h2)
        np.testing.assert_array_equal(loaded.as_numpy(), [0.0, 1.0, 2.0])
        del loaded, t
        assert other.stats().allocations == 0
    pool.release(h1)


def test_save_dlpack_imported_tensor(pool: SharedMemoryPool) -> None:
    a = np.arange(8, dtype=np.uint16).reshape(2, 4)
    t = Tensor.from_dlpack("x", dl.BufferExporter.from_numpy(a))
    handle = t.save_to_shared_memory(pool)
    loaded = Tensor.load_from_shared_memory(pool, handle)
    np.testing.assert_array_equal(loaded.as_numpy(), a)
    del t
    # The saver's producer export is released once the data lives in the pool.
    assert dl.live_exports() == 0
    np.testing.assert_array_equal(loaded.as_numpy(), a)


def test_saving_non_contiguous_input(pool: SharedMemoryPool) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4).T
    t = Tensor("x", a)
    loaded = Tensor.load_from_shared_memory(pool, t.save_to_shared_memory(pool))
    np.testing.assert_array_equal(loaded.as_numpy(), a)


def test_exports_keep_the_allocation_alive(pool: SharedMemoryPool) -> None:
    a = np.arange(6, dtype=np.float64)
    t = Tensor("x", a)
    handle = t.save_to_shared_memory(pool)
    loaded = Tensor.load_from_shared_memory(pool, handle)
    as_np = np.from_dlpack(loaded)
    capsule = loaded.__dlpack__(max_version=(1, 0))
    legacy = loaded.to_dlpack()
    again = Tensor.from_dlpack("again", loaded)
    del t, loaded
    assert pool.stats().allocations == 1  # still referenced by the exports
    np.testing.assert_array_equal(as_np, a)
    np.testing.assert_array_equal(dl.consume(capsule).numpy(), a)
    np.testing.assert_array_equal(dl.consume(legacy).numpy(), a)
    np.testing.assert_array_equal(again.as_numpy(), a)
    del as_np, capsule, legacy, again
    assert pool.stats().allocations == 0
    assert dl.live_exports() == 0


def test_exports_to_torch_keep_the_allocation_alive(pool: SharedMemoryPool) -> None:
    torch = pytest.importorskip("torch")
    t = Tensor("x", np.arange(4, dtype=np.int64))
    loaded = Tensor.load_from_shared_memory(pool, t.save_to_shared_memory(pool))
    tt = torch.from_dlpack(loaded)
    assert tt.data_ptr() == loaded.data_ptr
    del t, loaded
    assert pool.stats().allocations == 1
    assert tt.tolist() == [0, 1, 2, 3]
    del tt
    assert pool.stats().allocations == 0


def test_dropping_everything_frees_the_record(pool: SharedMemoryPool) -> None:
    t = Tensor("x", np.zeros(100, dtype=np.float32))
    handle = t.save_to_shared_memory(pool)
    loads = [Tensor.load_from_shared_memory(pool, handle) for _ in range(3)]
    assert pool.refcount(handle) == 4
    del loads
    assert pool.refcount(handle) == 1
    del t
    assert pool.stats().allocations == 0


def test_bad_handle(pool: SharedMemoryPool) -> None:
    with pytest.raises(TritonModelException):
        Tensor.load_from_shared_memory(pool, 12345)


# ------------------------------------------------------------------------------ across processes


def _spawn_child(name: str, handle: int, results: Any, done: Any) -> None:
    pool = SharedMemoryPool.attach(name)
    loaded = Tensor.load_from_shared_memory(pool, handle)
    got = (loaded.name(), loaded.shape(), int(loaded.triton_dtype()), loaded.as_numpy().tolist())
    text = Tensor("FROM_CHILD", np.array([b"child", "\u00e9"], dtype=object))
    numbers = Tensor("NUMBERS", np.arange(10, dtype=np.int16).reshape(2, 5))
    results.put((got, text.save_to_shared_memory(pool), numbers.save_to_shared_memory(pool)))
    done.wait(TIMEOUT)  # keep the saved tensors alive until the parent has loaded them
    del loaded, text, numbers
    pool.close()


def test_spawn_child_both_directions(pool: SharedMemoryPool) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    parent = Tensor("FROM_PARENT", a)
    handle = parent.save_to_shared_memory(pool)
    results = CTX.Queue()
    done = CTX.Event()
    child = CTX.Process(target=_spawn_child, args=(pool.name, handle, results, done))
    child.start()
    try:
        got, text_handle, numbers_handle = results.get(timeout=TIMEOUT)
        text = Tensor.load_from_shared_memory(pool, text_handle)
        numbers = Tensor.load_from_shared_memory(pool, numbers_handle)
    finally:
        done.set()
        child.join(TIMEOUT)
    assert child.exitcode == 0
    assert got == ("FROM_PARENT", [2, 3], int(TritonDtype.TYPE_FP32), a.tolist())
    # The child is gone; our loads keep its records alive.
    assert text.name() == "FROM_CHILD"
    assert text.as_numpy().tolist() == [b"child", "\u00e9".encode()]
    assert numbers.shape() == [2, 5]
    np.testing.assert_array_equal(numbers.as_numpy(), np.arange(10).reshape(2, 5))
    assert pool.refcount(handle) == 1  # the child's load was given back
    del text, numbers, parent
