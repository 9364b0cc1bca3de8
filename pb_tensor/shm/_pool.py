"""The shared-memory pool behind :mod:`pb_tensor.shm` (private; import from ``pb_tensor.shm``).

One POSIX shared-memory object (a file under ``/dev/shm``) holds a heap (layout and allocator
in :mod:`pb_tensor.shm._heap`). Every process maps the whole file and addresses allocations by
byte offset (the *handle*), which means the same in every process whatever address its mapping
got: Triton's design (``SharedMemoryManager``) with a Python-side allocator and lock.
:class:`SharedMemoryPool` is the lifecycle (create, attach, close) and the public methods; the
mapping, the lock and growth are in :mod:`pb_tensor.shm._mapped`, what runs under the lock in
:mod:`pb_tensor.shm._locked`.

The segment is opened with ``os.open`` (what ``shm_open`` does on Linux), not with
:class:`multiprocessing.shared_memory.SharedMemory`: that keeps ``multiprocessing``'s
``resource_tracker`` away on every Python version, so no helper process unlinks a segment
that others still use (cpython#82300; ``track=False`` exists only from 3.13). Only the
creating process unlinks, on :meth:`SharedMemoryPool.close` or at interpreter exit.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
from collections.abc import Callable
from typing import Final, TypeVar

import numpy as np
import numpy.typing as npt

from pb_tensor.errors import TritonModelException
from pb_tensor.shm import _heap as heap
from pb_tensor.shm._heap import PoolStats
from pb_tensor.shm._held import Held
from pb_tensor.shm._locked import ndview
from pb_tensor.shm._mapped import MappedHeap
from pb_tensor.shm._segment import (
    PAGE,
    SHM_DIR,
    Mapping,
    check_name,
    create_segment,
    is_sealed,
    open_segment,
    positive_int,
    round_up,
    sealing_supported,
)

__all__ = [
    "DEFAULT_GROWTH",
    "DEFAULT_SIZE",
    "SHM_DIR",
    "PoolStats",
    "SharedMemoryPool",
]

DEFAULT_SIZE: Final = 1 << 20
"""Initial pool size in bytes: Triton's ``shm-default-byte-size`` default (1 MiB)."""

DEFAULT_GROWTH: Final = 1 << 20
"""Growth step in bytes: Triton's ``shm-growth-byte-size`` default (1 MiB)."""


_tokens = itertools.count(1)
_P = TypeVar("_P")


