"""The heap inside a shared-memory pool: layout, free lists, crash repair (private).

:mod:`pb_tensor.shm._mapped` maps the segment and serialises access; everything here runs on a
mapping with the pool lock held and knows nothing about processes.

Layout (native byte order, as Triton's C structs)::

    offset 0        pool header (HEADER_SIZE bytes): magic, layout version, total size, growth
                    step, maximum, dirty pid, statistics, 64 free-list heads
    HEADER_SIZE     blocks: [block header 48 B][ref-count prefix 16 B][user data ...]
    total - 64      END sentinel, a block that is always "in use" so coalescing stops there

Block sizes are multiples of 64 and include the header, so user data is 64-byte aligned.
A block header holds boundary tags (its size and the size of the block before it, for O(1)
coalescing) and the free-list links. The handle points at the ref-count prefix, as upstream's
``AllocatedShmOwnership`` (``alignas(16) uint32 ref_count``). Free blocks sit in 64 bins by
``floor(log2(size))``; a bitmap of non-empty bins finds a larger bin in one step.

Crash safety: every mutation of the free lists sets the header's *dirty* word first and clears
it last. A process that finds it set while holding the lock knows the previous holder died
mid-mutation; ``walk(repair=True)`` (:mod:`pb_tensor.shm._heap_repair`) rebuilds boundary
tags, free lists and counters from the block sizes alone, which every mutation keeps walkable
at each step.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from mmap import mmap
from typing import Final

from pb_tensor.errors import TritonModelException

POOL_MAGIC: Final = b"PBTSHM\x00\x01"
LAYOUT_VERSION: Final = 2  # 2: pending-message count beside the ref count
HEADER_SIZE: Final = 1024
POOL_HEAD = struct.Struct("=8sIIQQQ")  # magic, version, header size, total, growth, max
OFF_TOTAL: Final = 16  # commit point of growth: every process maps up to here
OFF_GROWTH: Final = 24
OFF_MAX: Final = 32  # 0: no maximum
OFF_DIRTY: Final = 40  # pid of a process in the middle of a heap mutation, else 0
OFF_USED: Final = 48  # bytes in allocated blocks (headers included)
OFF_NALLOC: Final = 56  # number of allocated blocks
OFF_BITMAP: Final = 64  # bit b set <=> free-list bin b is non-empty
OFF_RECOVERIES: Final = 72  # how many times the heap was rebuilt after a crash
OFF_BROKEN: Final = 80  # non-zero once the heap was found beyond repair
OFF_BINS: Final = 128  # 64 free-list heads; bin b holds free blocks of size [2**b, 2**(b+1))
NBINS: Final = 64

BLOCK_MAGIC: Final = 0x4B4C4250  # "PBLK"
BLOCK = struct.Struct("=IIQQQQQI")  # magic, state, size, prev size, nbytes, next, prev, refcount
BLOCK_HDR: Final = 48  # handle = block + 48 (the ref-count prefix)
PREFIX: Final = 16  # upstream's alignas(16) AllocatedShmOwnership { uint32 ref_count; }
# The prefix at the handle: upstream's ref count, then (in upstream's padding) how many of those
# references are messages: handed out by a save and not yet taken over by a load.
REF = struct.Struct("=II")
_pack_ref = REF.pack
STATE_SIZE = struct.Struct("=IQ")  # a block header's state and size, adjacent
BLOCK_REF = struct.Struct("=IIQQQQQII")  # BLOCK and REF in one round trip
DATA: Final = BLOCK_HDR + PREFIX  # user data = block + 64
ALIGN: Final = 64
OFF_STATE: Final = 4
OFF_SIZE: Final = 8
OFF_PREV: Final = 16
OFF_NEXT_FREE: Final = 32
OFF_PREV_FREE: Final = 40
MIN_SPLIT: Final = 128  # a leftover smaller than this stays with the allocation
SCAN_LIMIT: Final = 32  # first-fit probes in the exact bin before taking a larger bin
MAX_REFCOUNT: Final = 0xFFFF_FFFF

FREE: Final = 0
RAW: Final = 1  # from SharedMemoryPool.allocate
RECORD: Final = 2  # a tensor record (pb_tensor.shm.save_record)
END: Final = 3  # the sentinel at the end of the heap

U32 = struct.Struct("=I")
U64 = struct.Struct("=Q")
_get_u64 = U64.unpack_from
_pack_u64 = U64.pack


def _put_u64(mm: mmap, off: int, value: int) -> None:
    """Store one u64 into shared memory in a single write.

    ``struct.pack_into`` zeroes its destination before it writes the fields (CPython's
    ``s_pack_internal`` starts with a ``memset``): a process killed between the two leaves
    zeros that another process then reads, e.g. a block of size 0 that crash repair cannot walk.
    A slice assignment is one ``memcpy`` of the packed bytes, so a field holds either its old or
    its new value. Every store that :func:`walk` or a reference count depends on goes this way;
    free-list links and counters may tear, as repair rebuilds them from the block sizes.
    """
    mm[off : off + 8] = _pack_u64(value)


def put_ref(mm: mmap, handle: int, refcount: int, pending: int) -> None:
    """Store an allocation's reference count and pending-message count in one write.

    (See :func:`_put_u64` for why not ``REF.pack_into``: a killed process would leave the count
    at zero while the block is still allocated.)
    """
    mm[handle : handle + 8] = _pack_ref(refcount, pending)


# This process's id for the dirty word, kept here: os.getpid() is a system call, and two of
# them were a tenth of a small save's time. Updated in a forked child before it runs anything.
_pid = [os.getpid()]


def _after_fork_in_child() -> None:
    _pid[0] = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A checked snapshot of a pool's heap, from ``SharedMemoryPool.stats()``.

    Sizes are in bytes and include the 64-byte block headers; ``recoveries`` counts heap
    rebuilds after a process died while changing it.
    """

    size: int
    used: int
    free: int
    allocations: int
    free_blocks: int
    largest_free: int
    recoveries: int
    unloaded_records: int = 0
    """Records saved and not yet loaded or released (one or more messages pending)."""
    unloaded_handles: tuple[int, ...] = ()
    """Their handles, in heap order."""


