"""Tensor.load_many_from_shared_memory: one lock cycle for a message's tensors, with the
tensors, references and errors of loading them one by one."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from pb_tensor import Tensor, TritonDtype, TritonModelException
from pb_tensor.shm import SharedMemoryPool


@pytest.fixture
def pool() -> Iterator[SharedMemoryPool]:
    name = f"pbt_many_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as p:
        yield p
        gc.collect()
        stats = p.stats()
        assert (stats.allocations, stats.used) == (0, 0), f"leaked allocations: {stats}"


def _mixed() -> list[Tensor]:
    big = np.arange(5000, dtype=np.float64).reshape(50, 100)  # past the small-transfer path
    return [
        Tensor("A", np.arange(16, dtype=np.float32)[None, :]),
        Tensor("B", np.array([b"x", b"", b"yz"], dtype=np.object_)),
        Tensor("C", big),
        Tensor("D", np.zeros((0, 3), dtype=np.int8)),
        Tensor("E", np.array(7, dtype=np.int64)),
    ]


def test_same_tensors_as_single_loads(pool: SharedMemoryPool) -> None:
    saved = _mixed()
    handles = [t.save_to_shared_memory(pool) for t in saved]
    loaded = Tensor.load_many_from_shared_memory(pool, handles)
    assert [t.name() for t in loaded] == ["A", "B", "C", "D", "E"]
    for got, want in zip(loaded, saved):
        assert got.triton_dtype() == want.triton_dtype()
        assert got.shape() == want.shape()
        np.testing.assert_array_equal(got.as_numpy(), want.as_numpy())
    assert loaded[1].triton_dtype() == TritonDtype.TYPE_BYTES
    # Zero-copy, and the messages are taken over: nothing is pending any more.
    assert [pool.pending_messages(h) for h in handles] == [0] * 5
    assert [pool.refcount(h) for h in handles] == [2] * 5  # the saver's and the loader's
    loaded[0].as_numpy()[0, 0] = 42.0
    assert saved[0].as_numpy()[0, 0] == 42.0
    del loaded, got  # the loop variable holds the last one
    assert [pool.refcount(h) for h in handles] == [1] * 5
    assert Tensor.load_many_from_shared_memory(pool, []) == []


def test_first_bad_handle_stops_the_load(pool: SharedMemoryPool) -> None:
    saved = _mixed()[:3]
    handles = [t.save_to_shared_memory(pool) for t in saved]
    bad = handles[2] + 8  # not a block start
    with pytest.raises(TritonModelException) as single:
        Tensor.load_from_shared_memory(pool, bad)
    with pytest.raises(TritonModelException) as many:
        Tensor.load_many_from_shared_memory(pool, [handles[0], bad, handles[1]])
    assert str(many.value) == str(single.value)
    # The load before the bad handle happened (its message taken, the tensor dropped); the
    # handle after it was left alone, its message still pending for a later load.
    assert pool.pending_messages(handles[0]) == 0
    assert pool.refcount(handles[0]) == 1
    assert pool.pending_messages(handles[1]) == 1
    (late,) = Tensor.load_many_from_shared_memory(pool, [handles[1]])
    np.testing.assert_array_equal(late.as_numpy(), saved[1].as_numpy())
    assert pool.pending_messages(handles[1]) == 0
    pool.release(handles[2])


def test_save_many_same_records_as_single_saves(pool: SharedMemoryPool) -> None:
    small = [Tensor(f"S{i}", np.arange(16, dtype=np.float32) + i) for i in range(4)]
    handles = Tensor.save_many_to_shared_memory(pool, small)
    assert len(set(handles)) == 4
    assert [pool.pending_messages(h) for h in handles] == [1] * 4
    assert [pool.refcount(h) for h in handles] == [2] * 4  # the message and the saver's
    # The savers now view the pool's copies; a second save forwards the same record.
    assert Tensor.save_many_to_shared_memory(pool, small[:2]) == handles[:2]
    assert [pool.pending_messages(h) for h in handles[:2]] == [2, 2]
    for h in handles[:2]:
        pool.release(h)
    loaded = Tensor.load_many_from_shared_memory(pool, handles)
    for i, t in enumerate(loaded):
        assert t.name() == f"S{i}"
        np.testing.assert_array_equal(t.as_numpy(), np.arange(16, dtype=np.float32) + i)
    loaded[3].as_numpy()[0] = -1.0
    assert small[3].as_numpy()[0] == -1.0  # zero-copy both ways
    # Tensors that leave the small path are saved one by one, with the same results.
    mixed = _mixed()
    mixed_handles = Tensor.save_many_to_shared_memory(pool, mixed)
    again = Tensor.load_many_from_shared_memory(pool, mixed_handles)
    for got, want in zip(again, mixed):
        np.testing.assert_array_equal(got.as_numpy(), want.as_numpy())
    assert Tensor.save_many_to_shared_memory(pool, []) == []


def test_save_many_that_cannot_grow_gives_back_its_messages() -> None:
    name = f"pbt_many_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, max_size=1 << 16, name=name) as pool:
        tensors = [Tensor(f"T{i}", np.zeros(3000, dtype=np.float32)) for i in range(8)]
        with pytest.raises(TritonModelException) as many:
            Tensor.save_many_to_shared_memory(pool, tensors)
        assert str(many.value).startswith("Failed to increase the shared memory pool size")
        gc.collect()
        stats = pool.stats()
        assert (stats.allocations, stats.unloaded_records) == (0, 0), stats
        assert all(t._shm is None for t in tensors)  # nothing was adopted
