"""One process's hold on a pool: mapping, lock, references, fork and exit (private).

:class:`MappedHeap` is the base of :class:`pb_tensor.shm._pool.SharedMemoryPool` that keeps
what belongs to this process alone: its mapping of the segment, the pool lock, the references
held by its views, and what becomes of them at fork and at interpreter exit. The subclass adds
the lifecycle (create, attach, close) and the public methods; what runs under the lock is in
:class:`pb_tensor.shm._locked.LockedHeap`, the base of this one.

Locking: a re-entrant thread lock for the threads of one process plus ``flock`` on a
descriptor with its own open file description for processes. The kernel drops a ``flock`` when the
holder dies, so a killed process cannot deadlock the others; the heap's *dirty* word lets the
next holder repair what it left half-done.

Growth: the segment is extended with ``posix_fallocate`` (pages really reserved, so exhaustion
is an exception and never a SIGBUS) and the header's total size is updated; every process
compares it with its mapping on each access (one memory read) and maps the file again when it
grew. Old mappings are never closed: the views into them keep them alive and valid.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib
import multiprocessing.util as mp_util
import os
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Final, TypeVar

from pb_tensor.errors import TritonModelException
from pb_tensor.shm import _heap as heap
from pb_tensor.shm._held import Held, new_lock
from pb_tensor.shm._locked import LockedHeap
from pb_tensor.shm._segment import PAGE, SHM_DIR, Mapping, reopen

__all__ = ["MappedHeap"]

_live_pools: weakref.WeakSet[MappedHeap] = weakref.WeakSet()
_get_ident: Final = threading.get_ident
_getframe: Final = sys._getframe
_flock: Final = fcntl.flock
_LOCK_EX: Final = fcntl.LOCK_EX
_LOCK_UN: Final = fcntl.LOCK_UN
_u64_at: Final = heap.U64.unpack_from
_T = TypeVar("_T")


class MappedHeap(LockedHeap):
    """The per-process half of ``SharedMemoryPool`` (its base): mapping, lock, references."""

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
        """Internal: use ``SharedMemoryPool.create`` or ``SharedMemoryPool.attach``."""
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
        self._tlock = new_lock()
        self._map_lock = new_lock()  # re-entrant for its ownership test (_held.OwnedLock)
        self._holder = 0
        # (token, restore) given back later; or the weak reference of an owner entry whose
        # holder died before giving it back (see _on_dead).
        self._pending: list[tuple[int, bool] | weakref.ref[Held]] = []
        # The callback of every owner's weak reference, so C code with no Python frame that
        # an asynchronous exception could cut short: it runs only when a holder dies while its
        # owner entry is still there (a finaliser that gave the reference back removed the
        # entry, and with it the weak reference, first), and queues a sweep of dead owners for
        # the next operation. Without it the reference would wait for the periodic sweep.
        self._on_dead = self._pending.append
        # token -> (handle, holder): the references held by views. The weak reference lets
        # _sweep_locked give back what a holder's finaliser could not (an asynchronous
        # exception can stop a finaliser before its first line).
        self._owners: dict[int, tuple[int, weakref.ref[Held], list[bool]]] = {}
        # id(cell) -> cell: the cells that saves hand their message to (see _sweep_locked).
        self._messages: dict[int, list[int]] = {}
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

    def close(self) -> None:
        raise NotImplementedError  # SharedMemoryPool's

    # ----------------------------------------------------------------------------- lifecycle
    def _release_resources(self) -> None:
        # Under the thread lock: no other thread of ours is between lock and unlock.
        tlock = self._tlock
        outer = not tlock._is_owned()
        try:
            with tlock:
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
        finally:
            if outer and tlock._is_owned():  # the with's exit never ran (_held.OwnedLock)
                tlock.release()

    def _shutdown(self) -> None:
        """At interpreter exit: give back the references still held by live views, close."""
        if self._released:
            return
        owners, self._owners = self._owners, {}
        for handle, _, _ in owners.values():
            with contextlib.suppress(TritonModelException):
                self._op(self._drop_locked, handle, None, False, 0)
        self.close()
        self._release_resources()

    def _after_fork_in_child(self) -> None:
        # The child is a new process: fresh thread locks (another thread may have held ours at
        # the fork), its own lock description, and no claim on the parent's references (the
        # views it inherited give nothing back) or on the name.
        self._tlock = new_lock()
        self._map_lock = new_lock()
        self._holder = 0
        self._pending = []
        self._on_dead = self._pending.append
        self._owners = {}
        self._messages = {}  # the parent's saves in flight are the parent's to finish
        self._creator = False
        if self._lock_fd >= 0:
            inherited = self._lock_fd
            self._lock_fd = reopen(self._map_fd, self._path)
            os.close(inherited)
        if self._closed:
            self._release_resources()

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
        lock = self._map_lock
        outer = not lock._is_owned()
        try:
            with lock:
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
        finally:
            if outer and lock._is_owned():  # the with's exit never ran (_held.OwnedLock)
                lock.release()

    # ------------------------------------------------------------------------------ locking
    def _op(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(mapping, *args)`` holding the pool lock; its result.

        Written so that an asynchronous exception (a signal handler raising, a MemoryError)
        at any point leaves no lock held for good and no marker that refuses later work: the
        thread lock is taken by ``with`` (atomic with entering the block) and the marker is
        set by the block's first instruction, before any point where a handler runs. Where
        exceptions cut the cleanup short at every step (CPython 3.10 runs handlers on entry to
        ``except`` / ``finally`` clauses too), the next operation of this thread finds the
        marks of the abandoned one and clears them (:meth:`_recover`); any thread's next
        operation clears a marker or ``flock`` left behind once the thread lock was released.
        Each ``fn`` keeps the same rule for what it hands over (see :meth:`_take`).

        Raises:
            TritonModelException: the pool is closed or truncated, or this thread is inside
                an operation on it (a signal handler or finaliser started this one there).
        """
        me = _get_ident()
        tlock = self._tlock
        # Only this thread writes its own id to _holder, and only the owner sees _is_owned():
        # both tests are exact without the lock. Either means an operation of this thread on
        # this pool is running further up the stack (refused: its heap changes may be half
        # done) or was abandoned with its marks in place (cleared). No operation takes the
        # lock inside another one of its thread, so a thread holds it at most once.
        if self._holder == me or tlock._is_owned():
            self._recover(me)
        try:
            with tlock:
                self._holder = me  # first: no point since the acquisition where a handler ran
                try:
                    if self._released:  # closed by another thread while we waited
                        raise TritonModelException(f"Shared memory pool '{self._name}' is closed")
                    _flock(self._lock_fd, _LOCK_EX)
                    m = self._map
                    if not self._sealed:
                        self._check_file(m)
                    # Another thread or process may have grown the heap while we waited: its
                    # free lists can point past our mapping.
                    if _u64_at(m.mm, heap.OFF_TOTAL)[0] > m.size:
                        m = self._remap()
                    if self._pending:
                        self._drain(m)
                    result = fn(m, *args)
                    if self._pending:
                        self._drain(m)
                    return result
                finally:
                    # A try first: CPython 3.10 runs no signal handler on entry to a handler
                    # that starts with one (it does on entry to any other).
                    try:
                        self._holder = 0
                    finally:
                        if self._lock_fd >= 0:  # -1: closed by another thread while we waited
                            _flock(self._lock_fd, _LOCK_UN)
        except BaseException:
            # The with statement's exit never ran if this thread still holds the lock (a
            # MemoryError allocating its arguments, see _held.OwnedLock; on 3.10 a handler at
            # its entry). Only on this path: the normal one pays nothing.
            if tlock._is_owned():
                if self._holder == me:  # no call between the test and the store
                    self._holder = 0
                if self._lock_fd >= 0:
                    _flock(self._lock_fd, _LOCK_UN)
                tlock.release()
            raise

    def _recover(self, me: int) -> None:
        """Refuse an operation nested in a running one of this thread; else clear the marks
        of one this thread abandoned (held lock, marker, ``flock``), so that the pool never
        refuses work for good.

        An operation is running if its frame (or that of :meth:`_release_resources`, the
        other holder of the lock) is on this thread's stack: frames that an exception left
        are no longer executing, whatever still refers to them.

        Raises:
            TritonModelException: an operation of this thread on this pool is running (this
                one was started by a signal handler or finaliser inside it).
        """
        if _running(self, 2):  # above _op's own frame
            raise TritonModelException(
                f"Shared memory pool '{self._name}': an operation was started from a "
                "signal handler or finaliser while this thread was inside another one"
            )
        tlock = self._tlock
        if tlock._is_owned():
            # Nobody else can be inside an operation: the marker and the flock are this
            # thread's to drop, and the lock is held for nothing (once: see _op).
            if self._holder == me:
                self._holder = 0
            if self._lock_fd >= 0:
                _flock(self._lock_fd, _LOCK_UN)
            tlock.release()
        elif self._holder == me:  # no call between the test and the store: exact
            # The lock was given back but the marker was not: another thread holding the
            # lock would have set its own. A flock left held goes with this operation's.
            self._holder = 0

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
            item = pending.pop()
            with contextlib.suppress(TritonModelException):
                if type(item) is tuple:
                    self._give_back_locked(m, item[0], item[1])
                else:  # a holder died before giving back (see _on_dead)
                    self._sweep_owners_locked(m)

    def _owner_died(self, token: int, restore: bool) -> None:
        # The reference is given back before this returns, in a lock cycle of its own: a
        # process may end with os._exit right after, which runs no exit hook.
        if self._released or token not in self._owners:
            return
        if self._holder == _get_ident() and _running(self, 1):
            # Inside an operation of this thread (a GC pass or a signal handler): given back
            # at the end of that operation, before it returns (it drains these). Appending is
            # one call: nothing can interrupt it half-way. A marker an abandoned operation left
            # is not that: _op clears it and gives the reference back now. (The other holder
            # of the lock, _release_resources, runs only once no owner is left: see above.)
            self._pending.append((token, restore))
            return
        try:
            self._op(self._give_back_locked, token, restore)
        finally:
            if self._closed and not self._owners:
                self._release_resources()


def _running(pool: MappedHeap, depth: int) -> bool:
    """Whether an operation on ``pool`` (that holds its thread lock) is running in this thread:
    one of its frames is on the stack, from ``depth`` frames above the caller up. Walked only
    when this thread's marks are found."""
    frame: FrameType | None = _getframe(depth + 1)
    while frame is not None:
        if frame.f_code in _LOCK_HOLDERS and frame.f_locals.get("self") is pool:
            return True
        frame = frame.f_back
    return False


# The frames that hold the pool's thread lock: _op, and _release_resources (which never runs
# an operation while it holds it).
_LOCK_HOLDERS: Final = frozenset((MappedHeap._op.__code__, MappedHeap._release_resources.__code__))


def _register_mp_exit(pool: MappedHeap) -> None:
    mp_util.Finalize(pool, _shutdown_ref, args=(weakref.ref(pool),), exitpriority=0)


def _shutdown_ref(ref: weakref.ref[MappedHeap]) -> None:
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
