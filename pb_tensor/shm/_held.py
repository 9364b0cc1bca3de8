"""The holder of a pool reference, and the retries that complete a step cut short (private).

:class:`Held` is the base of every view that holds a reference of a
:class:`pb_tensor.shm._pool.SharedMemoryPool`; :func:`persist` (around :func:`complete`) is how
the pool's operations (:mod:`pb_tensor.shm._locked`) finish a heap change or a give-back that an
asynchronous exception cut short.

The completion steps of an interrupted allocation, drop or give-back (idempotent, under the
lock) are retried until they have run to their end, so that a second asynchronous exception
inside the cleanup of the first cannot leave the heap change half done and unowned. CPython
runs signal handlers on entry to a Python function, at every backward jump and after calls into
C; a retry loop's jump lies outside its own try, so the retries nest (see :func:`persist`), and
:func:`complete` holds signal handlers off while it retries (it blocks signals in this thread
and, in the main thread, stands in for the Python handlers: see there).

Every retry loop is written ``while True: if done[0]: break`` and never ``while not
done[0]:``: on CPython 3.13 an exception that a signal handler raises at the backward jump of
a loop with a condition escapes every enclosing ``try`` of its frame (none of their ``except``
or ``finally`` clauses runs; CPython issue 130279) and, inside an ``except`` clause, keeps one
reference too many, so the frames on its traceback live for good
(``scripts/except_loop_leak.py``). A ``while True`` loop's jump is handled as designed there.
The loops test ``True in done`` (no call, as ``done[0]``): mypy would narrow ``done[0]`` from
one loop's test to the next and call the inner loops' exits unreachable.
"""

from __future__ import annotations

import importlib
import signal
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import numpy as np

from pb_tensor.errors import TritonModelException

if TYPE_CHECKING:
    from pb_tensor.shm._pool import SharedMemoryPool

__all__ = ["OWNED", "Held", "OwnedLock", "complete", "new_lock", "persist"]

# The claim of every holder whose reference is its own (not a message taken by a load): dying
# drops it. Shared and never set to False (a claim only ever sets True).
OWNED: Final = [True]
# Not signal.pthread_sigmask: that is a Python wrapper (frames where handlers run) that turns each
# signal of the returned mask into a Signals enum, about 30 us for a full mask, longer than a
# dense timer's interval, so that a signal always arrived before the mask took effect. The C
# function under it (CPython's _signal module, in every version) takes about 2 us. The same
# for signal.getsignal and signal.signal: the C functions, no frames, no enum conversions.
_c_signal: Final = importlib.import_module("_signal")
_sigmask: Final[Callable[[int, Iterable[int]], set[int]]] = _c_signal.pthread_sigmask
_getsignal: Final[Callable[[int], object]] = _c_signal.getsignal
_setsignal: Final[Callable[[int, object], object]] = _c_signal.signal
_SIG_BLOCK: Final = signal.SIG_BLOCK
_SIG_UNBLOCK: Final = signal.SIG_UNBLOCK
_ALL_SIGNALS: Final = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}


class OwnedLock(Protocol):
    """The part of ``threading.RLock`` (C ``_thread.RLock``) that the pool's locks use.

    ``_is_owned`` is the ownership test ``threading.Condition`` relies on, in every supported
    Python version. It makes good a ``with`` statement whose exit never ran: calling the lock's
    ``__exit__`` (a C method taking its three arguments as a tuple) allocates that tuple, and a
    ``MemoryError`` there leaves the lock held, which the next thread to want it waits for for
    ever. A ``with`` block that is not nested in another hold of the same lock checks, after
    the statement, that the lock is no longer its own, and releases it otherwise (these calls
    take no arguments and allocate nothing)::

        outer = not lock._is_owned()
        try:
            with lock:
                ...
        finally:
            if outer and lock._is_owned():
                lock.release()

    or, where the common path must pay nothing, the same test in an ``except`` clause that
    re-raises (an exit that fails raises too), as the pool's operations do.
    """

    def __enter__(self) -> bool: ...
    def __exit__(self, *exc: object) -> None: ...
    def release(self) -> None: ...
    def _is_owned(self) -> bool: ...


