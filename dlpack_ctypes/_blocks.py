"""The live export registry, the deleter and the pending-capsule sweep (shared privately).

Lifetime model:

* Each export allocates one ctypes block holding the managed struct followed by ``shape`` and
  ``strides``. ``LIVE[address] = (block, owner)`` keeps the block and the data's owner alive
  until the deleter runs. The deleter is one immortal ``CFUNCTYPE(None, c_void_p)`` thunk whose
  Python target is ``LIVE.pop``, a builtin: it needs no module globals, works when a consumer
  calls it from a foreign thread or while an exception is pending, and runs no bytecode, so no
  signal handler can raise before the release. After the exit flush what it would drop is also
  kept elsewhere (it leaks on purpose during interpreter teardown).
* Consumed tensors (the consumer side, :class:`~dlpack_ctypes.consumer.DLPackTensor`) own their
  producer's tensor through an :data:`OWNED` entry; a tensor whose finaliser was interrupted
  reaches ``DEAD`` through its weak reference's callback and is released by the next sweep
  (:mod:`dlpack_ctypes._owned`; the sweeps here drive it).
* Capsules are created **without a destructor**. A ctypes destructor cannot run while an
  exception is pending without either losing the deleter call or turning the consumer's error
  into ``SystemError`` (numpy#32697). Instead every exported capsule is remembered in a pending
  queue and *swept* at safe points. A swept capsule that still carries its fresh name and that
  nobody else references was never consumed, so the sweep runs the deleter for it; a renamed
  one belongs to its consumer and simply leaves the queue.
* The work per sweep is bounded (see :data:`SWEEP_LIMIT`, :data:`EXPORT_SWEEP_STEP` and
  :data:`GC_SWEEP_STEP`): capsules that are held for a long time cost a constant amount per
  export and per garbage collection, never a pass over the whole queue.

Everything here is shared by the producer and the exporters; the public names are re-exported
by :mod:`dlpack_ctypes.producer`. :mod:`dlpack_ctypes._pack` packs the blocks and makes the
capsules; :mod:`dlpack_ctypes._shapes` checks shapes and computes strides.
"""

from __future__ import annotations

# _thread, not threading: the same C locks and thread ids, without importing threading.
import _thread
import atexit
import collections
import ctypes
import gc
import os
import struct
import sys
from collections.abc import Callable
from typing import Any, Final, cast

from dlpack_ctypes import _capi
from dlpack_ctypes._owned import DEAD, release_dead
from dlpack_ctypes.abi import DLDeviceType

__all__ = [
    "DELETER_ADDRESS",
    "DELETER_TARGET",
    "DEVICE_TYPES",
    "EXPORT_SWEEP_STEP",
    "GC_SWEEP_EVERY",
    "GC_SWEEP_STEP",
    "LIVE",
    "PENDING",
    "SWEEP_LIMIT",
    "deleter_impl",
    "flush",
    "live_exports",
    "pending_count",
]

DEVICE_TYPES: Final = frozenset(int(d) for d in DLDeviceType)

#: Pending capsules beyond which an export also sweeps the queue: up to this many entries whose
#: capsule is released (consumed and released, or dropped), of which at most
#: :data:`EXPORT_SWEEP_STEP` still-held ones.
SWEEP_LIMIT: Final = 64
#: Still-held queue entries examined by an export while more than :data:`SWEEP_LIMIT` are
#: pending. Larger than one, so the queue shrinks while it holds dropped capsules.
EXPORT_SWEEP_STEP: Final = 4
#: Queue entries examined after every :data:`GC_SWEEP_EVERY`-th garbage collection (and after
#: every full one, which costs far more than that anyway): a quarter
#: of an entry per collection on average, so that even a collection of an empty generation
#: costs at most about twice what it costs with nothing pending.
GC_SWEEP_STEP: Final = 4
#: See :data:`GC_SWEEP_STEP`.
GC_SWEEP_EVERY: Final = 16

# --------------------------------------------------------------------------------------------
# Registry and deleter

LIVE: dict[int, tuple[object, object]] = {}
# _STATE[0]: set by the atexit hook; from then on deleters leak instead of touching Python state
# that teardown may already have cleared.
_STATE: list[bool] = [False]
_capi.immortalize(LIVE)
_capi.immortalize(_STATE)


def deleter_impl(addr: int | None, _live: Any = LIVE, _state: Any = _STATE) -> None:
    """Forget the export at ``addr`` (the sweep's release of a capsule dropped unconsumed).

    Pure bytecode on purpose (no calls), with everything it needs as a default argument.
    """
    if _state[0]:
        return
    if addr in _live:
        del _live[addr]


