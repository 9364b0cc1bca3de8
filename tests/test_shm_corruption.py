"""Corrupted records: loading raises TritonModelException or returns a consistent record.

Bytes of saved records (block header, ref-count prefix, TensorShm, dims, name, MemoryShm,
padding) are overwritten through an independent mapping of the segment, as a buggy or hostile
process would. Every trial runs in a child process, so a crash (SIGSEGV, SIGBUS) or a hang
fails the test instead of taking pytest down.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pb_tensor import shm
from pb_tensor.errors import TritonModelException
from pb_tensor.shm import SharedMemoryPool, load_record, save_record

HERE = Path(__file__).resolve().parent
ITEMSIZE = (0, 1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8, 0, 2)
BLOCK_HEADER = 48  # bytes of allocator header before the handle


def _kinds(pool: SharedMemoryPool) -> list[int]:
    """One record of each shape of interest; their handles."""

    def save(
        name: str,
        dtype: int,
        dims: tuple[int, ...],
        memory_type: int = 0,
        payload: np.ndarray | None = None,
        byte_size: int | None = None,
    ) -> int:
        return save_record(
            pool, name=name, dtype=dtype, dims=dims, memory_type=memory_type,
            memory_type_id=0, payload=payload,
            byte_size=payload.nbytes if byte_size is None else byte_size,
            ipc_handle=bytes(range(64)) if memory_type == shm.MEMORY_GPU else None,
        )  # fmt: skip

    return [
        save("INPUT0", 11, (2, 3), payload=np.arange(6, dtype=np.float32)),
        save("", 9, (), payload=np.array(7, dtype=np.int64)),
        save("empty", 2, (3, 0), payload=np.zeros((3, 0), np.uint8)),
        save(
            "text",
            13,
            (2,),
            payload=np.frombuffer(b"\x01\x00\x00\x00a\x02\x00\x00\x00bc", np.uint8),
        ),
        save("gpu", 11, (256,), memory_type=shm.MEMORY_GPU, byte_size=1024),
        save("ünïcødé-" * 4, 4, (1, 2, 1, 2, 1), payload=np.arange(4, dtype=np.uint32)),
    ]


@contextmanager
def _segment(pool: SharedMemoryPool) -> Iterator[mmap.mmap]:
    """An independent writable mapping of the pool's segment."""
    fd = os.open(os.path.join(shm.SHM_DIR, pool.name), os.O_RDWR)
    try:
        with mmap.mmap(fd, pool.size) as mm:
            yield mm
    finally:
        os.close(fd)


def _region(pool: SharedMemoryPool, handle: int) -> tuple[int, int]:
    """[start, end) of the bytes that describe the record (header up to the payload + 16)."""
    record = load_record(pool, handle)
    ndim, name_len = len(record.dims), len(record.name.encode())
    del record
    pool.refcount(handle)  # the lock cycle in which the small view's reference goes back
    return handle - BLOCK_HEADER, handle + 16 + shm.record_payload_offset(ndim, name_len) + 16


def _check(pool: SharedMemoryPool, record: shm.TensorRecord, mm: mmap.mmap) -> None:
    """A loaded record must describe memory inside the mapping, consistently."""
    assert isinstance(record.name, str)
    assert 0 <= record.dtype <= 14
    assert 0 <= record.memory_type <= 2
    assert record.memory_type_id >= 0
    assert all(d >= 0 for d in record.dims)
    length = 64 if record.memory_type == shm.MEMORY_GPU else record.byte_size
    assert record.payload.nbytes == length
    if record.memory_type == shm.MEMORY_GPU:
        assert record.ipc_handle is not None
        assert len(record.ipc_handle) == 64
    elif ITEMSIZE[record.dtype]:
        assert record.byte_size == math.prod(record.dims) * ITEMSIZE[record.dtype]
    whole = pool.view(record.handle)  # the allocation (its header passed the checks)
    start = record.payload.ctypes.data - whole.ctypes.data
    assert start >= 0
    assert start + length <= whole.nbytes
    assert record.payload.ctypes.data % shm.PAYLOAD_ALIGNMENT == 0
    bytes(record.payload)  # every byte readable: no SIGBUS, no SIGSEGV


