"""What runs under the pool lock: allocation, reference counts, messages, holders (private).

:class:`LockedHeap` is the part of :class:`pb_tensor.shm._pool.SharedMemoryPool` whose methods
run with the pool lock held (the pool's ``_op`` takes it and passes the current mapping); the
mapping and locking are in :mod:`pb_tensor.shm._mapped`, the lifecycle and the public methods
in :mod:`pb_tensor.shm._pool`.

Every method that hands a reference or an allocation over writes shared memory in one call and
records the new owner right after it with no call in between, so that an asynchronous exception
(a signal handler raising, a MemoryError) cannot separate the two; where it still can (at the
end of that one call) an ``except`` clause, still under the lock, undoes or completes the step.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable
from typing import Final, TypeVar

import numpy as np

from pb_tensor.errors import TritonModelException
from pb_tensor.shm import _heap as heap
from pb_tensor.shm import _heap_repair as repair
from pb_tensor.shm._heap import PoolStats
from pb_tensor.shm._held import OWNED, Held, persist
from pb_tensor.shm._segment import Mapping, extend_segment

__all__ = ["SWEEP_EVERY", "U8", "LockedHeap", "ndnew", "ndview"]

SWEEP_EVERY: Final = 1023  # look for views that died without giving back every 1024 holds
_P = TypeVar("_P")


U8: Final = np.dtype(np.uint8)
_block_ref: Final = heap.BLOCK_REF.unpack_from
_BLOCK_HDR: Final = heap.BLOCK_HDR
_HEADER_SIZE: Final = heap.HEADER_SIZE
_DATA: Final = heap.DATA
_ALIGN: Final = heap.ALIGN
_BLOCK_MAGIC: Final = heap.BLOCK_MAGIC
_FREE: Final = heap.FREE
_END: Final = heap.END
_u64: Final = heap.U64.unpack_from
_pack_ref: Final = heap.REF.pack
_OFF_DIRTY: Final = heap.OFF_DIRTY
_OFF_BROKEN: Final = heap.OFF_BROKEN
ndnew: Final = np.ndarray.__new__
ndview: Final = np.ndarray.view
_getrefcount: Final = sys.getrefcount


class LockedHeap:
    """The pool's operations under its lock (mixed into ``SharedMemoryPool``)."""

    _name: str
    _map_fd: int
    # token -> (handle, the holder, its claim: see Held._claim)
    _owners: dict[int, tuple[int, weakref.ref[Held], list[bool]]]
    _on_dead: Callable[[weakref.ref[Held]], None]  # the callback of every owner's weak reference
    _messages: dict[int, list[int]]

    def _remap(self, at_least: int = 0) -> Mapping:
        raise NotImplementedError  # MappedHeap's

    def _allocate_locked(
        self,
        m: Mapping,
        nbytes: int,
        state: int,
        refcount: int,
        pending: int,
        cell: list[int],
        view: tuple[int, int] | None,
        token: int,
    ) -> tuple[Mapping, Held | None]:
        if not token & SWEEP_EVERY:
            self._sweep_locked(m)  # first: it may free blocks
        need = _DATA + ((nbytes + _ALIGN - 1) & -_ALIGN)  # heap.block_size, inline
        mm = m.mm
        if _u64(mm, _OFF_DIRTY)[0] or _u64(mm, _OFF_BROKEN)[0]:  # what check_heap looks at
            repair.check_heap(mm, m.size, self._name)
        off = heap.find_fit(mm, need, m.size, self._name)
        if off == 0:
            m = self._grow(m, need, nbytes)
            off = heap.find_fit(m.mm, need, m.size, self._name)
        handle = off + heap.BLOCK_HDR
        holder: Held | None = None
        if view is not None:
            holder = ndnew(Held, (view[1],), U8, m.mv, handle + heap.PREFIX + view[0])
            holder._pool = self
            holder._handle = handle
            holder._message = False
            holder._claim = OWNED
            holder._token = 0
        alive = weakref.ref(holder, self._on_dead) if holder is not None else None
        try:
            heap.allocate_block(
                m.mm, off, need, nbytes, state, m.size, self._name, refcount, pending
            )
            if holder is not None and alive is not None:
                self._owners[token] = (handle, alive, OWNED)
                holder._token = token
            if pending:
                # Journalled before it holds the message (no call in between): a sweep gives
                # back the message of a cell whose saving call is gone without handing it on.
                self._messages[id(cell)] = cell
            cell[0] = handle
        except BaseException:
            if cell[0] != handle:
                done = [False]  # retried until it has run to its end (see _held.persist)
                args = (m, handle, state, refcount, pending, token, holder)
                while True:
                    if True in done:
                        break
                    try:
                        while True:
                            if True in done:
                                break
                            try:
                                persist(done, self._undo_allocation, *args)
                            except TritonModelException:
                                raise
                            except BaseException:  # retried (see _held.persist)
                                pass
                    except TritonModelException:
                        raise
                    except BaseException:  # retried (see _held.persist)
                        pass
            raise
        return m, holder

    def _undo_allocation(
        self,
        m: Mapping,
        handle: int,
        state: int,
        refcount: int,
        pending: int,
        token: int,
        holder: Held | None,
    ) -> None:
        """After an exception inside :meth:`_allocate_locked` (lock held): free the block if
        the allocation completed, so that the exception leaks nothing."""
        if holder is not None:
            holder._token = 0
        self._owners.pop(token, None)
        repair.check_heap(m.mm, m.size, self._name)  # repairs a mutation cut short
        fields = heap.BLOCK_REF.unpack_from(m.mm, handle - heap.BLOCK_HDR)
        if fields[1] == state and fields[7:] == (refcount, pending):
            heap.free_block(m.mm, handle - heap.BLOCK_HDR, self._name)

    def _grow(self, m: Mapping, need: int, nbytes: int) -> Mapping:
        """Under the lock: extend the heap so a block of ``need`` bytes fits; the new mapping."""
        mm = m.mm
        total = int(heap.U64.unpack_from(mm, heap.OFF_TOTAL)[0])
        growth = int(heap.U64.unpack_from(mm, heap.OFF_GROWTH)[0])
        max_size = int(heap.U64.unpack_from(mm, heap.OFF_MAX)[0])
        try:
            extra = need - heap.tail_free_size(mm, total)
            new_total = extend_segment(
                self._map_fd, self._name, total, extra, growth, max_size, nbytes
            )
            m = self._remap(new_total)
            heap.extend(m.mm, total, new_total)
        except heap.OUT_OF_HEAP as exc:
            raise TritonModelException(
                f"Shared memory pool '{self._name}' is corrupted: growing the heap from {total} "
                f"bytes read a size outside it ({exc})"
            ) from None
        return m

    def _check_block(self, m: Mapping, handle: int, want: int | None) -> tuple[int, int, int, int]:
        """Validate the allocation at ``handle`` (lock held): state, nbytes, count, messages."""
        # Every rule of _check_block_rules in one expression, for a valid block (the common
        # case, on every load, save and drop); the rules one by one name what is wrong.
        if type(handle) is int:
            off = handle - _BLOCK_HDR
            size_mapped = m.size
            if off >= _HEADER_SIZE and off + _DATA <= size_mapped and not off % _ALIGN:
                magic, state, size, _, nbytes, _, _, refcount, pending = _block_ref(m.mm, off)
                if (
                    magic == _BLOCK_MAGIC
                    and _FREE < state < _END
                    and refcount
                    and size >= _DATA
                    and not size % _ALIGN
                    and off + size <= size_mapped - _ALIGN
                    and nbytes <= size - _DATA
                    and pending <= refcount
                    and (want is None or state == want)
                ):
                    return state, nbytes, refcount, pending
        return self._check_block_rules(m, handle, want)

    def _check_block_rules(
        self, m: Mapping, handle: int, want: int | None
    ) -> tuple[int, int, int, int]:
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise TritonModelException(
                f"Shared memory handle must be an int, not {type(handle).__name__}"
            )
        off = handle - heap.BLOCK_HDR
        if off < heap.HEADER_SIZE or off + heap.DATA > m.size or off % heap.ALIGN:
            raise TritonModelException(
                f"Shared memory handle {handle} is out of range for pool '{self._name}' "
                f"({m.size} bytes)"
            )
        magic, state, size, _, nbytes, _, _, refcount, pending = heap.BLOCK_REF.unpack_from(
            m.mm, off
        )
        if magic != heap.BLOCK_MAGIC or state >= heap.END:
            raise TritonModelException(
                f"Shared memory handle {handle} does not point at an allocation "
                f"(block header magic 0x{magic:08x}, state {state})"
            )
        if state == heap.FREE or refcount == 0:
            raise TritonModelException(f"Shared memory handle {handle} refers to freed memory")
        if size < heap.DATA or size % heap.ALIGN or off + size > m.size - heap.ALIGN:
            raise TritonModelException(
                f"Shared memory handle {handle}: corrupted block size {size}"
            )
        if nbytes > size - heap.DATA:
            raise TritonModelException(
                f"Shared memory handle {handle}: corrupted allocation size {nbytes} in a "
                f"{size}-byte block"
            )
        if pending > refcount:
            raise TritonModelException(
                f"Shared memory handle {handle}: corrupted reference count {refcount} with "
                f"{pending} pending messages"
            )
        if want is not None and state != want:
            kind = "a tensor record" if want == heap.RECORD else "a raw allocation"
            raise TritonModelException(f"Shared memory handle {handle} is not {kind}")
        return state, nbytes, refcount, pending

    def _incref_locked(self, m: Mapping, handle: int) -> None:
        _, _, refcount, pending = self._check_block(m, handle, None)
        if refcount >= heap.MAX_REFCOUNT:
            raise TritonModelException(
                f"Shared memory handle {handle}: reference count overflow ({refcount})"
            )
        heap.put_ref(m.mm, handle, refcount + 1, pending)

    def _take(
        self,
        m: Mapping,
        handle: int,
        holder: Held,
        token: int,
        message: bool,
        refcount: int,
        pending: int,
    ) -> None:
        """Give ``holder`` a reference (lock held, block checked): a pending message when
        ``message`` and there is one (the loader takes it over), else a new one.

        The count changes in one write and the holder is armed right after, with no call in
        between that could raise; if an exception comes in between all the same (a signal
        at the end of the write), the write is undone before the lock is released.
        """
        holder._message = bool(message and pending)
        if holder._message:
            new = (refcount, pending - 1)
            claim = [False]  # until the load returns: given back as a message, not dropped
        elif refcount >= heap.MAX_REFCOUNT:
            raise TritonModelException(
                f"Shared memory handle {handle}: reference count overflow ({refcount})"
            )
        else:
            new = (refcount + 1, pending)
            claim = OWNED
        holder._claim = claim
        alive = weakref.ref(holder, self._on_dead)
        data = _pack_ref(*new)
        # The holder is armed first and the count written last (one slice store: a single
        # memcpy, see heap.put_ref), with no point in between where a signal handler runs: a
        # signal lands before both or after both.
        self._owners[token] = (handle, alive, claim)
        holder._token = token
        try:
            m.mm[handle : handle + 8] = data
        except BaseException:
            if heap.REF.unpack_from(m.mm, handle) != new:  # not written: disarm
                holder._token = 0
                self._owners.pop(token, None)
            raise

    def _add_message_locked(self, m: Mapping, handle: int, cell: list[int]) -> None:
        """One more message on a record (a second save of the same tensor), handed to
        ``cell[0]`` in the same step as written (as :meth:`_take`). Lock held."""
        _, _, refcount, pending = self._check_block(m, handle, heap.RECORD)
        if refcount >= heap.MAX_REFCOUNT:
            raise TritonModelException(
                f"Shared memory handle {handle}: reference count overflow ({refcount})"
            )
        new = (refcount + 1, pending + 1)
        data = _pack_ref(*new)
        # As in _take: the cell (journalled, as in _allocate_locked) holds the message before
        # the count is written, with no point in between where a signal handler runs.
        self._messages[id(cell)] = cell
        cell[0] = handle
        try:
            m.mm[handle : handle + 8] = data
        except BaseException:
            if heap.REF.unpack_from(m.mm, handle) != new:  # not written: no message to hold
                cell[0] = 0
            raise

    def _give_back_locked(self, m: Mapping, token: int, restore: bool) -> None:
        """Give back the reference held under ``token`` (lock held): dropped, or with
        ``restore`` turned back into a pending message (a load that did not complete)."""
        entry = self._owners.get(token)
        if entry is None:
            return
        handle = entry[0]
        try:
            if not restore:
                self._drop_locked(m, handle, None, False, token)
                return
            _, _, refcount, pending = self._check_block(m, handle, heap.RECORD)
            new = (refcount, pending + 1)
            data = _pack_ref(*new)
            # Disowned and written with no point in between where a signal handler runs.
            del self._owners[token]
            try:
                m.mm[handle : handle + 8] = data
            except BaseException:
                if heap.REF.unpack_from(m.mm, handle) != new:  # not written: still owned
                    self._owners[token] = entry
                raise
        except TritonModelException:
            self._owners.pop(token, None)  # a corrupted block: nothing to give back to
            raise

    def _release_cell_locked(self, m: Mapping, cell: list[int]) -> None:
        """Give back the message ``cell`` holds, if any, emptying it in the same step (lock
        held): a release interrupted before that leaves it in the cell, for the sweep."""
        handle = cell[0]
        if handle:
            self._drop_locked(m, handle, heap.RECORD, True, 0, cell)

    def _drop_locked(
        self,
        m: Mapping,
        handle: int,
        want: int | None,
        message: bool,
        token: int,
        cell: list[int] | None = None,
    ) -> None:
        """Drop one reference (a pending message with ``message``; the one ``token`` held,
        if given; the message ``cell`` holds, emptied in the same step); free the block with
        the last one. Lock held.

        Once the block is found valid the drop is completed even if an asynchronous exception
        cuts it short (nobody would retry it: a finaliser or an interrupted release).
        """
        _, _, refcount, pending = self._check_block(m, handle, want)
        if message and not pending:
            raise TritonModelException(
                f"Shared memory handle {handle} has no pending message: every save of it was "
                "loaded or released already"
            )
        new_pending = pending - 1 if message else min(pending, refcount - 1)
        data = _pack_ref(refcount - 1, new_pending)
        try:
            if cell is not None:
                cell[0] = 0  # no call before the store below: emptied with the drop
            if refcount > 1:
                # One slice store, not heap.put_ref: a Python call's entry is a point where a
                # signal handler runs, which would separate the cell from the count.
                m.mm[handle : handle + 8] = data
            else:
                mm = m.mm
                if _u64(mm, _OFF_DIRTY)[0] or _u64(mm, _OFF_BROKEN)[0]:  # check_heap's test
                    repair.check_heap(mm, m.size, self._name)
                heap.free_block(mm, handle - heap.BLOCK_HDR, self._name)
            if token:
                del self._owners[token]
        except TritonModelException:
            raise
        except BaseException:
            done = [False]  # retried until it has run to its end (see _held.persist)
            args = (m, handle, refcount, new_pending, token)
            while True:
                if True in done:
                    break
                try:
                    while True:
                        if True in done:
                            break
                        try:
                            persist(done, self._finish_drop, *args)
                        except TritonModelException:
                            raise
                        except BaseException:  # retried (see _held.persist)
                            pass
                except TritonModelException:
                    raise
                except BaseException:  # retried (see _held.persist)
                    pass
            raise

    def _finish_drop(
        self, m: Mapping, handle: int, refcount: int, new_pending: int, token: int
    ) -> None:
        off = handle - heap.BLOCK_HDR
        repair.check_heap(m.mm, m.size, self._name)  # repairs a free cut short
        if refcount > 1:
            if heap.REF.unpack_from(m.mm, handle) != (refcount - 1, new_pending):
                heap.put_ref(m.mm, handle, refcount - 1, new_pending)
        elif heap.U32.unpack_from(m.mm, off + heap.OFF_STATE)[0] != heap.FREE:
            heap.free_block(m.mm, off, self._name)
        if token:
            self._owners.pop(token, None)

    def _plain_view_locked(self, m: Mapping, handle: int) -> tuple[Mapping, int]:
        return m, self._check_block(m, handle, None)[1]

    def _hold_locked(
        self,
        m: Mapping,
        handle: int,
        want: int | None,
        message: bool,
        parse: Callable[[Mapping, int, int], tuple[_P, int, int]],
        token: int,
        box: list[Held | None] | None,
    ) -> tuple[_P, Held]:
        if not token & SWEEP_EVERY:
            self._sweep_locked(m)
        _, nbytes, refcount, pending = self._check_block(m, handle, want)
        result, offset, length = parse(m, handle, nbytes)
        holder = ndnew(Held, (length,), U8, m.mv, handle + heap.PREFIX + offset)
        holder._pool = self
        holder._handle = handle
        holder._message = False
        holder._claim = OWNED
        holder._token = 0
        if box is not None:
            box[0] = holder  # before the take: the caller can always find what it took
        self._take(m, handle, holder, token, message, refcount, pending)
        return result, holder

    def _untake_locked(self, m: Mapping, holder: Held) -> None:
        """Give back what ``holder`` took (lock held), as its finaliser would: a taken message
        becomes pending again. Retried until it has run to its end (see _held.persist)."""
        done = [False]
        while True:
            if True in done:
                break
            try:
                while True:
                    if True in done:
                        break
                    try:
                        persist(done, self._give_back_holder, m, holder)
                    except TritonModelException:
                        raise
                    except BaseException:  # retried (see _held.persist)
                        pass
            except TritonModelException:
                raise
            except BaseException:  # retried (see _held.persist)
                pass

    def _give_back_holder(self, m: Mapping, holder: Held) -> None:
        token = holder._token
        if token:  # _give_back_locked does nothing once the owner entry is gone
            self._give_back_locked(m, token, holder._message and not holder._claim[0])
            holder._token = 0

    def _sweep_locked(self, m: Mapping) -> None:
        """Give back the references of views that died without doing it, and the messages of
        saves that were abandoned before handing them on (lock held)."""
        self._sweep_owners_locked(m)
        messages = self._messages
        for key in list(messages):
            if not messages[key][0]:  # handed on (or given back): nothing to do
                del messages[key]
            elif _getrefcount(messages[key]) <= 2:
                # Only this journal (and getrefcount's argument) refers to the cell: the call
                # that saved into it is gone, and nobody else can ever give its message back.
                with contextlib.suppress(TritonModelException):
                    self._release_cell_locked(m, messages[key])
                del messages[key]

    def _sweep_owners_locked(self, m: Mapping) -> None:
        """Give back the references of holders that died without doing it (lock held).

        A holder whose finaliser was cut short (an asynchronous exception at its entry) or
        whose pending give-back was lost: given back as it would have, a message taken by a
        load that never returned becoming pending again (not dropped: the caller may still
        release or load it, and a drop here would then be a second release).
        """
        dead = [
            (token, not claim[0])
            for token, (_, alive, claim) in self._owners.items()
            if alive() is None
        ]
        for token, restore in dead:
            with contextlib.suppress(TritonModelException):
                self._give_back_locked(m, token, restore)

    def _stats_locked(self, m: Mapping) -> PoolStats:
        self._sweep_locked(m)
        repair.check_heap(m.mm, m.size, self._name)
        return repair.walk(m.mm, m.size, self._name, repair=False)
