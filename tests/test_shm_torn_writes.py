"""A process killed between any two stores of a heap mutation leaves a heap that repairs.

``test_shm_multiprocess::test_children_killed_at_random_points`` kills processes at random
points and once found a block header reading ``state 2, size 0``: ``struct.pack_into`` zeroes
its destination before it writes the fields (CPython's ``s_pack_internal``), and the kill landed
between the two. That window is nanoseconds wide, so a random kill rarely finds it; this test
finds every such window. Each mutation runs on a recording copy of a heap that logs its stores
the way the hardware sees them (a ``pack_into`` as a zero fill then one store per field, a slice
assignment as one store), and every prefix of that log, a process killed after that store, must
then be repaired by the next process (``walk(repair=True)``) into a heap that checks out, with
every other allocation kept.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

from pb_tensor.errors import TritonModelException
from pb_tensor.shm import _heap as heap
from pb_tensor.shm import _heap_repair as repair

SIZE = 1 << 16
NAME = "torn"

Store = tuple[int, bytes]


class _Recording(bytearray):
    """A heap image that logs every store made through slice assignment or a recording Struct."""

    log: list[Store]

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(key, slice):
            # An mmap refuses a slice assignment that would change its length; so must we.
            assert key.stop - key.start == len(value), (key, len(value))
            if hasattr(self, "log"):
                self.log.append((key.start, bytes(value)))
        super().__setitem__(key, value)


class _TornStruct:
    """A ``struct.Struct`` whose ``pack_into`` is logged as CPython performs it."""

    def __init__(self, real: struct.Struct) -> None:
        self._real = real
        self.size = real.size
        fields = real.format.lstrip("=<>!@")
        self._offsets = [struct.calcsize("=" + fields[:i]) for i in range(len(fields) + 1)]

    def pack_into(self, buffer: Any, offset: int, *values: Any) -> None:
        data = self._real.pack(*values)
        if isinstance(buffer, _Recording) and hasattr(buffer, "log"):
            buffer.log.append((offset, bytes(self.size)))  # s_pack_internal's memset
            for start, stop in zip(self._offsets, self._offsets[1:]):
                buffer.log.append((offset + start, data[start:stop]))
        self._real.pack_into(buffer, offset, *values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture(autouse=True)
def _torn_structs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("U32", "U64", "BLOCK", "BLOCK_REF", "REF"):
        monkeypatch.setattr(heap, name, _TornStruct(getattr(heap, name)))


def _fresh(size: int = SIZE) -> bytearray:
    with tempfile.TemporaryFile() as f:
        os.ftruncate(f.fileno(), size)
        heap.init_heap(f.fileno(), size, SIZE, 0)
        return bytearray(os.pread(f.fileno(), size, 0))


def _allocate(image: bytearray, nbytes: int, state: int = heap.RECORD) -> int:
    need = heap.block_size(nbytes)
    off = heap.find_fit(image, need, len(image), NAME)  # type: ignore[arg-type]
    assert off, "the test heap is too small"
    heap.allocate_block(image, off, need, nbytes, state, len(image), NAME)  # type: ignore[arg-type]
    return off


def _blocks(image: bytearray) -> list[tuple[int, int, int]]:
    """(offset, state, size) of every allocated block, from a checked walk."""
    repair.walk(image, len(image), NAME, repair=False)  # type: ignore[arg-type]
    out, off, end = [], heap.HEADER_SIZE, heap.U64.unpack_from(image, heap.OFF_TOTAL)[0] - 64
    while off < end:
        _, state, size = heap.BLOCK.unpack_from(image, off)[:3]
        if state != heap.FREE:
            out.append((off, state, size))
        off += size
    return out


def _kill_points(
    before: bytearray, mutate: Callable[[_Recording], None], *, keep: list[tuple[int, int, int]]
) -> int:
    """Run ``mutate``, then check the heap as left by a kill after each of its stores."""
    rec = _Recording(before)
    rec.log = []
    mutate(rec)
    log = rec.log
    assert log, "the mutation stored nothing"
    for k in range(len(log) + 1):
        image = bytearray(before)
        for off, data in log[:k]:
            image[off : off + len(data)] = data
        if heap.U64.unpack_from(image, heap.OFF_DIRTY)[0]:
            try:
                repair.check_heap(image, len(image), NAME)  # type: ignore[arg-type]
            except TritonModelException as e:
                pytest.fail(f"killed after store {k} of {len(log)} ({log[k - 1]!r}): {e}")
        survivors = _blocks(image)
        for block in keep:
            assert block in survivors, (k, block, survivors)
    return len(log)


def test_allocate_with_and_without_split() -> None:
    image = _fresh()
    kept = [_allocate(image, 1000)]
    keep = _blocks(image)
    assert _kill_points(image, lambda m: _allocate(m, 5000), keep=keep) > 10  # split
    whole = heap.U64.unpack_from(image, heap.HEADER_SIZE + heap.block_size(1000) + 8)[0]
    # No split: the request takes the whole free block.
    assert _kill_points(image, lambda m: _allocate(m, whole - heap.DATA), keep=keep) > 5
    assert kept


@pytest.mark.parametrize("neighbours", ["none", "next", "prev", "both"])
def test_free_with_merges(neighbours: str) -> None:
    image = _fresh()
    a, b, c, d = (_allocate(image, n) for n in (700, 900, 1100, 1300))
    if neighbours in ("prev", "both"):
        heap.free_block(image, a, NAME)  # type: ignore[arg-type]
    if neighbours in ("next", "both"):
        heap.free_block(image, c, NAME)  # type: ignore[arg-type]
    keep = [blk for blk in _blocks(image) if blk[0] != b]
    assert (d, heap.RECORD, heap.block_size(1300)) in keep
    _kill_points(image, lambda m: heap.free_block(m, b, NAME), keep=keep)  # type: ignore[arg-type]


@pytest.mark.parametrize("tail_free", [True, False])
def test_growth(tail_free: bool) -> None:
    image = _fresh(2 * SIZE)
    heap.U64.pack_into(image, heap.OFF_TOTAL, SIZE)  # a heap of SIZE in a segment grown to 2x
    end = SIZE - 64
    heap.BLOCK.pack_into(image, end, heap.BLOCK_MAGIC, heap.END, 64, SIZE - 64 - 1024, 0, 0, 0, 1)
    first = heap.HEADER_SIZE
    heap.BLOCK.pack_into(image, first, heap.BLOCK_MAGIC, heap.FREE, end - first, 0, 0, 0, 0, 0)
    repair.walk(image, len(image), NAME, repair=True)  # type: ignore[arg-type]
    _allocate(image, 2000)
    if not tail_free:
        tail = heap.tail_free_size(image, SIZE)  # type: ignore[arg-type]
        _allocate(image, tail - heap.DATA)
        assert heap.tail_free_size(image, SIZE) == 0  # type: ignore[arg-type]
    keep = _blocks(image)
    _kill_points(image, lambda m: heap.extend(m, SIZE, 2 * SIZE), keep=keep)  # type: ignore[arg-type]


def test_repair_killed_midway_repairs_again() -> None:
    image = _fresh()
    blocks = [_allocate(image, n) for n in (300, 600, 900, 1200)]
    heap.free_block(image, blocks[1], NAME)  # type: ignore[arg-type]
    heap.free_block(image, blocks[2], NAME)  # type: ignore[arg-type]
    keep = _blocks(image)
    # A process died mid-mutation (dirty set, free lists scrambled), and the repairer dies too.
    heap.U64.pack_into(image, heap.OFF_DIRTY, 12345)
    for b in range(heap.NBINS):
        heap.U64.pack_into(image, heap.OFF_BINS + 8 * b, 0)
    _kill_points(
        image,
        lambda m: repair.walk(m, len(m), NAME, repair=True),  # type: ignore[arg-type]
        keep=keep,
    )


def test_reference_count_stores_are_single_writes() -> None:
    image = _fresh()
    off = _allocate(image, 100)
    rec = _Recording(image)
    rec.log = []
    heap.put_ref(rec, off + heap.BLOCK_HDR, 7, 2)  # type: ignore[arg-type]
    assert rec.log == [(off + heap.BLOCK_HDR, struct.pack("=II", 7, 2))]
