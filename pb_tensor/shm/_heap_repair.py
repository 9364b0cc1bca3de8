"""Checking and crash repair of a pool's heap (private): :func:`check_heap` before each use
of a heap that a dead process may have left mid-mutation, :func:`walk` to check every block
or to rebuild the boundary tags, free lists and counters from the block sizes alone (the
layout and the mutations that keep it walkable are in :mod:`pb_tensor.shm._heap`)."""

from __future__ import annotations

from mmap import mmap

from pb_tensor.errors import TritonModelException
from pb_tensor.shm import _heap as heap
from pb_tensor.shm._heap import (
    ALIGN,
    BLOCK,
    BLOCK_HDR,
    BLOCK_MAGIC,
    DATA,
    END,
    FREE,
    HEADER_SIZE,
    NBINS,
    OFF_BINS,
    OFF_BITMAP,
    OFF_BROKEN,
    OFF_DIRTY,
    OFF_NALLOC,
    OFF_NEXT_FREE,
    OFF_PREV,
    OFF_PREV_FREE,
    OFF_RECOVERIES,
    OFF_SIZE,
    OFF_STATE,
    OFF_TOTAL,
    OFF_USED,
    RAW,
    RECORD,
    REF,
    U64,
    PoolStats,
)

__all__ = ["check_heap", "walk"]


def check_heap(mm: mmap, mapped: int, name: str) -> None:
    """Refuse a heap found broken; rebuild one that a dead process left mid-mutation.

    Raises:
        TritonModelException: the heap is (now found) beyond repair.
    """
    if U64.unpack_from(mm, OFF_BROKEN)[0]:
        raise heap.corrupted(name, "its heap could not be rebuilt after a process died changing it")
    if U64.unpack_from(mm, OFF_DIRTY)[0]:
        try:
            walk(mm, mapped, name, repair=True)
        except TritonModelException:
            U64.pack_into(mm, OFF_BROKEN, 1)
            raise
        U64.pack_into(mm, OFF_RECOVERIES, U64.unpack_from(mm, OFF_RECOVERIES)[0] + 1)
        U64.pack_into(mm, OFF_DIRTY, 0)


def walk(mm: mmap, mapped: int, name: str, *, repair: bool) -> PoolStats:
    """Walk every block; check (``repair=False``) or rebuild (``repair=True``) the heap.

    Raises:
        TritonModelException: a block header is invalid, or (checking) a boundary tag, a free
            list, the bitmap or a counter disagrees with the blocks.
    """
    total = int(U64.unpack_from(mm, OFF_TOTAL)[0])
    end = total - ALIGN
    if total > mapped or BLOCK.unpack_from(mm, end)[:3] != (BLOCK_MAGIC, END, ALIGN):
        raise heap.corrupted(name, f"no end sentinel at offset {end}")
    blocks: list[tuple[int, int, int]] = []  # (offset, state, size)
    off = HEADER_SIZE
    while off < end:
        magic, state, size, _, nbytes, _, _, _ = BLOCK.unpack_from(mm, off)
        if repair and magic == BLOCK_MAGIC and state == END:
            # A grower died after committing the new size but before turning the old
            # sentinel into free space: the rest of the heap is free.
            state, size = FREE, end - off
        if (
            magic != BLOCK_MAGIC
            or state not in (FREE, RAW, RECORD)
            or size < DATA
            or size % ALIGN
            or off + size > end
            or (state != FREE and nbytes > size - DATA)
        ):
            raise heap.corrupted(
                name, f"bad block header at offset {off} (magic 0x{magic:08x}, state {state}, "
                f"size {size})",
            )  # fmt: skip
        if repair and state == FREE and blocks and blocks[-1][1] == FREE:
            prev_off, _, prev_size = blocks.pop()
            off, size = prev_off, prev_size + size
        blocks.append((off, state, size))
        off += size
    used = sum(size for _, state, size in blocks if state != FREE)
    unloaded = tuple(
        off + BLOCK_HDR
        for off, state, _ in blocks
        if state == RECORD and REF.unpack_from(mm, off + BLOCK_HDR)[1]
    )
    free = [(o, size) for o, state, size in blocks if state == FREE]
    if repair:
        _rebuild(mm, blocks, end, used, len(blocks) - len(free))
    else:
        _verify(mm, blocks, free, end, used, name)
    return PoolStats(
        size=total,
        used=used,
        free=sum(size for _, size in free),
        allocations=len(blocks) - len(free),
        free_blocks=len(free),
        largest_free=max((size for _, size in free), default=0),
        recoveries=int(U64.unpack_from(mm, OFF_RECOVERIES)[0]),
        unloaded_records=len(unloaded),
        unloaded_handles=unloaded,
    )


