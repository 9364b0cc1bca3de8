"""The shared-memory pool behind :mod:`pb_tensor.shm` (private; import from ``pb_tensor.shm``).

One POSIX shared-memory object (a file under ``/dev/shm``) holds a heap (layout and allocator
in :mod:`pb_tensor.shm._heap`). Every process maps the whole file and addresses allocations by
byte offset (the *handle*), which means the same in every process whatever address its mapping
got: Triton's design (``SharedMemoryManager``) with a Python-side allocator and lock.

Locking: a re-entrant thread lock for the threads of one process plus ``flock`` on a
descriptor with its own open file description for processes. The kernel drops a ``flock`` when the
holder dies, so a killed process cannot deadlock the others; the heap's *dirty* word lets the
next holder repair what it left half-done.

Growth: the segment is extended with ``posix_fallocate`` (pages really reserved, so exhaustion
is an exception and never a SIGBUS) and the header's total size is updated; every process
compares it with its mapping on each access (one memory read) and maps the file again when it
grew. Old mappings are never closed: the views into them keep them alive and valid.

The segment is opened with ``os.open`` (what ``shm_open`` does on Linux), not with
:class:`multiprocessing.shared_memory.SharedMemory`: that keeps ``multiprocessing``'s
``resource_tracker`` away on every Python version, so no helper process unlinks a segment
that others still use (cpython#82300; ``track=False`` exists only from 3.13). Only the
creating process unlinks, on :meth:`SharedMemoryPool.close` or at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib
import itertools
import multiprocessing.util as mp_util
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from pb_tensor.errors import TritonModelException
from pb_tensor.shm import _heap as heap
from pb_tensor.shm._heap import PoolStats
from pb_tensor.shm._locked import Held, LockedHeap, ndview
from pb_tensor.shm._segment import (
    PAGE,
    SHM_DIR,
    Mapping,
    check_name,
    create_segment,
    is_sealed,
    open_segment,
    positive_int,
    reopen,
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


_live_pools: weakref.WeakSet[SharedMemoryPool] = weakref.WeakSet()
_tokens = itertools.count(1)
_get_ident: Final = threading.get_ident
_flock: Final = fcntl.flock
_LOCK_EX: Final = fcntl.LOCK_EX
_LOCK_UN: Final = fcntl.LOCK_UN
_u64_at: Final = heap.U64.unpack_from
# Views up to this size give their reference back in this process's next lock cycle instead of
# one of their own, up to this many at a time (a record stays allocated that much longer).
_DEFER_BYTES: Final = 1 << 16
_DEFER_COUNT: Final = 64
_T = TypeVar("_T")
_P = TypeVar("_P")


class SharedMemoryPool(LockedHeap):
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

    def __init__(
        self,
        *,
        _name: str,
        _map_fd: int,
        _creator: bool,
        _populate: bool,
        _size: int,
        _sealed: bool = False,
    ) -> None:
        """Internal: use :meth:`create` or :meth:`attach`."""
        # Until __init__ completes the object owns nothing: the caller closes _map_fd if this
        # raises, and __del__/close must not touch it.
        self._closed = True
        self._released = True
        self._name = _name
        self._path = os.path.join(SHM_DIR, _name)
        self._map_fd = _map_fd
        self._creator = _creator
        self._populate = _populate
        self._sealed = _sealed  # the segment cannot shrink (F_SEAL_SHRINK)
        # Re-entrant so that a reference dropped by a signal handler or a GC pass in the window
        # between acquiring the lock and recording the holder cannot deadlock (see _owner_died).
        self._tlock = threading.RLock()
        self._map_lock = threading.Lock()
        self._holder = 0
        self._pending: list[tuple[int, bool]] = []  # (token, restore) given back later
        # token -> (handle, holder): the references held by views. The weak reference lets
        # _sweep_locked give back what a holder's finaliser could not (an asynchronous
        # exception can stop a finaliser before its first line).
        self._owners: dict[int, tuple[int, weakref.ref[Held]]] = {}
        self._lock_fd = -1
        self._map = Mapping(_map_fd, _size, _populate, 0)
        # A second open file description used only for flock: mmap objects dup the mapping fd
        # on Python < 3.13, and a dup shares the description (and so the lock) with any process
        # that inherits it through fork; a private description makes the lock die with us.
        self._lock_fd = reopen(_map_fd, self._path)
        self._closed = False
        self._released = False
        _live_pools.add(self)
        # Import the Tensor glue now rather than at the first save: a fork while another
        # thread is inside that first import leaves the child waiting forever on the module's
        # import lock (CPython does not reset module locks in the child).
        importlib.import_module("pb_tensor.shm._tensors")
        # multiprocessing's fork children leave through os._exit, which skips atexit, and
        # clear the finalizers they inherit; this re-registers ours in each such child.
        mp_util.register_after_fork(self, _register_mp_exit)

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

    def _release_resources(self) -> None:
        # Under the thread lock: no other thread of ours is between lock and unlock.
        with self._tlock:
            if self._released:
                return
            self._released = True
            for fd in (self._lock_fd, self._map_fd):
                if fd >= 0:
                    os.close(fd)
            self._lock_fd = self._map_fd = -1
            # Dropping the mapping unmaps it, unless a view still references it: then the
            # last view unmaps it.
            del self._map

    def _shutdown(self) -> None:
        """At interpreter exit: give back the references still held by live views, close."""
        if self._released:
            return
        owners, self._owners = self._owners, {}
        for handle, _ in owners.values():
            with contextlib.suppress(TritonModelException):
                self._op(self._drop_locked, handle, None, False, 0)
        self.close()
        self._release_resources()

    def _after_fork_in_child(self) -> None:
        # The child is a new process: fresh thread locks (another thread may have held ours at
        # the fork), its own lock description, and no claim on the parent's references (the
        # views it inherited give nothing back) or on the name.
        self._tlock = threading.RLock()
        self._map_lock = threading.Lock()
        self._holder = 0
        self._pending = []
        self._owners = {}
        self._creator = False
        if self._lock_fd >= 0:
            inherited = self._lock_fd
            self._lock_fd = reopen(self._map_fd, self._path)
            os.close(inherited)
        if self._closed:
            self._release_resources()

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

    # ---------------------------------------------------------------------------- mapping
    def _check_file(self, m: Mapping) -> None:
        """Refuse to touch the mapping if another process truncated the segment under it.

        Every page of the mapping must still be backed by the file, or the first access would
        be a SIGBUS. A sealed segment cannot shrink, so it skips the ``fstat``.
        """
        if self._sealed:
            return
        size = os.fstat(self._map_fd).st_size
        if size < m.size:
            raise TritonModelException(
                f"Shared memory pool '{self._name}' was truncated by another process to "
                f"{size} bytes while {m.size} bytes are in use; it can no longer be accessed "
                "safely (views of it taken before may fault)"
            )

    def _mapping(self) -> Mapping:
        """The current mapping, remapped first if any process grew the pool (one read)."""
        if self._closed:
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        m = self._map
        self._check_file(m)
        # Sizes only grow; a mapping ahead of the header is this process mid-growth.
        if heap.U64.unpack_from(m.mm, heap.OFF_TOTAL)[0] > m.size:
            m = self._remap()
        return m

    def _remap(self, at_least: int = 0) -> Mapping:
        with self._map_lock:
            m = self._map
            total = max(int(heap.U64.unpack_from(m.mm, heap.OFF_TOTAL)[0]), at_least)
            if total <= m.size:
                return m
            file_size = os.fstat(self._map_fd).st_size
            if total > file_size or total % PAGE:
                # Mapping past the end of the file would turn every access into SIGBUS.
                raise TritonModelException(
                    f"Shared memory pool '{self._name}' is corrupted: header size {total} "
                    f"bytes, segment {file_size} bytes"
                )
            # The old mapping is not closed: views into it keep it alive and valid.
            new = Mapping(self._map_fd, total, self._populate, m.size)
            self._map = new
            return new

    # ------------------------------------------------------------------------------ locking
    def _op(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(mapping, *args)`` holding the pool lock; its result.

        Written so that an asynchronous exception (a signal handler raising, a MemoryError)
        at any point leaves no lock held: the thread lock is taken by ``with`` (atomic with
        entering the block), and the ``flock`` is dropped by the first call of ``finally``.
        Each ``fn`` keeps the same rule for what it hands over (see :meth:`_take`).

        Raises:
            TritonModelException: the pool is closed or truncated, or this thread is already
                inside an operation on it (a signal handler or finaliser re-entering).
        """
        with self._tlock:
            if self._released:  # closed by another thread while we waited
                raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
            if self._holder:
                # Only this thread can be here while _holder is set (the lock is ours): a
                # signal handler or finaliser started an operation inside another one, whose
                # heap changes may be half done.
                raise TritonModelException(
                    f"Shared memory pool '{self._name}': an operation was started from a "
                    "signal handler or finaliser while this thread was inside another one"
                )
            try:
                self._holder = _get_ident()
                _flock(self._lock_fd, _LOCK_EX)
                m = self._map
                if not self._sealed:
                    self._check_file(m)
                # Another thread or process may have grown the heap while we waited: its free
                # lists can point past our mapping.
                if _u64_at(m.mm, heap.OFF_TOTAL)[0] > m.size:
                    m = self._remap()
                if self._pending:
                    self._drain(m)
                result = fn(m, *args)
                if self._pending:
                    self._drain(m)
                return result
            finally:
                self._holder = 0
                _flock(self._lock_fd, _LOCK_UN)

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """:meth:`_op` for public operations: refuses a closed pool first."""
        if self._closed:
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        return self._op(fn, *args)

    def _drain(self, m: Mapping) -> None:
        # References dropped by this thread while it held the lock (a GC pass or a signal
        # handler inside an operation) are given back here, at a safe point.
        pending = self._pending
        while pending:
            token, restore = pending.pop()
            with contextlib.suppress(TritonModelException):
                self._give_back_locked(m, token, restore)

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

    def _untake(self, payload: npt.NDArray[np.uint8]) -> None:
        """Undo a load that failed after it took its reference (``payload``: the record's
        view): a taken message becomes pending again, another reference is dropped. No view
        of the payload may be in use any more."""
        holder = payload.base
        if isinstance(holder, Held) and holder._token:
            self._op(self._give_back_locked, holder._token, holder._message)
            holder._token = 0

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
    ) -> tuple[_P, Held]:
        """Take a reference to ``handle`` in one lock cycle, for a holder of a range of it.

        ``parse(mapping, handle, nbytes)`` runs first under the lock and returns ``(result,
        offset, length)``: the holder covers ``length`` bytes at ``offset`` from the data
        start. Nothing is taken when it raises. With ``message`` a pending message is taken
        over when there is one (see :meth:`_take`).
        """
        if self._closed:
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        return self._op(self._hold_locked, handle, want, message, parse, next(_tokens))

    def _owner_died(self, token: int, restore: bool, nbytes: int) -> None:
        if self._released or token not in self._owners:
            return
        if self._holder == _get_ident() or (
            nbytes <= _DEFER_BYTES and len(self._pending) < _DEFER_COUNT and not self._closed
        ):
            # Inside an operation of this thread (a GC pass or a signal handler), or a small
            # view: give the reference back under the next lock cycle of this process (each
            # operation starts by draining these), not in a lock cycle of its own. Appending
            # is one call: nothing can interrupt it half-way.
            self._pending.append((token, restore))
            return
        try:
            self._op(self._give_back_locked, token, restore)
        finally:
            if self._closed and not self._owners:
                self._release_resources()

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


def _register_mp_exit(pool: SharedMemoryPool) -> None:
    mp_util.Finalize(pool, _shutdown_ref, args=(weakref.ref(pool),), exitpriority=0)


def _shutdown_ref(ref: weakref.ref[SharedMemoryPool]) -> None:
    pool = ref()
    if pool is not None:
        pool._shutdown()


def _after_fork_in_child() -> None:
    for pool in list(_live_pools):
        if not pool._released:
            pool._after_fork_in_child()


def _at_exit() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(TritonModelException, OSError):
            pool._shutdown()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
