"""Export blocks, the live registry, the deleter and the pending-capsule sweep (shared privately).

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
by :mod:`dlpack_ctypes.producer`.
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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

if TYPE_CHECKING:
    # typing_extensions is not a runtime dependency: only annotations and string casts use it.
    from typing_extensions import CapsuleType

from dlpack_ctypes import _capi
from dlpack_ctypes._owned import DEAD, release_dead
from dlpack_ctypes.abi import DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION, DLDeviceType

__all__ = [
    "DELETER_ADDRESS",
    "DELETER_TARGET",
    "DEVICE_TYPES",
    "EXPORT_SWEEP_STEP",
    "GC_SWEEP_EVERY",
    "GC_SWEEP_STEP",
    "LIVE",
    "MAX_NDIM",
    "PENDING",
    "SWEEP_LIMIT",
    "c_strides",
    "check_shape",
    "contiguous_strides",
    "deleter_impl",
    "export",
    "export_prepared",
    "flush",
    "live_exports",
    "pending_count",
    "prepare",
]

MAX_NDIM: Final = 64
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


_step = _locked_sweep
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

# --------------------------------------------------------------------------------------------
# Shapes

_C_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def check_shape(shape: Sequence[int], strides: Sequence[int] | None) -> None:
    """Reject more than :data:`MAX_NDIM` dimensions, mismatched strides, negative sizes.

    Raises:
        BufferError: too many dimensions.
        ValueError: strides of another length, or a negative dimension.
    """
    ndim = len(shape)
    if ndim > MAX_NDIM:
        raise BufferError(f"cannot export {ndim=}: at most {MAX_NDIM} dimensions are supported")
    if strides is not None and len(strides) != ndim:
        raise ValueError(f"strides must have one entry per dimension: {shape=} {strides=}")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape entries must be >= 0: {shape=}")


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """C-order strides of ``shape`` in elements (size-0 dimensions count as 1)."""
    strides = [1] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = acc
        acc *= max(shape[i], 1)
    return strides


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The C-order strides of ``shape``, in elements (memoised: shapes repeat)."""
    found = _C_STRIDES.get(shape)
    if found is None:
        if len(_C_STRIDES) > 4096:
            _C_STRIDES.clear()
        found = _C_STRIDES[shape] = tuple(contiguous_strides(shape))
    return found


#: The memo behind :func:`c_strides`, for callers that look up before calling.
C_STRIDES: Final = _C_STRIDES

# --------------------------------------------------------------------------------------------
# Struct packing and the raw export

# Native alignment ("@") reproduces the C layout; abi.py checks the same offsets at import.
_LEGACY_HEAD = "@PiiiBBHPPQPP"  # DLManagedTensor, 64 bytes
_VERSIONED_HEAD = "@IIPPQPiiiBBHPPQ"  # DLManagedTensorVersioned, 80 bytes
_PACKERS: dict[tuple[bool, int], tuple[Any, Any, int]] = {}