def block_size(nbytes: int) -> int:
    """Size of the block that holds ``nbytes`` of user data."""
    return DATA + ((nbytes + ALIGN - 1) & -ALIGN)


def init_heap(fd: int, size: int, growth: int, max_size: int) -> None:
    """Write the pool header, one free block and the END sentinel into a fresh segment."""
    head = bytearray(HEADER_SIZE + DATA)
    POOL_HEAD.pack_into(head, 0, POOL_MAGIC, LAYOUT_VERSION, HEADER_SIZE, size, growth, max_size)
    free_size = size - HEADER_SIZE - ALIGN
    b = free_size.bit_length() - 1
    U64.pack_into(head, OFF_BITMAP, 1 << b)
    U64.pack_into(head, OFF_BINS + 8 * b, HEADER_SIZE)
    BLOCK.pack_into(head, HEADER_SIZE, BLOCK_MAGIC, FREE, free_size, 0, 0, 0, 0, 0)
    os.pwrite(fd, bytes(head), 0)
    sentinel = bytearray(DATA)
    BLOCK.pack_into(sentinel, 0, BLOCK_MAGIC, END, ALIGN, free_size, 0, 0, 0, 1)
    os.pwrite(fd, bytes(sentinel), size - ALIGN)


def corrupted(name: str, what: str) -> TritonModelException:
    """The error for a pool whose heap is found broken: ``what`` says where."""
    return TritonModelException(f"Shared memory pool '{name}' is corrupted: {what}")


# What a read or write of the mapping at an offset taken from a corrupted (or concurrently
# changing) size or link raises: past the end (struct.error), or past any index (IndexError,
# OverflowError). The mutating functions turn them into the pool's corruption error; a
# mutation cut short this way leaves the dirty word set, so the next operation rebuilds the heap.
OUT_OF_HEAP: Final = (struct.error, IndexError, OverflowError)


def _outside(link: int, mapped: int) -> bool:
    """Whether a non-zero free-list link cannot be a free block's offset in the heap."""
    return bool(link) and (link < HEADER_SIZE or link > mapped - 2 * ALIGN or link % ALIGN != 0)


def _fit(off: int, need: int, mapped: int, name: str, where: str) -> int:
    """``off`` when a ``need``-byte block there lies inside the heap (0 passes: no fit)."""
    if off and (off < HEADER_SIZE or off % ALIGN or off + need > mapped - ALIGN):
        raise corrupted(
            name, f"{where} points at offset {off}: no {need}-byte block fits there in "
            f"{mapped} bytes",
        )  # fmt: skip
    return off


