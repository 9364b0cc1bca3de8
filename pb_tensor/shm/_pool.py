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
import itertools
import multiprocessing.util as mp_util
import os
import secrets
import threading
import weakref
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from pb_tensor.errors import TritonModelException
from pb_tensor.shm import _heap as heap
from pb_tensor.shm._heap import PoolStats
from pb_tensor.shm._segment import (
    PAGE,
    SHM_DIR,
    Mapping,
    check_name,
    create_segment,
    extend_segment,
    open_segment,
    positive_int,
    reopen,
    round_up,
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


class _Owner:
    """The ``base`` of every view that holds a reference: dropping the last view drops the ref.

    numpy builds the view from ``__array_interface__``; the owner keeps the mapping alive
    through ``_mapping`` and gives its reference back when garbage collected.
    """

    __slots__ = ("__array_interface__", "__weakref__", "_handle", "_mapping", "_pool", "_token")

    __array_interface__: dict[str, Any]
    _pool: SharedMemoryPool
    _token: int
    _handle: int
    _mapping: Mapping

    def __del__(self) -> None:
        # Never raise from a finaliser (a corrupted header is reported by the next explicit
        # operation), and look up no module global: this may run during interpreter shutdown.
        try:  # noqa: SIM105
            self._pool._owner_died(self._token)
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<pb_tensor shared-memory allocation {self._handle} in pool {self._pool.name!r}>"


_live_pools: weakref.WeakSet[SharedMemoryPool] = weakref.WeakSet()
_tokens = itertools.count(1)


class SharedMemoryPool:
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
        # Re-entrant so that a reference dropped by a signal handler or a GC pass in the window
        # between acquiring the lock and recording the holder cannot deadlock (see _owner_died).
        self._tlock = threading.RLock()
        self._map_lock = threading.Lock()
        self._holder = 0
        self._pending: list[int] = []
        self._owners: dict[int, int] = {}  # token -> handle, for references held by views
        self._lock_fd = -1
        self._map = Mapping(_map_fd, _size, _populate, 0)
        # A second open file description used only for flock: mmap objects dup the mapping fd
        # on Python < 3.13, and a dup shares the description (and so the lock) with any process
        # that inherits it through fork; a private description makes the lock die with us.
        self._lock_fd = reopen(_map_fd, self._path)
        self._closed = False
        self._released = False
        _live_pools.add(self)
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
    ) -> SharedMemoryPool:
        """Create a new pool of ``size`` bytes (rounded up to whole pages) under ``name``.

        ``growth`` is the step by which the pool grows when an allocation does not fit (it
        grows by as many steps as needed); ``max_size`` caps the total size (``None``: only
        the free space of ``/dev/shm`` limits it). A missing ``name`` picks a unique one. With
        ``populate`` the pages are pre-faulted into this process (faster first writes).
        The memory is reserved with ``posix_fallocate``, so exhaustion shows up here as an
        exception, never later as SIGBUS.

        Raises:
            TritonModelException: a bad argument, a name already in use, or not enough room in
                ``/dev/shm`` (the message gives the requested and available sizes).
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
        fd = create_segment(name, size, growth, 0 if max_size is None else max_size)
        try:
            return cls(_name=name, _map_fd=fd, _creator=True, _populate=populate, _size=size)
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
            return cls(_name=name, _map_fd=fd, _creator=False, _populate=populate, _size=total)
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
        for handle in owners.values():
            with contextlib.suppress(TritonModelException):
                self._decref(handle, None)
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
    def is_creator(self) -> bool:
        """Whether this object created the segment (and will unlink it)."""
        return self._creator

    # ---------------------------------------------------------------------------- mapping
    def _mapping(self) -> Mapping:
        """The current mapping, remapped first if any process grew the pool (one read)."""
        if self._closed:
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        m = self._map
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
    def _acquire(self) -> Mapping:
        """Take the pool lock; the mapping, caught up with growth that happened meanwhile."""
        self._tlock.acquire()
        if self._released:  # closed by another thread while we waited
            self._tlock.release()
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        outer = self._holder
        self._holder = threading.get_ident()
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        except BaseException:
            self._holder = outer
            self._tlock.release()
            raise
        m = self._map
        # Another thread or process may have grown the heap while we waited: its free lists
        # can point past our mapping.
        if heap.U64.unpack_from(m.mm, heap.OFF_TOTAL)[0] > m.size:
            try:
                m = self._remap()
            except BaseException:
                self._release()
                raise
        return m

    def _locked(self) -> Mapping:
        """:meth:`_acquire` for public operations: refuses a closed pool first."""
        if self._closed:
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        return self._acquire()

    def _release(self) -> None:
        try:
            # References dropped by this thread while it held the lock (a GC pass or a signal
            # handler inside an operation) are given back here, at a safe point.
            while self._pending:
                handle = self._pending.pop()
                with contextlib.suppress(TritonModelException):
                    self._decref_locked(self._map, handle, None)
        finally:
            self._holder = 0
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                self._tlock.release()

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
        return self._allocate(nbytes, heap.RAW)

    def _allocate(self, nbytes: int, state: int) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TritonModelException(
                f"Allocation size must be an int, not {type(nbytes).__name__}"
            )
        if nbytes < 0:
            raise TritonModelException(f"Allocation size must be >= 0, got {nbytes}")
        need = heap.block_size(nbytes)
        m = self._locked()
        try:
            heap.check_heap(m.mm, m.size, self._name)
            off = heap.find_fit(m.mm, need, m.size, self._name)
            if off == 0:
                m = self._grow(m, need, nbytes)
                off = heap.find_fit(m.mm, need, m.size, self._name)
            heap.allocate_block(m.mm, off, need, nbytes, state, m.size, self._name)
        finally:
            self._release()
        return off + heap.BLOCK_HDR

    def _grow(self, m: Mapping, need: int, nbytes: int) -> Mapping:
        """Under the lock: extend the heap so a block of ``need`` bytes fits; the new mapping."""
        mm = m.mm
        total = int(heap.U64.unpack_from(mm, heap.OFF_TOTAL)[0])
        growth = int(heap.U64.unpack_from(mm, heap.OFF_GROWTH)[0])
        max_size = int(heap.U64.unpack_from(mm, heap.OFF_MAX)[0])
        extra = need - heap.tail_free_size(mm, total)
        new_total = extend_segment(self._map_fd, self._name, total, extra, growth, max_size, nbytes)
        m = self._remap(new_total)
        heap.extend(m.mm, total, new_total)
        return m

    # ------------------------------------------------------------------------ ref counting
    def _check_block(self, m: Mapping, handle: int, want: int | None) -> tuple[int, int, int]:
        """Validate the allocation at ``handle`` (lock held); its state, nbytes and count."""
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
        magic, state, size, _, nbytes, _, _, refcount = heap.BLOCK.unpack_from(m.mm, off)
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
        if want is not None and state != want:
            kind = "a tensor record" if want == heap.RECORD else "a raw allocation"
            raise TritonModelException(f"Shared memory handle {handle} is not {kind}")
        return state, nbytes, refcount

    def incref(self, handle: int) -> None:
        """Add a reference to the allocation at ``handle``.

        Raises:
            TritonModelException: the handle is out of range, freed, not an allocation, or its
                count would overflow; or the pool is closed.
        """
        m = self._locked()
        try:
            self._incref_locked(m, handle, None)
        finally:
            self._release()

    def _incref_locked(self, m: Mapping, handle: int, want: int | None) -> int:
        _, nbytes, refcount = self._check_block(m, handle, want)
        if refcount >= heap.MAX_REFCOUNT:
            raise TritonModelException(
                f"Shared memory handle {handle}: reference count overflow ({refcount})"
            )
        heap.U32.pack_into(m.mm, handle, refcount + 1)
        return nbytes

    def decref(self, handle: int) -> None:
        """Drop a reference to the allocation at ``handle``; free it when none is left.

        Raises:
            TritonModelException: the handle is out of range, freed or not an allocation, the
                heap around it is corrupted, or the pool is closed.
        """
        if self._closed:
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        self._decref(handle, None)

    def _decref(self, handle: int, want: int | None) -> None:
        if self._released:
            raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
        m = self._acquire()
        try:
            self._decref_locked(m, handle, want)
        finally:
            self._release()

    def _decref_locked(self, m: Mapping, handle: int, want: int | None) -> None:
        _, _, refcount = self._check_block(m, handle, want)
        if refcount > 1:
            heap.U32.pack_into(m.mm, handle, refcount - 1)
            return
        heap.check_heap(m.mm, m.size, self._name)
        heap.free_block(m.mm, handle - heap.BLOCK_HDR, self._name)

    def refcount(self, handle: int) -> int:
        """The current reference count of the allocation at ``handle`` (for diagnostics).

        Raises:
            TritonModelException: the handle is out of range, freed or not an allocation.
        """
        m = self._locked()
        try:
            return self._check_block(m, handle, None)[2]
        finally:
            self._release()

    def nbytes(self, handle: int) -> int:
        """The size requested for the allocation at ``handle``.

        Raises:
            TritonModelException: the handle is out of range, freed or not an allocation.
        """
        m = self._locked()
        try:
            return self._check_block(m, handle, None)[1]
        finally:
            self._release()

    # --------------------------------------------------------------------------------- views
    def view(self, handle: int, *, hold: bool = False) -> npt.NDArray[np.uint8]:
        """A zero-copy, writable ``uint8`` view of the allocation's ``nbytes`` bytes.

        The view keeps its mapping alive (it stays valid after the pool grows). With ``hold``
        it also holds a reference: the allocation lives until the view and every array derived
        from it are gone. Without ``hold`` the caller keeps the allocation alive.

        Raises:
            TritonModelException: the handle is out of range, freed or not an allocation.
        """
        m = self._locked()
        try:
            if hold:
                nbytes = self._incref_locked(m, handle, None)
            else:
                nbytes = self._check_block(m, handle, None)[1]
        finally:
            self._release()
        if hold:
            return self._owned_view(m, handle, handle + heap.PREFIX, nbytes, False)
        return m.base[handle + heap.PREFIX : handle + heap.PREFIX + nbytes]

    def _owned_view(
        self, m: Mapping, handle: int, offset: int, length: int, readonly: bool
    ) -> npt.NDArray[np.uint8]:
        """Wrap a reference already taken on ``handle`` in a view that gives it back."""
        owner = _Owner()
        owner._pool = self
        owner._handle = handle
        owner._mapping = m
        token = next(_tokens)
        owner._token = token
        owner.__array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (m.addr + offset, readonly),
            "version": 3,
        }
        self._owners[token] = handle
        return cast("npt.NDArray[np.uint8]", np.asarray(owner))

    def _owner_died(self, token: int) -> None:
        handle = self._owners.pop(token, None)
        if handle is None or self._released:
            return
        if self._holder == threading.get_ident():
            self._pending.append(handle)
            return
        m = self._acquire()
        try:
            self._decref_locked(m, handle, None)
        finally:
            self._release()
            if self._closed and not self._owners:
                self._release_resources()

    # ----------------------------------------------------------------------------- checking
    def stats(self) -> PoolStats:
        """Walk the heap, check it (block headers, boundary tags, free lists, counters).

        Raises:
            TritonModelException: the heap is inconsistent (the message says where), or the
                pool is closed.
        """
        m = self._locked()
        try:
            heap.check_heap(m.mm, m.size, self._name)
            return heap.walk(m.mm, m.size, self._name, repair=False)
        finally:
            self._release()


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