def _packer(versioned: bool, ndim: int) -> tuple[Any, Any, int]:
    key = (versioned, ndim)
    found = _PACKERS.get(key)
    if found is None:
        head = _VERSIONED_HEAD if versioned else _LEGACY_HEAD
        fmt = struct.Struct(head + "q" * (2 * ndim))
        block_type = ctypes.c_int64 * (fmt.size // 8)
        head_size = struct.calcsize(head)
        found = _PACKERS[key] = (fmt.pack_into, block_type, head_size)
    return found


def export(
    owner: object,
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: tuple[int, int, int],
    device: tuple[int, int],
    versioned: bool,
    flags: int,
    _live: Any = LIVE,
    _pending: Any = PENDING,
    _new: Any = _capi.PyCapsule_New,
    _addressof: Any = ctypes.addressof,
) -> CapsuleType:
    """Pack one export block and wrap it in a fresh capsule (no validation: callers check).

    Exception-safe at every step: until the capsule is returned, any exception (including an
    asynchronous one such as ``KeyboardInterrupt``, or ``MemoryError``) releases the export; a
    capsule that already reached the pending queue is then skipped by the sweep, because the
    registry no longer holds its block.
    """
    ndim = len(shape)
    found = _PACKERS.get((versioned, ndim))
    pack, block_type, head = found if found is not None else _packer(versioned, ndim)
    block = block_type()
    addr = _addressof(block)
    dims = addr + head if ndim else 0
    strd = dims + 8 * ndim if ndim else 0
    if versioned:
        pack(block, 0, DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION, 0, DELETER_ADDRESS, flags,
             data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2], dims, strd, 0,
             *shape, *strides)
        name = _capi.ADDR_DLTENSOR_VERSIONED
    else:
        pack(block, 0, data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2],
             dims, strd, 0, 0, DELETER_ADDRESS, *shape, *strides)
        name = _capi.ADDR_DLTENSOR
    # The registry entry is undone unless the capsule reached the pending queue (the sweep
    # then releases it when the caller never got it). A finally clause, not an except one:
    # CPython 3.10 runs a signal handler on entry to an except clause, so a second
    # asynchronous exception there skipped the undo and left the entry for ever; a clause
    # whose first instruction starts a try block is entered without one.
    queued = False
    try:
        _live[addr] = (block, owner)
        capsule: CapsuleType = _new(addr, name, None)
        _pending.append((capsule, block, addr, name))
        queued = True  # no handler point since the append returned
        if len(_pending) > SWEEP_LIMIT:
            # Up to SWEEP_LIMIT entries at once when they are released (the usual case: the
            # consumer let go), so the lock and call overhead is paid once per ~64 exports,
            # not once per 4; still at most EXPORT_SWEEP_STEP held capsules examined.
            _step(SWEEP_LIMIT, EXPORT_SWEEP_STEP)
    finally:
        try:
            if not queued:
                # The capsule never reached the caller, so nobody can have consumed it.
                _live.pop(addr, None)
        finally:
            pass
    return capsule


# Offset of DLTensor.shape in the managed struct (strides follow): the only fields a prepared
# block still needs per export, because they point into the block itself.
_SHAPE_FIELD: Final = {True: 32 + 24, False: 24}
_pack_pointers = struct.Struct("@PP").pack_into


def prepare(
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: tuple[int, int, int],
    device: tuple[int, int],
    versioned: bool,
    flags: int,
) -> tuple[Any, bytes, int, int, int]:
    """Pack an export block once for repeated :func:`export_prepared` calls of the same tensor.

    Returns ``(block type, the packed bytes with NULL shape/strides pointers, offset of the shape
    pointer, offset of the shape array, ndim)``; no validation (callers check, as for
    :func:`export`).
    """
    ndim = len(shape)
    found = _PACKERS.get((versioned, ndim))
    pack, block_type, head = found if found is not None else _packer(versioned, ndim)
    block = block_type()
    if versioned:
        pack(block, 0, DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION, 0, DELETER_ADDRESS, flags,
             data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2], 0, 0, 0,
             *shape, *strides)
    else:
        pack(block, 0, data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2],
             0, 0, 0, 0, DELETER_ADDRESS, *shape, *strides)
    return block_type, bytes(block), _SHAPE_FIELD[versioned], head, ndim


def export_prepared(
    owner: object,
    prepared: tuple[Any, bytes, int, int, int],
    name: int,
    _live: Any = LIVE,
    _pending: Any = PENDING,
    _new: Any = _capi.PyCapsule_New,
    _addressof: Any = ctypes.addressof,
) -> CapsuleType:
    """:func:`export` of a block made by :func:`prepare`: one copy of the packed bytes and the
    two pointers into the block, instead of packing every field (``name``: the capsule name's
    address, :data:`~dlpack_ctypes._capi.ADDR_DLTENSOR_VERSIONED` for a versioned block).

    Exception-safe at every step, exactly as :func:`export` (the steps after the packing are
    the same).
    """
    block_type, packed, field, head, ndim = prepared
    block = block_type.from_buffer_copy(packed)
    addr = _addressof(block)
    if ndim:
        _pack_pointers(block, field, addr + head, addr + head + 8 * ndim)
    queued = False  # the undo of export(), for the same reasons
    try:
        _live[addr] = (block, owner)
        capsule: CapsuleType = _new(addr, name, None)
        _pending.append((capsule, block, addr, name))
        queued = True
        if len(_pending) > SWEEP_LIMIT:
            _step(SWEEP_LIMIT, EXPORT_SWEEP_STEP)
    finally:
        try:
            if not queued:
                _live.pop(addr, None)
        finally:
            pass
    return capsule
