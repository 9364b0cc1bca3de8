"""The control channel between the runtime and a stub: small tensors travel in one pack per
message (inside the message itself while it is small), larger and serialized ones in records
of their own. The pack tests use channels that send every pack as a record."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from multiprocessing import Pipe

import numpy as np
import pytest

from pb_tensor import Tensor, TritonDtype
from pb_tensor.runtime._channel import INLINE_MAX, PACK_MAX, PACK_TENSOR_MAX, Channel
from pb_tensor.shm import SharedMemoryPool


def _pair(inline_max: int) -> Iterator[tuple[Channel, Channel, SharedMemoryPool]]:
    pool = SharedMemoryPool.create(1 << 22)
    ours, theirs = Pipe()
    try:
        yield (Channel(ours, pool, inline_max=inline_max),
               Channel(theirs, pool, inline_max=inline_max), pool)  # fmt: skip
    finally:
        ours.close()
        theirs.close()
        pool.close()


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Channel, Channel, SharedMemoryPool]]:
    """Channels that send every pack as a record (or, parametrized, up to ``param`` bytes
    inside the message)."""
    yield from _pair(getattr(request, "param", 0))


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


def _check_received(tensors: list[Tensor], arrays: dict[str, np.ndarray]) -> None:
    """``tensors`` hold ``arrays``' names and values: C-contiguous, writable."""
    assert [t.name() for t in tensors] == list(arrays)
    for t, (name, a) in zip(tensors, arrays.items()):
        got = t.as_numpy()
        assert (got.dtype, got.shape) == (a.dtype, a.shape), name
        np.testing.assert_array_equal(got, a)
        assert got.flags.c_contiguous, name
        assert got.flags.writeable, name


def test_small_tensors_travel_in_one_allocation(
    pair: tuple[Channel, Channel, SharedMemoryPool],
) -> None:
    sender, receiver, pool = pair
    arrays = _arrays()
    sender.send("x", {"k": 1}, [Tensor(n, a) for n, a in arrays.items()])
    assert pool.stats().allocations == 1  # one record per tensor before packs: 7
    kind, tensors, body = receiver.recv()
    assert (kind, body) == ("x", {"k": 1})
    _check_received(tensors, arrays)
    for t in tensors:
        got = t.as_numpy()
        assert got.ctypes.data % 64 == 0 or got.nbytes == 0, t.name()
    assert tensors[2].dtype == TritonDtype.TYPE_FP16
    # The receiver's tensors keep the pack alive; once they and the sender's hold (released
    # by the receiver's next message) are gone, nothing is left.
    receiver.send("ack")
    sender.recv()
    assert pool.stats().allocations == 1
    del tensors, t, got
    assert pool.stats().allocations == 0


@pytest.mark.parametrize("pair", [0, INLINE_MAX], ids=["pack_record", "pack_inline"],
                         indirect=True)  # fmt: skip