def _rebuild(
    mm: mmap, blocks: list[tuple[int, int, int]], end: int, used: int, allocations: int
) -> None:
    for b in range(NBINS):
        U64.pack_into(mm, OFF_BINS + 8 * b, 0)
    U64.pack_into(mm, OFF_BITMAP, 0)
    # The free lists are built from what this walk found, never read back from the mapping:
    # a process that scribbles on the header meanwhile must not send a write past the heap
    # (a head read back could be any value). Written as they grow, as the heap's own inserts do.
    heads = [0] * NBINS
    bitmap = 0
    prev = 0
    for off, state, size in blocks:
        # State and size in one store: a repairer that dies here leaves a walkable heap.
        mm[off + OFF_STATE : off + OFF_SIZE + 8] = heap.STATE_SIZE.pack(state, size)
        U64.pack_into(mm, off + OFF_PREV, prev)
        if state == FREE:
            mm[off + BLOCK_HDR : off + BLOCK_HDR + REF.size] = REF.pack(0, 0)
            b = size.bit_length() - 1
            bitmap |= 1 << b
            heap.bin_push(mm, off, b, heads[b], bitmap)
            heads[b] = off
        prev = size
    U64.pack_into(mm, end + OFF_PREV, prev)
    U64.pack_into(mm, OFF_USED, used)
    U64.pack_into(mm, OFF_NALLOC, allocations)


def _verify(
    mm: mmap,
    blocks: list[tuple[int, int, int]],
    free: list[tuple[int, int]],
    end: int,
    used: int,
    name: str,
) -> None:
    prev, prev_state = 0, RAW
    for off, state, size in blocks:
        if U64.unpack_from(mm, off + OFF_PREV)[0] != prev:
            raise heap.corrupted(name, f"boundary tag of the block at offset {off}")
        if state == FREE and prev_state == FREE:
            raise heap.corrupted(name, f"adjacent free blocks at offset {off}")
        prev, prev_state = size, state
    if U64.unpack_from(mm, end + OFF_PREV)[0] != prev:
        raise heap.corrupted(name, "boundary tag of the end sentinel")
    listed: set[int] = set()
    bitmap = U64.unpack_from(mm, OFF_BITMAP)[0]
    for b in range(NBINS):
        off = U64.unpack_from(mm, OFF_BINS + 8 * b)[0]
        if bool(off) != bool(bitmap >> b & 1):
            raise heap.corrupted(name, f"bitmap bit {b}")
        back = 0
        while off:
            if off in listed or len(listed) > len(free):
                raise heap.corrupted(name, f"free list {b} loops")
            listed.add(off)
            if U64.unpack_from(mm, off + OFF_PREV_FREE)[0] != back:
                raise heap.corrupted(name, f"free list {b} back link at offset {off}")
            if U64.unpack_from(mm, off + OFF_SIZE)[0].bit_length() - 1 != b:
                raise heap.corrupted(name, f"block at offset {off} in the wrong bin {b}")
            back, off = off, U64.unpack_from(mm, off + OFF_NEXT_FREE)[0]
    if listed != {off for off, _ in free}:
        raise heap.corrupted(name, "free lists do not match the free blocks")
    if U64.unpack_from(mm, OFF_USED)[0] != used:
        raise heap.corrupted(name, f"used-bytes counter {U64.unpack_from(mm, OFF_USED)[0]}")
    if U64.unpack_from(mm, OFF_NALLOC)[0] != len(blocks) - len(free):
        raise heap.corrupted(name, f"allocation counter {U64.unpack_from(mm, OFF_NALLOC)[0]}")