def new_lock() -> OwnedLock:
    """A new re-entrant lock, typed for its ownership test (see :class:`OwnedLock`)."""
    return cast("OwnedLock", threading.RLock())


def complete(done: list[bool], fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(*args)`` until it has run to its end, then set ``done[0]`` (module docstring).

    Signal handlers are held off meanwhile: a step that takes longer than a signal timer's
    interval (a heap repair walks every block) would otherwise be restarted for ever.

    - Signals are blocked in this thread (those that were not blocked already, given back on
      the way out): one that arrives in between waits in the kernel, and its handler runs
      once this returns.
    - That is not enough. The kernel gives a signal sent to the process to any thread that
      does not block it (numpy's BLAS threads, a server's workers), CPython's C handler there
      marks it, and the main thread runs the Python handler at its next check, inside the
      step. So in the main thread (the only one where Python handlers run) every Python
      handler is also replaced, for the step, by a recorder (a C method: it runs no frame and
      never raises); each signal it recorded has its handler run, once, with the frame it
      landed in, after the originals are back. What such a handler raises is dropped, as the
      caller's retry loop (:func:`persist`) drops what a kernel-held one raises on the way
      out: the caller re-raises the exception that started the clean-up.

    Raises:
        TritonModelException: what ``fn`` raised (a corrupted heap: retrying cannot help).
        BaseException: an asynchronous exception that landed on the loops' own jumps (rare;
            the caller's loop retries).
    """
    unblocked = _ALL_SIGNALS - _sigmask(_SIG_BLOCK, ())
    swapped: list[tuple[int, Callable[..., object]]] = []  # (signal, its own handler)
    deferred: dict[int, object] = {}  # signal -> the frame its handler would have run in
    try:
        _sigmask(_SIG_BLOCK, unblocked)
        if threading.get_ident() == threading.main_thread().ident:
            _defer_handlers(swapped, deferred.__setitem__)
        while True:
            if True in done:
                break
            try:
                while True:
                    if True in done:
                        break
                    try:
                        while True:
                            if True in done:
                                break
                            try:
                                fn(*args)
                                done[0] = True
                            except TritonModelException:
                                raise
                            except BaseException:  # retried
                                pass
                    except TritonModelException:
                        raise
                    except BaseException:  # retried
                        pass
            except TritonModelException:
                raise
            except BaseException:  # retried
                pass
    finally:
        # Handlers back and the recorded ones run before signals are unblocked: a held one
        # that the unblocking lets in raises there, which would skip anything after it.
        if swapped:
            _restore_handlers(swapped)
        if deferred:
            _replay(deferred)
        _sigmask(_SIG_UNBLOCK, unblocked)


def _defer_handlers(
    swapped: list[tuple[int, Callable[..., object]]], defer: Callable[..., None]
) -> None:
    """Replace every Python-level signal handler by ``defer``, recording each in ``swapped``
    before it is replaced (a handler that lands in between finds nothing half done)."""
    for sig in _ALL_SIGNALS:
        handler = _getsignal(sig)
        if callable(handler):
            swapped.append((sig, handler))
            try:
                _setsignal(sig, defer)
            except ValueError:  # not the main interpreter: its handlers never run
                swapped.pop()
                return


def _restore_handlers(swapped: list[tuple[int, Callable[..., object]]]) -> None:
    """Put back every handler :func:`_defer_handlers` replaced. Setting one twice is harmless,
    so a handler already back that raises on the way is retried past (nested retries, as in
    :func:`complete`; what it raised is dropped, see there)."""
    while True:
        if not swapped:
            break
        try:
            while True:
                if not swapped:
                    break
                try:
                    while True:
                        if not swapped:
                            break
                        sig, handler = swapped[-1]
                        _setsignal(sig, handler)
                        swapped.pop()
                except BaseException:  # retried
                    pass
        except BaseException:  # retried
            pass


def _replay(deferred: dict[int, object]) -> None:
    """Run the handler of each recorded signal, as CPython would have: once, with the signal
    and the frame it landed in. What a handler raises is dropped (see :func:`complete`)."""
    while True:
        if not deferred:
            break
        try:
            while True:
                if not deferred:
                    break
                try:
                    while True:
                        if not deferred:
                            break
                        sig = next(iter(deferred))
                        handler = _getsignal(sig)
                        frame = deferred[sig]
                        # No check for handlers between the removal and the call (neither
                        # is a call): the signal is handled at most once, as CPython does.
                        del deferred[sig]
                        if callable(handler):
                            handler(sig, frame)
                except BaseException:  # the handler's own exception, or another's
                    pass
        except BaseException:
            pass


def persist(done: list[bool], fn: Callable[..., None], *args: Any) -> None:
    """:func:`complete` retried at three nested levels; see the module docstring.

    Under a dense signal storm (a handler that raises and a timer interval not much longer
    than the handler's own run) a signal lands at nearly every point where CPython runs
    handlers: the entry of :func:`complete`, before it has blocked signals, and the backward
    jump of a retry loop, which lies outside that loop's ``try``. Each level's jump lies
    inside the next level's ``try``; the call site adds two more (its own loops, with this
    call's entry inside their ``try``). Leaving without the step done takes an exception at
    each of them in a row.

    Raises:
        TritonModelException: what ``fn`` raised.
        BaseException: asynchronous exceptions at every level in a row (see above).
    """
    while True:
        if True in done:
            break
        try:
            while True:
                if True in done:
                    break
                try:
                    while True:
                        if True in done:
                            break
                        try:
                            complete(done, fn, *args)
                        except TritonModelException:
                            raise
                        except BaseException:  # retried
                            pass
                except TritonModelException:
                    raise
                except BaseException:  # retried
                    pass
        except TritonModelException:
            raise
        except BaseException:  # retried
            pass


class Held(np.ndarray[Any, np.dtype[np.uint8]]):
    """The base of every view that holds a reference: dropping the last view drops the ref.

    An ndarray subclass built straight on the mapping's memoryview (0.4 us, against 2 us for
    an ``__array_interface__`` owner): numpy stops collapsing a view's base chain at an object
    of another type, so every array derived from the plain view returned to the caller keeps
    this one, and with it the reference, alive. ``_token`` is 0 until the reference is really
    taken: a holder dropped before that gives nothing back.
    """

    __slots__ = ("_claim", "_handle", "_message", "_pool", "_token")

    _pool: SharedMemoryPool
    _token: int
    _handle: int
    _message: bool  # the reference is a message taken over by a load ...
    # ... and ``_claim[0]`` once that load returned: dying gives the message back unless so.
    # A list shared with the pool's owner entry: a sweep that finds the holder dead (its
    # finaliser cut short) reads it there and gives the message back the same way.
    _claim: list[bool]

    def __del__(self) -> None:
        # Never raise an error from a finaliser (a corrupted header is reported by the next
        # explicit operation), and look up no module global: this may run during interpreter
        # shutdown. An asynchronous exception (a signal handler raising) can land anywhere in
        # here, even before the first line of _owner_died runs: the give-back is retried until
        # it has happened (it is exact under the lock), then the exception goes on (to the
        # unraisable hook). One that lands before the first line leaves the owner entry, whose
        # weak reference's callback queues it for the pool's next operation (_drain_dead).
        interrupted: BaseException | None = None
        while True:
            try:
                if self._token:
                    self._pool._owner_died(self._token, not self._claim[0])
                break
            except Exception:
                break
            except BaseException as exc:  # KeyboardInterrupt and friends: retry, then raise
                interrupted = exc
        if interrupted is not None:
            try:
                raise interrupted
            finally:
                # No cycle exception -> traceback -> this frame -> exception: it would keep
                # this holder and the frames of whatever exception it chains to (a load's,
                # and the holder that load took) alive until a collection.
                del interrupted

    def __repr__(self) -> str:
        try:
            return (
                f"<pb_tensor shared-memory allocation {self._handle} in pool {self._pool.name!r}>"
            )
        except AttributeError:  # not set up: the plain array repr
            return super().__repr__()