def find_fit(mm: mmap, need: int, mapped: int, name: str) -> int:
    """Offset of a free block of at least ``need`` bytes, or 0 when none fits.

    Raises:
        TritonModelException: a free-list link points outside the heap or loops, or the
            block found does not fit inside the heap.
    """
    bitmap = U64.unpack_from(mm, OFF_BITMAP)[0]
    b = need.bit_length() - 1
    # First fit among the first few blocks of the exact bin (sizes [2**b, 2**(b+1))) ...
    off = U64.unpack_from(mm, OFF_BINS + 8 * b)[0] if bitmap >> b & 1 else 0
    # A heap of `mapped` bytes holds fewer blocks than this: more steps means a loop.
    steps = mapped // ALIGN
    probes = 0
    while off:
        if off < HEADER_SIZE or off > mapped - 2 * ALIGN or off % ALIGN or probes > steps:
            raise corrupted(name, f"free list {b} points at offset {off}")
        if U64.unpack_from(mm, off + OFF_SIZE)[0] >= need:
            return _fit(int(off), need, mapped, name, f"free list {b}")
        off = U64.unpack_from(mm, off + OFF_NEXT_FREE)[0]
        probes += 1
        if probes == SCAN_LIMIT:
            # ... then the head of the first non-empty larger bin: any of its blocks fits ...
            larger = _larger_bin_head(mm, bitmap, b)
            if larger:
                return _fit(larger, need, mapped, name, "a larger free list's head")
    if probes < SCAN_LIMIT:
        return _fit(_larger_bin_head(mm, bitmap, b), need, mapped, name,
                    "a larger free list's head")  # fmt: skip
    return 0  # ... and having scanned the whole exact bin, nothing fits: grow.


def _larger_bin_head(mm: mmap, bitmap: int, b: int) -> int:
    higher = bitmap >> (b + 1) << (b + 1)
    if not higher:
        return 0
    return int(U64.unpack_from(mm, OFF_BINS + 8 * ((higher & -higher).bit_length() - 1))[0])


def _bin_insert(mm: mmap, off: int, size: int) -> None:
    b = size.bit_length() - 1
    head = U64.unpack_from(mm, OFF_BINS + 8 * b)[0]
    bin_push(mm, off, b, head, U64.unpack_from(mm, OFF_BITMAP)[0] | 1 << b)


def bin_push(mm: mmap, off: int, b: int, head: int, bitmap: int) -> None:
    """Make the free block at ``off`` the head of bin ``b`` before ``head`` (its current
    head) and store ``bitmap``: writes only, from values the caller knows."""
    U64.pack_into(mm, off + OFF_NEXT_FREE, head)
    U64.pack_into(mm, off + OFF_PREV_FREE, 0)
    if head:
        U64.pack_into(mm, head + OFF_PREV_FREE, off)
    U64.pack_into(mm, OFF_BINS + 8 * b, off)
    U64.pack_into(mm, OFF_BITMAP, bitmap)


def _bin_remove(mm: mmap, size: int, nxt: int, prv: int) -> None:
    if prv:
        U64.pack_into(mm, prv + OFF_NEXT_FREE, nxt)
    else:
        b = size.bit_length() - 1
        U64.pack_into(mm, OFF_BINS + 8 * b, nxt)
        if not nxt:
            U64.pack_into(mm, OFF_BITMAP, U64.unpack_from(mm, OFF_BITMAP)[0] & ~(1 << b))
    if nxt:
        U64.pack_into(mm, nxt + OFF_PREV_FREE, prv)


def _coalesce_and_insert(mm: mmap, off: int) -> None:
    """Merge free block ``off`` with free neighbours and put the result in its bin."""
    _, _, size, prev_size, _, _, _, _ = BLOCK.unpack_from(mm, off)
    _, n_state, n_size, _, _, n_next, n_prev, _ = BLOCK.unpack_from(mm, off + size)
    if n_state == FREE:
        _bin_remove(mm, n_size, n_next, n_prev)
        size += n_size
        _put_u64(mm, off + OFF_SIZE, size)
    if prev_size:
        _, p_state, p_size, _, _, p_next, p_prev, _ = BLOCK.unpack_from(mm, off - prev_size)
        if p_state == FREE:
            _bin_remove(mm, p_size, p_next, p_prev)
            size += p_size
            off -= prev_size
            _put_u64(mm, off + OFF_SIZE, size)
    U64.pack_into(mm, off + size + OFF_PREV, size)
    _bin_insert(mm, off, size)