class SharedMemoryPool(MappedHeap):
    """A growable shared-memory heap addressed by integer handles, shared between processes.

    Build one with :meth:`create` (the owner, which unlinks the segment on :meth:`close`) or
    :meth:`attach` (any other process, including unrelated ones started later). Allocations
    are addressed by *handles*: byte offsets that mean the same in every process. Each has a
    reference count in shared memory (upstream's 16-byte prefix at the handle); it is freed
    when the count drops to zero.

    Every method raises :class:`~pb_tensor.errors.TritonModelException` for a closed pool, a
    bad or stale handle, or a corrupted heap. A pool object is usable from several threads,
    and a forked child can go on using the one it inherited (with locks and references of
    its own). Views handed out keep their mapping alive: they stay valid after growth and
    after :meth:`close`.
    """

    # ----------------------------------------------------------------------------- lifecycle
    @classmethod
    def create(
        cls,
        size: int = DEFAULT_SIZE,
        *,
        growth: int = DEFAULT_GROWTH,
        max_size: int | None = None,
        name: str | None = None,
        populate: bool = True,
        sealed: bool | None = None,
    ) -> SharedMemoryPool:
        """Create a new pool of ``size`` bytes (rounded up to whole pages) under ``name``.

        ``growth`` is the step by which the pool grows when an allocation does not fit (it
        grows by as many steps as needed); ``max_size`` caps the total size (``None``: only
        the free space of ``/dev/shm`` limits it). A missing ``name`` picks a unique one. With
        ``populate`` the pages are pre-faulted into this process (faster first writes).
        The memory is reserved with ``posix_fallocate``, so exhaustion shows up here as an
        exception, never later as SIGBUS.

        ``sealed`` (default: wherever Linux allows it) makes the segment impossible to shrink,
        so no other process can turn this process's accesses into SIGBUS by truncating it: the
        segment is then a sealed ``memfd`` that ``/dev/shm/<name>`` links to through this
        process's ``/proc`` entry, and :meth:`attach` works while this process holds the pool
        (processes attached before it exits keep working). ``sealed=False`` keeps a plain
        ``/dev/shm`` file, attachable from other PID namespaces and after this process
        exits; truncation is then detected before every access instead.

        Raises:
            TritonModelException: a bad argument, a name already in use, not enough room in
                ``/dev/shm`` (the message gives the requested and available sizes), or
                ``sealed=True`` where this system cannot seal segments.
        """
        size = positive_int(size, "Shared memory pool size")
        growth = round_up(positive_int(growth, "Shared memory pool growth"), PAGE)
        if max_size is not None:
            max_size = positive_int(max_size, "Shared memory pool max_size")
        name = check_name(
            f"pb_tensor_{os.getpid()}_{secrets.token_hex(8)}" if name is None else name
        )
        size = round_up(max(size, heap.HEADER_SIZE + 3 * heap.ALIGN), PAGE)
        if max_size is not None and size > max_size:
            raise TritonModelException(
                f"Unable to initialize shared memory key '{name}' to requested size "
                f"({size} bytes): the pool maximum is {max_size} bytes."
            )
        if sealed is None:
            sealed = sealing_supported()
        elif sealed and not sealing_supported():
            raise TritonModelException(
                "Sealed shared memory pools need Linux with memfd_create, file seals and /proc"
            )
        fd = create_segment(name, size, growth, 0 if max_size is None else max_size, sealed)
        try:
            return cls(
                _name=name, _map_fd=fd, _creator=True, _populate=populate, _size=size,
                _sealed=sealed,
            )  # fmt: skip
        except BaseException:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
            raise

    @classmethod
    def attach(cls, name: str, *, populate: bool = True) -> SharedMemoryPool:
        """Attach to the existing pool ``name`` (made by :meth:`create` in any process).

        The attached pool never unlinks the segment; :meth:`close` only unmaps it.

        Raises:
            TritonModelException: no such pool, or the segment is not a pb-tensor pool.
        """
        fd, total = open_segment(check_name(name))
        try:
            return cls(
                _name=name, _map_fd=fd, _creator=False, _populate=populate, _size=total,
                _sealed=is_sealed(fd),
            )  # fmt: skip
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Close this process's access; the creator also unlinks the segment name.

        Other processes that attached keep working (their mappings stay valid). Views and
        records still alive in this process stay readable: the mapping and the references they
        hold are given back when the last of them is dropped. Calling ``close`` twice is fine.
        """
        if self._closed:
            return
        if self._pending:  # views that died since the last operation
            with contextlib.suppress(TritonModelException):
                self._op(_nothing)
        self._closed = True
        if self._creator:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
        if not self._owners:
            self._release_resources()

    def __enter__(self) -> SharedMemoryPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Reached only when no view is alive (owners keep the pool alive). As in _Owner: no
        # exception out of a finaliser, no module global.
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._map.size} bytes"
        role = "creator" if self._creator else "attached"
        return f"<SharedMemoryPool {self._name!r} {role}, {state}>"

    # ------------------------------------------------------------------------------ properties
    @property
    def name(self) -> str:
        """The segment name (the file name under ``/dev/shm``); pass it to :meth:`attach`."""
        return self._name

    @property
    def size(self) -> int:
        """Current total size in bytes, including growth done by any process.

        Raises:
            TritonModelException: the pool is closed.
        """
        return int(heap.U64.unpack_from(self._mapping().mm, heap.OFF_TOTAL)[0])

    @property
    def growth(self) -> int:
        """Growth step in bytes (whole pages)."""
        return int(heap.U64.unpack_from(self._mapping().mm, heap.OFF_GROWTH)[0])

    @property
    def max_size(self) -> int | None:
        """Maximum total size in bytes, or ``None`` when only ``/dev/shm`` limits growth."""
        value = int(heap.U64.unpack_from(self._mapping().mm, heap.OFF_MAX)[0])
        return value or None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def sealed(self) -> bool:
        """Whether the segment is sealed against shrinking (see :meth:`create`)."""
        return self._sealed

    @property
    def is_creator(self) -> bool:
        """Whether this object created the segment (and will unlink it)."""
        return self._creator

    # --------------------------------------------------------------------------- allocation
    def allocate(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (64-byte aligned) and return its handle, ref count 1.

        The pool grows (by whole growth steps) when no free block fits. The memory is not
        cleared. Release it with :meth:`decref`.

        Raises:
            TritonModelException: ``nbytes`` is negative or not an int, the pool is closed or
                corrupted, or growing would pass the pool maximum or the free space of
                ``/dev/shm`` ("Failed to increase the shared memory pool size to ..."); the
                pool is unchanged then.
        """
        cell = [0]
        try:
            self._allocate(nbytes, heap.RAW, 1, 0, cell, None)
            handle = cell[0]
            cell[0] = 0  # handed over: nothing that can raise until the return
            return handle
        finally:
            if cell[0]:
                self._op(self._drop_locked, cell[0], None, False, 0)

    def _allocate(
        self,
        nbytes: int,
        state: int,
        refcount: int,
        pending: int,
        cell: list[int],
        view: tuple[int, int] | None,
    ) -> tuple[Mapping, Held | None]:
        """Allocate under one lock cycle; the handle goes into ``cell[0]``.

        ``refcount`` references, ``pending`` of them messages. With ``view`` (offset from the
        data start, length), one of the references belongs to the returned holder of that
        range (released when it and every view of it die); the others to whoever empties
        ``cell``. Nothing leaks if this raises at any point: an allocation is either in
        ``cell`` (and armed holder) or freed again.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TritonModelException(
                f"Allocation size must be an int, not {type(nbytes).__name__}"
            )
        if nbytes < 0:
            raise TritonModelException(f"Allocation size must be >= 0, got {nbytes}")
        if self._closed:
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        return self._op(
            self._allocate_locked, nbytes, state, refcount, pending, cell, view, next(_tokens)
        )

    # ------------------------------------------------------------------------ ref counting

    def incref(self, handle: int) -> None:
        """Add a reference to the allocation at ``handle``.

        Raises:
            TritonModelException: the handle is out of range, freed, not an allocation, or its
                count would overflow; or the pool is closed.
        """
        self._call(self._incref_locked, handle)

    def _untake(self, box: list[Held | None]) -> None:
        """Undo a load that failed after it may have taken its reference (``box[0]``: the
        holder from :meth:`_hold`, or None): a taken message becomes pending again, another
        reference is dropped. No view of the holder may be in use any more.

        The give-back is completed under the lock even if asynchronous exceptions cut it
        short (see ``_untake_locked``), so that the message is pending again when the load's
        exception reaches its caller, whatever frames that exception keeps alive.

        Raises:
            TritonModelException: the pool is closed, or the record is corrupted.
        """
        holder = box[0]
        if holder is not None and holder._token:
            self._op(self._untake_locked, holder)

    def add_message(self, handle: int) -> int:
        """One more message on the saved record at ``handle``, for another load: ``handle``
        again (as a second :meth:`pb_tensor.Tensor.save_to_shared_memory` of a loaded tensor
        hands out, without copying). The caller must keep the record alive meanwhile (hold a
        tensor loaded from it, or a view of one); the message keeps it until a load takes it
        over or :meth:`release` gives it back.

        Raises:
            TritonModelException: the handle is out of range, freed or not a tensor record,
                its count would overflow, or the pool is closed.
        """
        # Handed over in this frame, as save_to_shared_memory does (see there).
        cell = [0]
        try:
            self._call(self._add_message_locked, handle, cell)
        except BaseException:
            if cell[0]:
                self._op(self._release_cell_locked, cell)
            raise
        handle = cell[0]
        cell[0] = 0  # handed over: nothing from here on calls or branches (no handler runs)
        return handle

    def decref(self, handle: int) -> None:
        """Drop a reference to the allocation at ``handle``; free it when none is left.

        Raises:
            TritonModelException: the handle is out of range, freed or not an allocation, the
                heap around it is corrupted, or the pool is closed.
        """
        self._call(self._drop_locked, handle, None, False, 0)

    def release(self, handle: int) -> None:
        """Release a saved record that will not be loaded: drop one pending message.

        Every save (:meth:`pb_tensor.Tensor.save_to_shared_memory`,
        :func:`pb_tensor.shm.save_record`) hands out one message reference to its record; a
        load through ``Tensor.load_from_shared_memory`` takes it over, and this gives it back
        instead. The record is freed once nothing else uses it.

        Raises:
            TritonModelException: the handle is out of range, freed or not a tensor record,
                the record has no pending message (every save was loaded or released
                already), or the pool is closed.
        """
        self._call(self._drop_locked, handle, heap.RECORD, True, 0)

    def refcount(self, handle: int) -> int:
        """The current reference count of the allocation at ``handle`` (for diagnostics).

        Pending messages count: a saved record that nothing loaded yet has count 1.

        Raises:
            TritonModelException: the handle is out of range, freed or not an allocation.
        """
        return self._call(self._check_block, handle, None)[2]

    def pending_messages(self, handle: int) -> int:
        """How many saves of the record at ``handle`` were neither loaded nor released.

        Raises:
            TritonModelException: the handle is out of range, freed or not an allocation.
        """
        return self._call(self._check_block, handle, None)[3]

    def nbytes(self, handle: int) -> int:
        """The size requested for the allocation at ``handle``.

        Raises:
            TritonModelException: the handle is out of range, freed or not an allocation.
        """
        return self._call(self._check_block, handle, None)[1]

    # --------------------------------------------------------------------------------- views
    def view(self, handle: int, *, hold: bool = False) -> npt.NDArray[np.uint8]:
        """A zero-copy, writable ``uint8`` view of the allocation's ``nbytes`` bytes.

        The view keeps its mapping alive (it stays valid after the pool grows). With ``hold``
        it also holds a reference: the allocation lives until the view and every array derived
        from it are gone. Without ``hold`` the caller keeps the allocation alive.

        Raises:
            TritonModelException: the handle is out of range, freed or not an allocation.
        """
        if hold:
            holder = self._hold(handle, None, False, _whole)[1]
            view: npt.NDArray[np.uint8] = ndview(holder, np.ndarray)
            return view
        m, nbytes = self._call(self._plain_view_locked, handle)
        return m.base[handle + heap.PREFIX : handle + heap.PREFIX + nbytes]

    def _hold(
        self,
        handle: int,
        want: int | None,
        message: bool,
        parse: Callable[[Mapping, int, int], tuple[_P, int, int]],
        box: list[Held | None] | None = None,
    ) -> tuple[_P, Held]:
        """Take a reference to ``handle`` in one lock cycle, for a holder of a range of it.

        ``parse(mapping, handle, nbytes)`` runs first under the lock and returns ``(result,
        offset, length)``: the holder covers ``length`` bytes at ``offset`` from the data
        start. Nothing is taken when it raises. With ``message`` a pending message is taken
        over when there is one (see :meth:`_take`). With ``box`` the holder goes into
        ``box[0]`` before it takes anything: a caller whose ``try`` starts before this call
        can give the reference back (:meth:`_untake`) even when an asynchronous exception
        lands after the take, before this returns or before the caller stores the result.
        """
        if self._closed:
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        return self._op(self._hold_locked, handle, want, message, parse, next(_tokens), box)

    # ----------------------------------------------------------------------------- checking
    def stats(self) -> PoolStats:
        """Walk the heap, check it (block headers, boundary tags, free lists, counters).

        ``unloaded_records`` / ``unloaded_handles`` list the records saved and neither loaded
        nor released yet (a receiver that never came, or a leak).

        Raises:
            TritonModelException: the heap is inconsistent (the message says where), or the
                pool is closed.
        """
        return self._call(self._stats_locked)


def _nothing(m: Mapping) -> None:
    return None


def _whole(m: Mapping, handle: int, nbytes: int) -> tuple[None, int, int]:
    return None, 0, nbytes