# The deleter every export carries calls ``LIVE.pop`` itself: a builtin, so the hand-over
# from the consumer runs no Python bytecode, where a signal handler could raise before the
# release (a handler runs only between bytecodes). After the exit flush the registry's entries
# are also kept in _KEPT, so a deleter called during teardown releases nothing.
_DELETER: Final = _capi.VOIDFN(LIVE.pop)
_capi.immortalize(_DELETER)
_KEPT: list[object] = []
_capi.immortalize(_KEPT)
#: The C address of this package's deleter (what every export's ``deleter`` field holds).
DELETER_ADDRESS: Final[int] = cast(int, ctypes.cast(_DELETER, ctypes.c_void_p).value)
#: What the deleter at :data:`DELETER_ADDRESS` calls (``LIVE.pop``); consumers in this package
#: call it directly instead of going through the C thunk.
DELETER_TARGET: Final = LIVE.pop

# --------------------------------------------------------------------------------------------
# Pending capsules (deferred release)

#: ``(capsule, block, address, fresh name address)`` of every export not yet known consumed.
PENDING: collections.deque[tuple[object, object, int, int]] = collections.deque()
_capi.immortalize(PENDING)
# Re-entrant: dropping an owner during a sweep can run user finalisers that call flush().
_SWEEP_LOCK = _thread.RLock()
_OWNER: list[int] = [0]  # the thread sweeping now (0: none)
_get_ident = _thread.get_ident
_getrefcount = sys.getrefcount
_is_valid = _capi.PyCapsule_IsValid
_NAME_OFFSET: Final = _capi.CAPSULE_NAME_OFFSET
_MEM: Final = _capi.MEM
_unpack_ptr = struct.Struct("@P").unpack_from


def _sweep(
    budget: int, pending: Any = PENDING, live: Any = LIVE, rc_base: int = 0, held: int = -1
) -> int:
    """Examine up to ``budget`` pending capsules, oldest first; returns how many are pending.

    ``held`` >= 0 also ends the sweep once that many still-held capsules were examined (each
    such check costs a ``getrefcount``; a released entry costs no more than its removal, which
    every entry needs once anyway).

    An entry leaves the queue when its deleter already ran (the registry no longer holds *its*
    block: the block stays in the entry, so a recycled address can never be mistaken for it),
    or when nobody else references the capsule: renamed, the consumer owns it; still fresh, it
    was dropped unconsumed and is released here. Held capsules go to the back.

    Callers hold the sweep lock, so the front entry is this sweep's until it moves it. It is
    read in place and only then rotated or removed: an exception at any point (an asynchronous
    one included) leaves every entry in the queue, never in a local variable only.
    """
    mem = _MEM
    offset = _NAME_OFFSET
    for _ in range(min(budget, len(pending))):
        try:
            cap, block, addr, fresh = pending[0]
        except IndexError:
            break
        found = live.get(addr)
        if found is not None and found[0] is block:
            # The queue's entry, the unpacked local and getrefcount's argument hold it. A held
            # capsule stays queued even when renamed: a consumer still holding it may yet undo
            # its claim (it does when interrupted before the import completes).
            if _getrefcount(cap) > rc_base:
                pending.rotate(-1)
                held -= 1
                if not held:
                    break
                continue
            if offset is not None:
                renamed = _unpack_ptr(mem, id(cap) + offset)[0] != fresh
            else:
                renamed = not _is_valid(cap, fresh)
            if not renamed:
                deleter_impl(addr, live)  # dropped without being consumed
        # Gone (our deleter ran), dropped after a consumer renamed it (the consumer calls the
        # deleter), or released just now.
        del cap
        pending.popleft()
    return len(pending)


def _calibrate_refcount() -> int:
    # The reference count _sweep sees for a capsule that only the queue holds depends on the
    # interpreter's calling conventions; find it by running the sweep itself on a probe capsule.
    block = object()
    for base in range(1, 16):
        probe: collections.deque[tuple[object, object, int, int]] = collections.deque()
        capsule = _capi.PyCapsule_New(_capi.ADDR_DLTENSOR, _capi.ADDR_DLTENSOR, None)
        probe.append((capsule, block, -1, _capi.ADDR_DLTENSOR))
        del capsule
        live = {-1: (block, None)}
        if _sweep(1, probe, live, base) == 0 and not live:
            return base
    raise ImportError("dlpack_ctypes: could not calibrate capsule reference counts")


_RC_BASE: Final = _calibrate_refcount()


def flush() -> int:
    """Release every exported capsule that was dropped without being consumed.

    Sweeps also happen automatically (a bounded number of capsules during exports and after
    garbage collections, all of them at exit); call this where memory must be released at a
    known point, e.g. in tests.

    Returns:
        The number of exports still alive afterwards (consumed but not yet released by their
        consumer, or capsules still referenced).
    """
    if DEAD:
        release_dead()
    _locked_sweep(len(PENDING))
    return len(LIVE)