def allocate_block(
    mm: mmap,
    off: int,
    need: int,
    nbytes: int,
    state: int,
    mapped: int,
    name: str,
    refcount: int = 1,
    pending: int = 0,
) -> None:
    """Turn free block ``off`` (from :func:`find_fit`) into an allocation.

    The block becomes allocated in its last write (header, ``refcount`` and ``pending``
    messages at once), so a process that dies before it leaves a free block behind.

    Raises:
        TritonModelException: the block is not a free block that fits, or a link read on the
            way points outside the heap (corrupted free list).
    """
    if off < HEADER_SIZE or off % ALIGN or off > mapped - 2 * ALIGN:
        raise corrupted(name, f"the free list points at offset {off}")
    magic, old_state, size, prev_size, _, nxt, prv, _ = BLOCK.unpack_from(mm, off)
    if (
        magic != BLOCK_MAGIC
        or old_state != FREE
        or size < need
        or size % ALIGN
        or off + size > mapped - ALIGN
    ):
        raise corrupted(name, f"the free list holds a bad block at offset {off}")
    # Checked before any write: both are written through below.
    low, high = HEADER_SIZE, mapped - 2 * ALIGN
    if (nxt and (nxt < low or nxt > high or nxt % ALIGN)) or (
        prv and (prv < low or prv > high or prv % ALIGN)
    ):
        link, value = ("next", nxt) if _outside(nxt, mapped) else ("previous", prv)
        raise corrupted(
            name, f"the free block at offset {off} has its {link}-free link at offset {value}"
        )
    try:
        put, get = U64.pack_into, _get_u64  # links and counters: repair rebuilds them
        put(mm, OFF_DIRTY, _pid[0])
        # _bin_remove and _bin_insert inline (the same writes in the same order): this runs on
        # every save, where the calls were a tenth of the time.
        b = size.bit_length() - 1
        if prv:
            put(mm, prv + OFF_NEXT_FREE, nxt)
        else:
            put(mm, OFF_BINS + 8 * b, nxt)
            if not nxt:
                put(mm, OFF_BITMAP, get(mm, OFF_BITMAP)[0] & ~(1 << b))
        if nxt:
            put(mm, nxt + OFF_PREV_FREE, prv)
        rest = size - need
        if rest >= MIN_SPLIT:
            # Split: the tail becomes a free block (its neighbour after it is never free).
            tail = off + need
            mm[tail : tail + BLOCK.size] = BLOCK.pack(BLOCK_MAGIC, FREE, rest, need, 0, 0, 0, 0)
            put(mm, tail + rest + OFF_PREV, rest)
            b = rest.bit_length() - 1
            slot = OFF_BINS + 8 * b
            head = get(mm, slot)[0]
            put(mm, tail + OFF_NEXT_FREE, head)
            put(mm, tail + OFF_PREV_FREE, 0)
            if head:
                put(mm, head + OFF_PREV_FREE, tail)
            put(mm, slot, tail)
            put(mm, OFF_BITMAP, get(mm, OFF_BITMAP)[0] | 1 << b)
            size = need
        put(mm, OFF_USED, get(mm, OFF_USED)[0] + size)
        put(mm, OFF_NALLOC, get(mm, OFF_NALLOC)[0] + 1)
        mm[off : off + BLOCK_REF.size] = BLOCK_REF.pack(
            BLOCK_MAGIC, state, size, prev_size, nbytes, 0, 0, refcount, pending
        )
        put(mm, OFF_DIRTY, 0)
    except OUT_OF_HEAP as exc:  # a free-list head read on the way (the leftover's bin)
        raise corrupted(
            name, f"allocating the free block at offset {off}: a free-list link points outside "
            f"the heap ({exc})",
        ) from None  # fmt: skip