def test_large_and_serialized_tensors_keep_their_records(
    pair: tuple[Channel, Channel, SharedMemoryPool],
) -> None:
    sender, receiver, pool = pair
    inline_max = sender.inline_max
    big = np.arange(PACK_TENSOR_MAX // 4 + 1, dtype=np.float32)
    words = np.array([b"a", b"bc"], dtype=np.object_)
    small = [Tensor(f"s{i}", np.full(3, i, np.int32)) for i in range(3)]
    sender.send("x", None, [small[0], Tensor("big", big), small[1], Tensor("words", words),
                            small[2]])  # fmt: skip
    # "big", "words", and the pack unless it travels inside the message
    assert pool.stats().allocations == (3 if inline_max == 0 else 2)
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


@pytest.fixture
def chain(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[Channel, Channel, Channel, Channel, SharedMemoryPool]]:
    """Two channels on one pool, as the runtime's to two stubs: a -> b, then b's end c -> d
    (every pack a record; parametrized, up to ``param`` bytes inside the message)."""
    inline_max = getattr(request, "param", 0)
    pool = SharedMemoryPool.create(1 << 22)
    pipes = [Pipe(), Pipe()]
    try:
        a, b, c, d = (Channel(end, pool, inline_max=inline_max) for pipe in pipes for end in pipe)
        yield a, b, c, d, pool
    finally:
        for ours, theirs in pipes:
            ours.close()
            theirs.close()
        pool.close()


def test_views_of_a_received_pack_are_passed_on_without_a_copy(
    chain: tuple[Channel, Channel, Channel, Channel, SharedMemoryPool],
) -> None:
    # An ensemble's hop: a step's outputs, received in a pack, go on to the next step.
    a, b, c, d, pool = chain
    arrays = {"x": np.arange(6, dtype=np.float32), "y": np.arange(4, dtype=np.int64)}
    a.send("out", None, [Tensor(n, v) for n, v in arrays.items()])
    _, received, _ = b.recv()
    assert pool.stats().allocations == 1
    x, y = received
    # as they are, renamed (a new tensor over the same memory), and a contiguous slice
    passed = [x, Tensor.from_dlpack("y2", y), Tensor("x_tail", x.as_numpy()[2:])]
    c.send("in", None, passed)
    assert pool.stats().allocations == 1  # no new pack: one more message on the same record
    _, got, _ = d.recv()
    assert [t.name() for t in got] == ["x", "y2", "x_tail"]
    np.testing.assert_array_equal(got[0].as_numpy(), arrays["x"])
    np.testing.assert_array_equal(got[1].as_numpy(), arrays["y"])
    np.testing.assert_array_equal(got[2].as_numpy(), arrays["x"][2:])
    assert [t.data_ptr for t in got] == [t.data_ptr for t in passed]  # the same memory
    # Everything gone (and each sender's hold dropped by an answer): nothing left.
    b.send("ack")
    a.recv()
    d.send("ack")
    c.recv()
    del received, x, y, passed, got
    assert pool.stats().allocations == 0


def test_passed_on_views_and_new_tensors_share_one_message(
    chain: tuple[Channel, Channel, Channel, Channel, SharedMemoryPool],
) -> None:
    a, b, c, d, pool = chain
    a.send("out", None, [Tensor("x", np.ones(3, np.float32)), Tensor("z", np.zeros(2, np.int8))])
    _, (x, _z), _ = b.recv()
    new = [Tensor("n1", np.full(2, 7, np.int32)), Tensor("n2", np.full(2, 8, np.int32))]
    c.send("in", None, [new[0], x, new[1], Tensor("strided", x.as_numpy()[::2])])
    assert pool.stats().allocations == 2  # the received pack, and a new one for three tensors
    _, got, _ = d.recv()
    assert [t.as_numpy().tolist() for t in got] == [[7, 7], [1.0] * 3, [8, 8], [1.0, 1.0]]
    assert got[1].data_ptr == x.data_ptr
    assert got[3].data_ptr != x.data_ptr  # not contiguous: Tensor() copied it, so it is packed


def test_a_dead_packs_memory_is_never_named(
    chain: tuple[Channel, Channel, Channel, Channel, SharedMemoryPool],
) -> None:
    # Once a pack's views are gone its record is freed, and the next pack may reuse its
    # memory: a tensor there must be copied (a pack of its own), not passed by reference.
    a, b, c, d, pool = chain
    a.send("out", None, [Tensor("x", np.ones(4, np.float32)), Tensor("w", np.ones(1, np.int8))])
    _, first, _ = b.recv()
    address = first[0].data_ptr
    del first
    b.send("ack")
    a.recv()
    assert pool.stats().allocations == 0
    c.send("in", None, [Tensor("p", np.full(4, 2, np.float32)), Tensor("q", np.ones(1, np.int8))])
    assert pool.stats().allocations == 1
    _, got, _ = d.recv()
    assert got[0].data_ptr == address  # the freed memory was reused
    assert [t.as_numpy().tolist() for t in got] == [[2.0] * 4, [1]]


def test_received_bounds_cover_live_packs_only(
    chain: tuple[Channel, Channel, Channel, Channel, SharedMemoryPool],
) -> None:
    # The senders skip the locked look-up for addresses outside these bounds: they must
    # cover every live pack, and drop the dead ones (else every address would be looked up).
    from pb_tensor.runtime._channel import _received

    a, b, _c, _d, pool = chain
    a.send("out", None, [Tensor("x", np.ones(4, np.float32)), Tensor("w", np.ones(2, np.int8))])
    _, got, _ = b.recv()
    lo, hi = _received.bounds
    for t in got:
        assert lo <= t.data_ptr
        assert t.data_ptr + t.byte_size <= hi
    del got, t
    b.send("ack")
    a.recv()
    gc.collect()  # packs of earlier tests that cycles kept
    _received.find(0, 0, pool)  # the next look-up drops the dead packs
    assert len(_received) == 0
    assert _received.bounds == (0, 0)


@pytest.fixture
def inline_pair() -> Iterator[tuple[Channel, Channel, SharedMemoryPool]]:
    """Channels as the runtime makes them: small packs travel inside the messages."""
    yield from _pair(INLINE_MAX)


def test_a_small_pack_travels_inside_its_message(
    inline_pair: tuple[Channel, Channel, SharedMemoryPool],
) -> None:
    sender, receiver, pool = inline_pair
    arrays = _arrays()
    sender.send("x", {"k": 1}, [Tensor(n, a) for n, a in arrays.items()])
    assert pool.stats().allocations == 0  # no record: the bytes are in the message
    kind, tensors, body = receiver.recv()
    assert (kind, body) == ("x", {"k": 1})
    _check_received(tensors, arrays)  # writable too, as views of a record are
    for t in tensors:  # and aligned as they are (JAX imports only those without a copy)
        got = t.as_numpy()
        assert got.ctypes.data % 64 == 0 or got.nbytes == 0, t.name()
    got = tensors[0].as_numpy()
    got[0, 0] = 42  # the receiver's own memory: the sender's array is untouched
    assert arrays["f32"][0, 0] == 0
    assert pool.stats().allocations == 0


def test_a_pack_past_inline_max_is_a_record(
    inline_pair: tuple[Channel, Channel, SharedMemoryPool],
) -> None:
    sender, receiver, pool = inline_pair
    half = np.arange(INLINE_MAX // 8, dtype=np.float32)  # INLINE_MAX / 2 bytes
    small = [Tensor("a", half), Tensor("b", half + 1)]
    sender.send("x", None, small)  # exactly INLINE_MAX bytes: inside the message
    assert pool.stats().allocations == 0
    _, got, _ = receiver.recv()
    sender.send("x", None, [*small, Tensor("c", np.ones(1, np.int8))])  # one byte more
    assert pool.stats().allocations == 1
    _, more, _ = receiver.recv()
    np.testing.assert_array_equal(got[1].as_numpy(), half + 1)
    assert [t.as_numpy().tolist()[-1] for t in more] == [half[-1], half[-1] + 1, 1]
    del more
    receiver.send("ack")
    sender.recv()
    assert pool.stats().allocations == 0


def test_views_of_an_inline_pack_are_copied_when_passed_on(
    inline_pair: tuple[Channel, Channel, SharedMemoryPool],
) -> None:
    # Not in the pool, so there is no record to pass on by reference: they travel again.
    sender, receiver, pool = inline_pair
    sender.send("x", None, [Tensor("x", np.arange(4, dtype=np.float32))])
    _, (x,), _ = receiver.recv()
    receiver.send("y", None, [x, Tensor("tail", x.as_numpy()[2:])])
    assert pool.stats().allocations == 0
    _, got, _ = sender.recv()
    assert [t.as_numpy().tolist() for t in got] == [[0.0, 1.0, 2.0, 3.0], [2.0, 3.0]]
    assert got[0].data_ptr != x.data_ptr


@pytest.mark.parametrize("chain", [INLINE_MAX], indirect=True)
def test_a_received_record_pack_and_an_inline_pack_share_one_message(
    chain: tuple[Channel, Channel, Channel, Channel, SharedMemoryPool],
) -> None:
    # A stub passes on a view of a pack it received as a record (too big to travel inside)
    # together with a new small tensor, which travels inside the message.
    a, b, c, d, pool = chain
    halves = [np.full(INLINE_MAX // 4, i, np.float32) for i in (1, 2)]  # 2 x INLINE_MAX
    a.send("out", None, [Tensor("x", halves[0]), Tensor("y", halves[1])])
    assert pool.stats().allocations == 1  # one pack, as a record
    _, (x, _y), _ = b.recv()
    c.send("in", None, [Tensor("new", np.arange(3, dtype=np.int64)), x])
    assert pool.stats().allocations == 1  # x by reference, "new" inside the message
    _, got, _ = d.recv()
    assert got[0].as_numpy().tolist() == [0, 1, 2]
    assert got[1].data_ptr == x.data_ptr
    np.testing.assert_array_equal(got[1].as_numpy(), halves[0])