def _trial(pool: SharedMemoryPool, mm: mmap.mmap, handle: int, patch: dict[int, int]) -> str:
    """Apply ``patch`` (offset -> byte), try a load, restore; 'raised' or 'loaded'."""
    saved = {off: mm[off] for off in patch}
    header = mm[handle - BLOCK_HEADER : handle + 4]  # block header and reference count
    for off, value in patch.items():
        mm[off] = value
    record = None
    try:
        record = load_record(pool, handle)
        _check(pool, record, mm)
        outcome = "loaded"
    except TritonModelException as exc:
        if f"handle {handle}" not in str(exc):
            raise AssertionError(f"the message does not name the handle: {exc}") from exc
        outcome = "raised"
    finally:
        for off, value in saved.items():
            mm[off] = value
        mm[handle - BLOCK_HEADER : handle + 4] = header
        if record is not None:
            # The load took a reference on the patched count and the count was restored:
            # take it again so that dropping the record leaves exactly the saver's one.
            pool.incref(handle)
            del record
            # A small view gives its reference back in the next lock cycle: run one now,
            # before the next trial patches the header that the give-back writes.
            pool.refcount(handle)
    return outcome


def run_deterministic(name: str) -> dict[str, int]:
    """Every byte of every record header, set to a few values."""
    outcomes = {"raised": 0, "loaded": 0}
    with SharedMemoryPool.create(1 << 16, name=name) as pool:
        handles = _kinds(pool)
        with _segment(pool) as mm:
            for handle in handles:
                start, end = _region(pool, handle)
                for off in range(start, end):
                    orig = mm[off]
                    for value in {orig ^ 0xFF, orig ^ 0x01, orig ^ 0x80, 0x00, 0xFF, 0x7F}:
                        outcomes[_trial(pool, mm, handle, {off: value})] += 1
        for handle in handles:
            assert pool.refcount(handle) == 1
            shm.release(pool, handle)
        assert pool.stats().allocations == 0
    return outcomes


def run_fuzz(name: str, examples: int) -> dict[str, int]:
    """Random multi-byte patches and whole 8-byte fields, found by hypothesis."""
    outcomes = {"raised": 0, "loaded": 0}
    with SharedMemoryPool.create(1 << 16, name=name) as pool:
        handles = _kinds(pool)
        regions = [_region(pool, h) for h in handles]
        with _segment(pool) as mm:

            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(
                which=st.integers(0, len(handles) - 1),
                flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
                fields=st.lists(
                    st.tuples(st.integers(0, 10_000), st.integers(0, 2**64 - 1)), max_size=3
                ),
            )
            def fuzz(
                which: int, flips: list[tuple[int, int]], fields: list[tuple[int, int]]
            ) -> None:
                start, end = regions[which]
                patch = {start + off % (end - start): value for off, value in flips}
                for off, value in fields:  # dims, lengths, sizes: 8-byte words
                    at = start + (off % ((end - start) // 8)) * 8
                    patch.update(zip(range(at, at + 8), value.to_bytes(8, "little")))
                outcomes[_trial(pool, mm, handles[which], patch)] += 1

            fuzz()
        for handle in handles:
            assert pool.refcount(handle) == 1
            shm.release(pool, handle)
        assert pool.stats().allocations == 0
    return outcomes


def run_pool_header(name: str) -> dict[str, int]:
    """A pool header claiming more memory than the segment has must not cause SIGBUS."""
    with SharedMemoryPool.create(1 << 16, name=name) as pool:
        handle = pool.allocate(100)
        size = pool.size
        with _segment(pool) as mm:
            for bogus in (size + 4096 * 16, 2**63, size + 100):
                mm[16:24] = bogus.to_bytes(8, "little")
                try:
                    with pytest.raises(TritonModelException, match="corrupted"):
                        pool.incref(handle)
                finally:
                    mm[16:24] = size.to_bytes(8, "little")
            mm[16:24] = (size * 4).to_bytes(8, "little")
            try:
                with pytest.raises(TritonModelException, match="corrupted"):
                    SharedMemoryPool.attach(pool.name)  # a new attacher checks it too
            finally:
                mm[16:24] = size.to_bytes(8, "little")
        pool.decref(handle)
    return {"raised": 4, "loaded": 0}


def _in_child(function: str, *args: str) -> dict[str, int]:
    name = f"pbt_corrupt_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import test_shm_corruption as t; "
        f"print(json.dumps(t.{function}(*sys.argv[2:])))"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(HERE), name, *args],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        leftover = os.path.join(shm.SHM_DIR, name)
        if os.path.lexists(leftover):  # a crashed child could not unlink (lexists: a link)
            os.unlink(leftover)
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stderr}"
    result: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_every_byte_of_the_record_header() -> None:
    outcomes = _in_child("run_deterministic")
    assert outcomes["raised"] > 500, outcomes
    assert outcomes["loaded"] > 100, outcomes


def test_fuzzed_records() -> None:
    outcomes = _in_child("run_fuzz_cli", "1000")
    assert outcomes["raised"] > 0, outcomes
    assert outcomes["loaded"] > 0, outcomes


def run_fuzz_cli(name: str, examples: str) -> dict[str, int]:
    return run_fuzz(name, int(examples))


def test_pool_header_claiming_too_much() -> None:
    assert _in_child("run_pool_header")["raised"] == 4
