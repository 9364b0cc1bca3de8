"""The in-process engine (``isolated=False``): the model runs in this process, a
non-decoupled ``execute`` in the calling thread, a decoupled one in a thread of its own while
the caller reads its responses."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pb_tensor import TritonDtype
from pb_tensor.runtime._engines import Cancels
from pb_tensor.runtime._errors import InferenceError
from pb_tensor.runtime._host import HostInfo, ModelHost, RequestData
from pb_tensor.runtime._readiness import ReadyState
from pb_tensor.runtime._seam import InferenceResponse, ModelBackend, TritonError
from pb_tensor.runtime._tracker import (
    FINAL,
    Cancellation,
    Reply,
    Tracker,
    acting_as,
    acting_for,
)
from pb_tensor.runtime._values import as_delivered

__all__ = ["InProcessEngine"]

_BYTES = TritonDtype.TYPE_BYTES


def _reply_from(index: int, response: InferenceResponse | None, flags: int) -> Reply:
    if response is None:
        return Reply(index, [], None, "{}", flags, False)
    err = response.error()
    error = None if err is None else InferenceError(err.message(), int(err.code()))
    tensors = response.output_tensors()
    for tensor in tensors:
        if tensor.dtype is _BYTES:
            # BYTES as bytes, as a stub's responses arrive (a model may have built them
            # from str).
            tensors = as_delivered(tensors)
            break
    return Reply(index, tensors, error, response.parameters(), flags, True)


Event = tuple[int, InferenceResponse | None, int]


def _checker(cancel: Cancels, cancelled: set[int]) -> Callable[[int], bool]:
    """``is_cancelled(index)`` of a run: the caller cancelled, or the runtime gave up on
    the request (timeout, early stop)."""
    if cancel is None:
        return cancelled.__contains__
    if isinstance(cancel, Cancellation):
        whole = cancel
        return lambda index: whole.cancelled or index in cancelled
    each = list(cancel)

    def check(index: int) -> bool:
        c = each[index]
        return index in cancelled or (c is not None and c.cancelled)

    return check


def _timed_out(instance_name: str, timeout: float | None) -> InferenceError:
    return InferenceError(
        f"Failed to process the request(s) for model instance '{instance_name}', message: "
        f"no final response within the timeout of {timeout} s",
        TritonError.UNAVAILABLE,
    )


class _Returned:
    """``execute`` returned (``error``: its failure), queued after the responses it sent."""

    __slots__ = ("error", "rescheduled")

    def __init__(self, error: str | None, rescheduled: list[int]) -> None:
        self.error = error
        self.rescheduled = rescheduled


class InProcessEngine:
    """The model runs in this process (``isolated=False``): a non-decoupled model in the
    calling thread, a decoupled model's ``execute`` in a thread of its own.

    A ``timeout`` limits the wait for a decoupled model's responses and for responses sent
    after ``execute`` returned; a non-decoupled ``execute`` running in the calling thread
    cannot be stopped.
    """

    def __init__(self, info: HostInfo, cls: type, backend: ModelBackend) -> None:
        self.host = ModelHost(info, cls, backend)
        self.host.initialize()
        # Read by every run: the host's info does not change.
        self._copy = not info.share_inputs
        self._decoupled = info.decoupled

    @property
    def pid(self) -> int | None:
        return None

    def run(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancels = None,
        returned: Callable[[], None] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> Iterable[Reply]:
        """The replies of ``batch`` (``on_sent`` is called before it runs)."""
        if on_sent is not None:
            on_sent()
        copy = self._copy
        for data in batch:
            if not data.delivered:
                data.inputs = as_delivered(data.inputs, copy=copy)
        if self._decoupled:
            return self._run_decoupled(batch, timeout, cancel, returned)
        # Every response but those sent after execute returned arrives before it returns:
        # the replies are a list.
        events: queue.SimpleQueue[Event | _Returned] = queue.SimpleQueue()
        cancelled: set[int] = set()
        host = self.host
        built = host.build_requests(
            batch, lambda i, r, f: events.put((i, r, f)), _checker(cancel, cancelled)
        )
        error = host.execute(built)
        sent = _queued(events)
        replies: list[Reply]
        if error is None and len(sent) == len(batch):
            # Each request got one final response, in order: the tracker would pass them all.
            replies = []
            for i, (index, response, flags) in enumerate(sent):
                if index != i or flags != FINAL:
                    break
                replies.append(_reply_from(index, response, flags))
            else:
                return replies
        tracker = Tracker(len(batch), False, self.host.info.instance_name)
        replies = []
        for item in sent:
            replies.extend(tracker.reply(_reply_from(*item)))
        waiting = built.waiting() if error is None and tracker.pending else ()
        replies.extend(tracker.done(error, waiting, built.rescheduled))
        del built  # its senders are the model's now: one it lets go of ends its request
        if not tracker.finished:
            deadline = None if timeout is None else time.monotonic() + timeout
            replies.extend(self._wait(tracker, events, deadline, timeout, cancelled))
        return replies

    def _wait(
        self,
        tracker: Tracker,
        events: queue.SimpleQueue[Event | _Returned],
        deadline: float | None,
        timeout: float | None,
        cancelled: set[int],
        returned: Callable[[], None] | None = None,
    ) -> Iterator[Reply]:
        """The replies as ``events`` brings them, until every request's final flag (or the
        deadline: the rest are cancelled and fail)."""
        while not tracker.finished:
            remaining = None if deadline is None else deadline - time.monotonic()
            try:
                if remaining is not None and remaining <= 0:
                    raise queue.Empty
                item = events.get(timeout=remaining)
            except queue.Empty:
                cancelled.update(tracker.pending)
                yield from tracker.fail(_timed_out(self.host.info.instance_name, timeout))
                return
            if isinstance(item, _Returned):
                ended = tracker.done(item.error, (), item.rescheduled)
                if returned is not None and not tracker.finished:
                    returned()  # before the caller sees a reply: the instance is free
                yield from ended
            else:
                yield from tracker.reply(_reply_from(*item))

    def _run_decoupled(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancels,
        returned: Callable[[], None] | None,
    ) -> Iterator[Reply]:
        """``execute`` runs in a thread of its own while this one reads the responses as
        they come, as a Triton client reads a stub's: a cancellation or a BLS caller's
        ``cancel()`` reaches a model still in ``execute``, and this wait stays
        interruptible (signals reach the caller) and bounded by ``timeout``."""
        info = self.host.info
        tracker = Tracker(len(batch), True, info.instance_name)
        deadline = None if timeout is None else time.monotonic() + timeout
        events: queue.SimpleQueue[Event | _Returned] = queue.SimpleQueue()
        cancelled: set[int] = set()
        # Handed to the thread that runs it, not kept here: once execute returned, the
        # senders are the model's, and one it lets go of ends its request (_dropped).
        built = [self.host.build_requests(
            batch, lambda i, r, f: events.put((i, r, f)), _checker(cancel, cancelled)
        )]  # fmt: skip
        caller = acting_for()

        def work() -> None:
            requests = built.pop()
            with acting_as(caller):
                error = self.host.execute(requests)
                if returned is not None:
                    # The instance is free once execute returned, whether or not the caller
                    # reads on (it may wait for another request first, as a coroutine
                    # gathering several BLS streams does).
                    returned()
                events.put(_Returned(error, requests.rescheduled))
                # A decoupled coroutine starts once its instance is free: a caller reading
                # its first response finds the instance released.
                self.host.start_background(requests)

        threading.Thread(target=work, name=f"pb-tensor-execute-{info.name}", daemon=True).start()
        try:
            yield from self._wait(tracker, events, deadline, timeout, cancelled, returned)
        finally:
            if not tracker.finished:
                # The caller stopped reading early: cancel, and give the model a moment to
                # send its final flags (their responses are dropped).
                cancelled.update(tracker.pending)
                end = time.monotonic() + 10.0
                while not tracker.finished and time.monotonic() < end:
                    try:
                        item = events.get(timeout=max(0.0, end - time.monotonic()))
                    except queue.Empty:
                        break
                    if isinstance(item, _Returned):
                        tracker.done(item.error, (), item.rescheduled)
                    else:
                        tracker.reply(_reply_from(*item))

    def metrics(self) -> dict[str, Any]:
        from pb_tensor.runtime._seam import metric_snapshot

        return metric_snapshot()

    # -- readiness (ReadinessCheck's probe) ----------------------------------------------------
    def health(self) -> str | None:
        return None  # no process of its own to lose

    @property
    def user_readiness(self) -> bool:
        return self.host.defines_is_ready

    def ask_ready(
        self, timeout: float, later: Callable[[ReadyState], None]
    ) -> ReadyState | None:
        """The model's ``is_ready()``, on a thread of its own as the stub runs it (beside
        ``execute``, which may be the one asking: ``pb_utils.is_model_ready``)."""
        answer: concurrent.futures.Future[ReadyState] = concurrent.futures.Future()
        threading.Thread(target=lambda: answer.set_result(self.host.is_ready()),
                         name=f"pb-tensor-readiness-{self.host.info.name}",
                         daemon=True).start()  # fmt: skip
        try:
            return answer.result(timeout)
        except concurrent.futures.TimeoutError:
            # (called at once when the answer came meanwhile)
            answer.add_done_callback(lambda done: later(done.result()))
            return None

    def stop(self) -> str | None:
        return self.host.finalize()


def _queued(events: queue.SimpleQueue[Event | _Returned]) -> list[Event]:
    """The responses in ``events`` now (a non-decoupled run's queue holds nothing else)."""
    out: list[Event] = []
    # Only this thread takes from the queue: an item seen by empty() is there for
    # get_nowait() (which would raise Empty, at a cost, once it is drained).
    while not events.empty():
        item = events.get_nowait()
        if not isinstance(item, _Returned):
            out.append(item)
    return out