def live_exports() -> int:
    """Number of exports whose deleter has not run yet (after sweeping dropped capsules)."""
    return flush()


def pending_count() -> int:
    """Number of exported capsules the sweep still tracks (for tests and diagnostics)."""
    return len(PENDING)


def _locked_sweep(budget: int, held: int = -1) -> None:
    # Releasing an export can run finalisers that export, collect garbage or flush: such a
    # nested sweep on the sweeping thread is skipped (the outer sweep owns the queue's front).
    # After the exit flush deleters leak on purpose, so sweeping then would only wait for a lock
    # that a thread frozen by interpreter finalization may hold forever.
    me = _get_ident()
    if _OWNER[0] == me or _STATE[0]:
        return
    # A with-statement (not a non-blocking acquire whose result could be lost to an asynchronous
    # exception) so the lock is always released; sweeps are short, so waiting is cheap.
    try:
        with _SWEEP_LOCK:
            _OWNER[0] = me
            try:
                _sweep(budget, PENDING, LIVE, _RC_BASE, held)
            finally:
                _OWNER[0] = 0
    except BaseException:
        # The with statement's exit may not have run: calling the lock's __exit__ (a C method
        # taking its three arguments as a tuple) allocates that tuple, and a MemoryError there
        # left the lock held, so the next sweep of any other thread waited for ever. This
        # thread held no hold of it on entry (a nested sweep returns above, and the fork hook
        # marks its hold in _OWNER too), so owning it now means exactly that. Only on this
        # path: the normal one pays nothing.
        if _is_owned():
            _release()
        raise


# The C RLock's own ownership test (threading.Condition uses it); typeshed does not declare it.
_is_owned: Callable[[], bool] = cast(Any, _SWEEP_LOCK)._is_owned
_try_acquire = _SWEEP_LOCK.acquire
_release = _SWEEP_LOCK.release
_is_finalizing = sys.is_finalizing


def _try_sweep(budget: int) -> None:
    """Sweep ``budget`` entries if the sweep lock is free right now; never wait for it.

    For garbage-collection callbacks: a collection runs on whichever thread allocates, and at
    interpreter shutdown after the other threads were frozen, one of them possibly holding the
    lock; waiting there would hang the exit (or deadlock with a thread whose finaliser waits for
    a lock the collecting thread holds). A busy lock means a sweep is under way: the work is
    left to it, to the next export or collection, and to the exit flush.
    """
    if _STATE[0] or _is_finalizing() or _is_owned():
        return  # this thread is sweeping already (or is between acquiring and sweeping)
    me = _get_ident()
    try:
        if _try_acquire(False):
            _OWNER[0] = me
            _sweep(budget, PENDING, LIVE, _RC_BASE)
    finally:
        # The lock was not this thread's on entry, so owning it now means the acquire above
        # succeeded once, even if an asynchronous exception lost its result. release() checks
        # the owner and releases in one C call: no bytecode that could run a signal handler sits
        # between the check and the release (_release_save would release another thread's).
        if _OWNER[0] == me:
            _OWNER[0] = 0
        # Not contextlib.suppress: entering it is a Python call, where a signal handler can run.
        try:  # noqa: SIM105
            _release()
        except RuntimeError:  # not acquired here: the lock is another thread's, or nobody's
            pass


_GC_CREDIT: list[int] = [0]


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and DEAD and not _STATE[0]:
        release_dead()
    if phase == "stop" and PENDING:
        credit = _GC_CREDIT[0] + 1
        # A full collection costs far more than a few checks: it always sweeps a step.
        if credit >= GC_SWEEP_EVERY or info.get("generation") == 2:
            _GC_CREDIT[0] = 0
            _try_sweep(GC_SWEEP_STEP)
        else:
            _GC_CREDIT[0] = credit


def _at_exit() -> None:
    flush()
    _STATE[0] = True
    # From now on deleters leak: what they would drop stays referenced here.
    _KEPT.extend(LIVE.values())


def _before_fork() -> None:
    # A sweep in progress holds entries outside the queue; forking then would lose them in the
    # child. Sweeps are short and bounded, so waiting for one is cheap. Marked as this thread's
    # sweep: an export from another fork hook skips sweeping rather than nest in this hold.
    _SWEEP_LOCK.acquire()
    _OWNER[0] = _get_ident()


def _after_fork() -> None:
    # In the child the forking thread is the only thread, and it holds the lock: release it.
    _OWNER[0] = 0
    _SWEEP_LOCK.release()


gc.callbacks.append(_on_gc)
atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork
    )
