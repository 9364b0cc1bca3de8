"""The control channel between the runtime and a stub: small tensors travel in one pack per
message, larger and serialized ones in records of their own."""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing import Pipe

import numpy as np
import pytest

from pb_tensor import Tensor, TritonDtype
from pb_tensor.runtime._channel import PACK_MAX, PACK_TENSOR_MAX, Channel
from pb_tensor.shm import SharedMemoryPool


@pytest.fixture
def pair() -> Iterator[tuple[Channel, Channel, SharedMemoryPool]]:
    pool = SharedMemoryPool.create(1 << 22)
    ours, theirs = Pipe()
    try:
        yield Channel(ours, pool), Channel(theirs, pool), pool
    finally:
        ours.close()
        theirs.close()
        pool.close()


def _arrays() -> dict[str, np.ndarray]:
    return {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([True, False, True]),
        "f16": np.full((1, 5), 1.5, np.float16),
        "i64": np.array(-7, dtype=np.int64),  # 0-d
        "empty": np.zeros((0, 4), np.int32),
        "u8": np.arange(65, dtype=np.uint8),  # not a multiple of the alignment
        "strided": np.arange(20, dtype=np.int16)[::2],  # not contiguous
    }


def test_small_tensors_travel_in_one_allocation(
    pair: tuple[Channel, Channel, SharedMemoryPool],
) -> None:
    sender, receiver, pool = pair
    arrays = _arrays()
    sender.send("x", {"k": 1}, [Tensor(n, a) for n, a in arrays.items()])
    assert pool.stats().allocations == 1  # one record per tensor before packs: 7
    kind, tensors, body = receiver.recv()
    assert (kind, body) == ("x", {"k": 1})
    assert [t.name() for t in tensors] == list(arrays)
    for t, (name, a) in zip(tensors, arrays.items()):
        got = t.as_numpy()
        assert (got.dtype, got.shape) == (a.dtype, a.shape), name
        np.testing.assert_array_equal(got, a)
        assert got.flags.c_contiguous, name
        assert got.flags.writeable, name
        assert got.ctypes.data % 64 == 0 or got.nbytes == 0, name
    assert tensors[2].dtype == TritonDtype.TYPE_FP16
    # The receiver's tensors keep the pack alive; once they and the sender's hold (released
    # by the receiver's next message) are gone, nothing is left.
    receiver.send("ack")
    sender.recv()
    assert pool.stats().allocations == 1
    del tensors, t, got
    assert pool.stats().allocations == 0


def test_large_and_serialized_tensors_keep_their_records(
    pair: tuple[Channel, Channel, SharedMemoryPool],
) -> None:
    sender, receiver, pool = pair
    big = np.arange(PACK_TENSOR_MAX // 4 + 1, dtype=np.float32)
    words = np.array([b"a", b"bc"], dtype=np.object_)
    small = [Tensor(f"s{i}", np.full(3, i, np.int32)) for i in range(3)]
    sender.send("x", None, [small[0], Tensor("big", big), small[1], Tensor("words", words),
                            small[2]])  # fmt: skip
    assert pool.stats().allocations == 3  # the pack, "big", "words"
    _, tensors, _ = receiver.recv()
    assert [t.name() for t in tensors] == ["s0", "big", "s1", "words", "s2"]
    np.testing.assert_array_equal(tensors[1].as_numpy(), big)
    assert tensors[3].as_numpy().tolist() == [b"a", b"bc"]
    assert [tensors[i].as_numpy().tolist() for i in (0, 2, 4)] == [[0] * 3, [1] * 3, [2] * 3]


def test_a_lone_small_tensor_keeps_its_record(
    pair: tuple[Channel, Channel, SharedMemoryPool],
) -> None:
    sender, receiver, pool = pair
    tensor = Tensor("one", np.ones(4, np.float32))
    handle = tensor.save_to_shared_memory(pool)  # already in the pool: saved again, no copy
    pool.release(handle)
    sender.send("x", None, [tensor])
    assert pool.stats().allocations == 1
    _, (loaded,), _ = receiver.recv()
    assert loaded.as_numpy().tolist() == [1.0] * 4
    assert pool.stats().allocations == 1


def test_a_pack_holds_at_most_pack_max_bytes(
    pair: tuple[Channel, Channel, SharedMemoryPool],
) -> None:
    sender, receiver, pool = pair
    count = PACK_MAX // PACK_TENSOR_MAX + 2
    arrays = [np.full(PACK_TENSOR_MAX // 4, i, np.float32) for i in range(count)]
    sender.send("x", None, [Tensor(f"t{i}", a) for i, a in enumerate(arrays)])
    # 16 fill the pack; the other two travel as records.
    assert pool.stats().allocations == 3
    _, tensors, _ = receiver.recv()
    for t, a in zip(tensors, arrays):
        np.testing.assert_array_equal(t.as_numpy(), a)


def test_a_pack_of_empty_tensors(pair: tuple[Channel, Channel, SharedMemoryPool]) -> None:
    sender, receiver, pool = pair
    sender.send("x", None, [Tensor("a", np.zeros((0, 4), np.float32)),
                            Tensor("b", np.zeros(0, np.int8))])  # fmt: skip
    _, tensors, _ = receiver.recv()
    assert [(t.name(), t.as_numpy().shape, t.as_numpy().dtype) for t in tensors] == [
        ("a", (0, 4), np.float32), ("b", (0,), np.int8)
    ]
    del tensors
    assert pool.stats().allocations == 0
