"""When a batch is finished: :class:`Reply` (one response, or the flags-only final one) and
:class:`Tracker` (Triton's rules for ending each request of a batch), shared by both engines
and the model that drives them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from pb_tensor import Tensor
from pb_tensor.runtime._errors import InferenceError, ResponseSenderDropped
from pb_tensor.runtime._seam import TritonError

__all__ = [
    "FINAL",
    "SENDER_DROPPED",
    "Cancellation",
    "Reply",
    "Tracker",
    "acting_as",
    "acting_for",
    "acts_for",
    "cancelled_error",
    "serving_bls",
    "sender_dropped_error",
    "serving_bls_here",
]

FINAL = 1
# With FINAL, in the flags of a reply without a response: the model let go of the request's
# sender without sending the final flag (the host's own flag: Triton's response flags use bit 0).
SENDER_DROPPED = 1 << 8


@dataclass(slots=True)
class Reply:
    """One response to request ``index`` of a batch (or the flags-only final one)."""

    index: int
    tensors: list[Tensor]
    error: InferenceError | None
    parameters: str
    flags: int
    has_response: bool
    # The model released the request with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: it ended
    # this execution without a final response (flags says FINAL for those who do not
    # reschedule; the sequence batcher of an iterative sequence runs it again).
    rescheduled: bool = False


class Tracker:
    """Finishes a batch as Triton does: each request ends with its final flag; requests of a
    failed ``execute`` end with its error; a non-decoupled request that got no response ends
    when ``execute`` returns."""

    __slots__ = ("decoupled", "instance_name", "pending", "returned")

    def __init__(self, size: int, decoupled: bool, instance_name: str) -> None:
        self.decoupled = decoupled
        self.instance_name = instance_name
        self.pending = set(range(size))
        self.returned = False

    @property
    def finished(self) -> bool:
        return self.returned and not self.pending

    def reply(self, r: Reply) -> list[Reply]:
        if r.index not in self.pending:
            return []  # after a batch error, or a second final: nobody is waiting for it
        if r.flags & FINAL:
            self.pending.discard(r.index)
        if r.flags & SENDER_DROPPED:
            return [Reply(r.index, [], sender_dropped_error(self.instance_name), "{}", FINAL,
                          False)]  # fmt: skip
        return [r] if (r.has_response or r.error is not None or r.flags & FINAL) else []

    def done(self, error: str | None, waiting: Collection[int] = (),
             rescheduled: Collection[int] = ()) -> list[Reply]:  # fmt: skip
        """``execute`` returned (``error``: its failure). ``waiting``: the requests of a
        non-decoupled model whose sender is still open; their response may come later, from
        another thread, as in Triton. ``rescheduled``: the requests the model released with
        the RESCHEDULE flag (they end here, without a response)."""
        self.returned = True
        if not self.pending:
            return []
        if error is not None:
            return self.fail(InferenceError(error, TritonError.INTERNAL))
        again = [Reply(i, [], None, "{}", FINAL, False, True)
                 for i in sorted(self.pending.intersection(rescheduled))]  # fmt: skip
        if again:
            self.pending.difference_update(rescheduled)
            if not self.pending:
                return again
            return again + self.done(None, waiting)
        if self.decoupled:
            return []
        # Triton would wait forever for a request whose sender the model never took: here
        # it fails at once.
        return self.fail(
            InferenceError(
                f"Failed to process the request(s) for model '{self.instance_name}', message: "
                "the model neither returned nor sent a response for the request",
                TritonError.INTERNAL,
            ),
            keep=waiting,
        )

    def fail(self, error: InferenceError, keep: Collection[int] = ()) -> list[Reply]:
        """End every pending request but those in ``keep`` with ``error``."""
        ended = sorted(self.pending.difference(keep))
        self.pending.intersection_update(keep)
        self.returned = True
        return [Reply(i, [], error, "{}", FINAL, False) for i in ended]


def sender_dropped_error(instance_name: str) -> ResponseSenderDropped:
    """What the caller of a request whose sender the model let go of gets."""
    return ResponseSenderDropped(
        f"Failed to process the request(s) for model '{instance_name}', message: the model "
        "dropped the request's response sender without sending the final flag (Triton's "
        "client gets no further response and no final flag)",
        TritonError.INTERNAL,
    )


def cancelled_error() -> InferenceError:
    """What a Triton client gets for a request it cancelled (tritonclient's text)."""
    return InferenceError("Locally cancelled by application!", TritonError.CANCELLED)


class Cancellation:
    """The caller's cancellation of a request, set once, from any thread. Whoever runs the
    request subscribes what cancelling must do (mark it for the model, tell the stub)."""

    __slots__ = ("_callbacks", "_lock", "cancelled")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.cancelled = False

    def cancel(self) -> bool:
        """Cancel; False when it already was. Subscribers run in this thread."""
        with self._lock:
            if self.cancelled:
                return False
            self.cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
        return True

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` on cancellation (now, if it already happened); returns what
        unsubscribes it."""
        with self._lock:
            if not self.cancelled:
                self._callbacks.append(callback)
                return lambda: self._unsubscribe(callback)
        callback()
        return _nothing

    def _unsubscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


def _nothing() -> None:
    return None


_acting = threading.local()


def acting_for() -> frozenset[int]:
    """The threads whose request the current thread works on (itself included): a thread
    the runtime starts to run a request (a decoupled model's ``execute``, a BLS request
    forwarded for a stub) acts for the thread that made it, so that a model waiting on
    itself is refused instead of deadlocking."""
    inherited: frozenset[int] = getattr(_acting, "threads", frozenset())
    return inherited | {threading.get_ident()}


def acts_for(thread: int) -> bool:
    """Whether the current thread is ``thread`` or works on its request."""
    return thread == threading.get_ident() or thread in getattr(_acting, "threads", ())


@contextlib.contextmanager
def acting_as(threads: frozenset[int]) -> Iterator[None]:
    """Within the block, the current thread acts for ``threads`` (see :func:`acting_for`)."""
    previous: frozenset[int] = getattr(_acting, "threads", frozenset())
    _acting.threads = previous | threads
    try:
        yield
    finally:
        _acting.threads = previous


@contextlib.contextmanager
def serving_bls() -> Iterator[None]:
    """Within the block, the current thread makes a stub's BLS request
    (:func:`serving_bls_here` is True)."""
    depth: int = getattr(_acting, "bls", 0)
    _acting.bls = depth + 1
    try:
        yield
    finally:
        _acting.bls = depth


def serving_bls_here() -> bool:
    """Whether the current thread makes a stub's BLS request: such a request takes its
    instance in this thread, which is how a model waiting on itself is found (see
    :func:`acting_for`)."""
    return bool(getattr(_acting, "bls", 0))