def free_block(mm: mmap, off: int, name: str) -> None:
    """Free the allocated block ``off`` (its ref count reached zero).

    Raises:
        TritonModelException: a neighbour's header disagrees with the block's sizes, or a size
            or free-list link read on the way points outside the heap.
    """
    try:
        _free_block(mm, off, name)
    except OUT_OF_HEAP as exc:
        raise corrupted(
            name, f"freeing the block at offset {off} (handle {off + BLOCK_HDR}): a block size "
            f"or free-list link points outside the heap ({exc})",
        ) from None  # fmt: skip


def _free_block(mm: mmap, off: int, name: str) -> None:
    _, _, size, prev_size, _, _, _, _ = BLOCK.unpack_from(mm, off)
    # Refuse, before changing anything, to merge with neighbours whose headers disagree.
    magic, n_state, n_size, prev_of_next, _, n_next, n_prev, _ = BLOCK.unpack_from(
        mm, off + size
    )
    if magic != BLOCK_MAGIC or prev_of_next != size:
        raise corrupted(name, f"the block after offset {off} does not match its size {size}")
    if prev_size:
        prv, p_magic, p_size = off - prev_size, 0, 0
        if prv >= HEADER_SIZE and prev_size % ALIGN == 0:
            p_magic, _, p_size = BLOCK.unpack_from(mm, prv)[:3]
        if (p_magic, p_size) != (BLOCK_MAGIC, prev_size):
            raise corrupted(name, f"the block before offset {off} does not match its size")
    put, get = U64.pack_into, _get_u64  # links and counters: repair rebuilds them
    put(mm, OFF_DIRTY, _pid[0])
    # Freed in the first write: from here a repair (walk) sees a free block and rebuilds the rest.
    mm[off : off + BLOCK_REF.size] = BLOCK_REF.pack(
        BLOCK_MAGIC, FREE, size, prev_size, 0, 0, 0, 0, 0
    )
    put(mm, OFF_USED, get(mm, OFF_USED)[0] - size)
    put(mm, OFF_NALLOC, get(mm, OFF_NALLOC)[0] - 1)
    # _coalesce_and_insert inline, with the next block's header read above (the writes so far
    # did not touch it); the previous one is read again, as removing the next block from its
    # free list may have changed its links.
    if n_state == FREE:
        _bin_remove(mm, n_size, n_next, n_prev)
        size += n_size
        _put_u64(mm, off + OFF_SIZE, size)
    if prev_size:
        _, p_state, p_size, _, _, p_next, p_prev, _ = BLOCK.unpack_from(mm, off - prev_size)
        if p_state == FREE:
            _bin_remove(mm, p_size, p_next, p_prev)
            size += p_size
            off -= prev_size
            _put_u64(mm, off + OFF_SIZE, size)
    put(mm, off + size + OFF_PREV, size)
    _bin_insert(mm, off, size)
    put(mm, OFF_DIRTY, 0)


def tail_free_size(mm: mmap, total: int) -> int:
    """Size of the free block just before the END sentinel (0 if the last block is in use)."""
    end = total - ALIGN
    last = end - U64.unpack_from(mm, end + OFF_PREV)[0]
    if last != end and U32.unpack_from(mm, last + OFF_STATE)[0] == FREE:
        return int(U64.unpack_from(mm, last + OFF_SIZE)[0])
    return 0


def extend(mm: mmap, total: int, new_total: int) -> None:
    """Add the space [total, new_total) (already allocated and mapped) to the heap."""
    U64.pack_into(mm, OFF_DIRTY, _pid[0])
    # Order matters for crash repair: the new sentinel, then the size commit, then the old
    # sentinel becomes a free block (walk(repair=True) handles a stale sentinel).
    grow_by = new_total - total
    end = total - ALIGN
    sentinel = new_total - ALIGN
    mm[sentinel : sentinel + BLOCK.size] = BLOCK.pack(BLOCK_MAGIC, END, ALIGN, grow_by, 0, 0, 0, 1)
    _put_u64(mm, OFF_TOTAL, new_total)
    prev_size = U64.unpack_from(mm, end + OFF_PREV)[0]
    mm[end : end + BLOCK.size] = BLOCK.pack(BLOCK_MAGIC, FREE, grow_by, prev_size, 0, 0, 0, 0)
    _coalesce_and_insert(mm, end)
    U64.pack_into(mm, OFF_DIRTY, 0)
