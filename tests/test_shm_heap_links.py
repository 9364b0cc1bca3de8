"""Corrupted allocator state (free-list heads and links) met by a save or a release.

Issue 22 item 6: a process flipping bytes of the pool's header and heap while another saves and
loads made some operations raise ``TypeError: buffer is too small for requested array`` or
``struct.error`` (a link followed to an offset outside the mapping). Here the states such a
flip leaves are written deterministically, through an independent mapping of the segment, and
each operation must raise ``TritonModelException`` naming the pool and the field, or succeed.
Reads and writes of an ``mmap`` are bounds-checked, so none of these can crash the process.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from pb_tensor import Tensor, shm
from pb_tensor.errors import TritonModelException
from pb_tensor.shm import SharedMemoryPool

U64 = struct.Struct("=Q")
OFF_BINS = 128  # 64 free-list heads after the pool header's counters
OFF_NEXT_FREE = 32  # in a free block's header
ALIGN = 64
FAR = 1 << 40  # an aligned offset far past any mapping


@contextmanager
def _pool() -> Iterator[tuple[SharedMemoryPool, mmap.mmap]]:
    """A fresh pool (one free block after its header) and an independent mapping of it."""
    with SharedMemoryPool.create(1 << 16, name=f"pbt-links-{uuid.uuid4().hex[:8]}") as pool:
        fd = os.open(os.path.join(shm.SHM_DIR, pool.name), os.O_RDWR)
        try:
            with mmap.mmap(fd, pool.size) as mm:
                yield pool, mm
        finally:
            os.close(fd)


def _bin(size: int) -> int:
    return size.bit_length() - 1


def _only_free_block(mm: mmap.mmap, size: int) -> int:
    """Offset of the pool's single free block (a fresh pool's ``size`` bytes minus its header),
    found at the head of its free list."""
    for b in range(_bin(size), 0, -1):
        off: int = U64.unpack_from(mm, OFF_BINS + 8 * b)[0]
        if off:
            return off
    raise AssertionError("a fresh pool has a free block")


def _save(pool: SharedMemoryPool, nbytes: int) -> int:
    return Tensor("x", np.zeros(nbytes, dtype=np.uint8)).save_to_shared_memory(pool)


@pytest.mark.parametrize("nbytes", [64, 4096])  # the small-transfer path and the general one
def test_larger_free_list_head_outside_the_heap(nbytes: int) -> None:
    with _pool() as (pool, mm):
        off = _only_free_block(mm, pool.size)
        b = next(b for b in range(64) if U64.unpack_from(mm, OFF_BINS + 8 * b)[0] == off)
        near_end = pool.size - 2 * ALIGN  # in range, but no block of the save's size fits
        U64.pack_into(mm, OFF_BINS + 8 * b, near_end)
        with pytest.raises(TritonModelException) as info:
            _save(pool, nbytes)
        assert str(info.value).startswith(
            f"Shared memory pool '{pool.name}' is corrupted: a larger free list's head points "
            f"at offset {near_end}: no "
        )
        U64.pack_into(mm, OFF_BINS + 8 * b, off)
        assert pool.stats().allocations == 0  # nothing was written
        pool.release(_save(pool, nbytes))


def test_next_free_link_outside_the_heap() -> None:
    with _pool() as (pool, mm):
        off = _only_free_block(mm, pool.size)
        U64.pack_into(mm, off + OFF_NEXT_FREE, FAR)
        with pytest.raises(TritonModelException) as info:
            _save(pool, 4096)
        assert str(info.value) == (
            f"Shared memory pool '{pool.name}' is corrupted: the free block at offset {off} "
            f"has its next-free link at offset {FAR}"
        )
        U64.pack_into(mm, off + OFF_NEXT_FREE, 0)
        assert pool.stats().allocations == 0  # refused before any write
        pool.release(_save(pool, 4096))


def test_split_meets_a_free_list_head_outside_the_heap() -> None:
    """The leftover of a split goes to another free list, whose head is corrupted: the save
    fails mid-mutation; the next operation rebuilds the heap and succeeds."""
    with _pool() as (pool, mm):
        off = _only_free_block(mm, pool.size)
        size = pool.size - off - ALIGN  # the free block runs up to the end sentinel
        nbytes = 40_000
        rest_bin = _bin(size - (ALIGN + nbytes + ALIGN - 1) // ALIGN * ALIGN - ALIGN)
        assert rest_bin != _bin(size)
        U64.pack_into(mm, OFF_BINS + 8 * rest_bin, FAR)
        with pytest.raises(TritonModelException) as info:
            _save(pool, nbytes)
        message = str(info.value)
        assert message.startswith(
            f"Shared memory pool '{pool.name}' is corrupted: allocating the free block at "
            f"offset {off}: a free-list link points outside the heap ("
        ), message
        pool.release(_save(pool, 4096))
        stats = pool.stats()
        assert (stats.recoveries, stats.allocations) == (1, 0)


def test_release_meets_a_free_link_outside_the_heap() -> None:
    """Freeing a block merges the free block after it, whose link is corrupted."""
    with _pool() as (pool, mm):
        handle = _save(pool, 4096)
        after = _only_free_block(mm, pool.size)
        U64.pack_into(mm, after + OFF_NEXT_FREE, FAR)
        with pytest.raises(TritonModelException) as info:
            pool.release(handle)
        message = str(info.value)
        block = handle - 48
        assert message.startswith(
            f"Shared memory pool '{pool.name}' is corrupted: freeing the block at offset "
            f"{block} (handle {handle}): a block size or free-list link points outside the heap ("
        ), message
        pool.release(_save(pool, 4096))  # the heap is rebuilt first
        stats = pool.stats()
        assert (stats.recoveries, stats.allocations) == (1, 0)


def run_flipping(name: str, rounds: str) -> dict[str, object]:
    """In a child process: ``rounds`` saves, loads and releases while a forked process flips
    bytes of the pool's header and of block and record headers (each flip undone after a
    moment, so the pool keeps working in between). Every failure must be the library's."""
    import random
    import signal
    import traceback

    ok = raised = 0
    others: list[str] = []
    with SharedMemoryPool.create(1 << 16, name=name) as pool:
        fd = os.open(os.path.join(shm.SHM_DIR, pool.name), os.O_RDWR)
        mm = mmap.mmap(fd, pool.size)
        pid = os.fork()
        if pid == 0:  # the flipper: stops when killed, or at the latest after a minute
            try:
                signal.alarm(60)
                rng = random.Random(22)
                while True:
                    if rng.random() < 0.3:
                        off = rng.randrange(1024)  # the pool header: counters, free lists
                    else:  # a block header, or the record header after it
                        off = rng.randrange(1024, len(mm) - 4 * ALIGN, ALIGN) + rng.randrange(160)
                    old = mm[off]
                    mm[off] = rng.randrange(256)
                    for _ in range(rng.randrange(300)):
                        pass
                    mm[off] = old
            finally:
                os._exit(0)  # never back into the caller's code (its pool, its finally)
        try:
            texts = np.array([b"ab" * (i % 7) for i in range(1500)], dtype=object)
            numbers = np.arange(500, dtype=np.float32)
            for i in range(int(rounds)):
                try:
                    data = texts if i % 2 else numbers
                    handle = Tensor("t", data).save_to_shared_memory(pool)
                    loaded = Tensor.load_from_shared_memory(pool, handle)
                    loaded.as_numpy()
                    del loaded
                    ok += 1
                except TritonModelException:
                    raised += 1
                except Exception as exc:  # what the test looks for
                    others.append("".join(traceback.format_exception(exc)[-3:]))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            mm.close()
            os.close(fd)
    return {"ok": ok, "raised": raised, "other": others}


def test_two_processes_flipping_bytes_while_saving_and_loading() -> None:
    name = f"pbt-flip-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import test_shm_heap_links as t; "
        "print(json.dumps(t.run_flipping(*sys.argv[2:])))"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(here), env.get("PYTHONPATH")) if p
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, here, name, "1500"],
            env=env, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
    finally:
        leftover = os.path.join(shm.SHM_DIR, name)
        if os.path.lexists(leftover):  # a crashed child could not unlink
            os.unlink(leftover)
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stderr}"
    outcomes = json.loads(done.stdout.splitlines()[-1])
    assert outcomes["other"] == [], "\n".join(outcomes["other"])
    assert outcomes["ok"] > 0, outcomes
