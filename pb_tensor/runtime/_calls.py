"""What :meth:`LoadedModel.infer_async` and :meth:`LoadedModel.stream` return: handles of a
request in flight that the caller can cancel from any thread, as a Triton client cancels
(``future.cancel()`` of ``async_infer``, ``stop_stream(cancel_requests=True)``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import TypeVar

from pb_tensor.runtime._errors import InferenceError
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._tracker import FINAL, Cancellation, Reply, cancelled_error
from pb_tensor.runtime._values import Outputs, outputs_of

__all__ = [
    "BlsResponses",
    "FutureSink",
    "InferFuture",
    "ResponseStream",
    "StreamError",
    "first_outputs",
    "start",
    "stream_outputs",
]


T = TypeVar("T")


class BlsResponses(Iterator[T]):
    """The responses of a decoupled BLS request, with the ``cancel()`` that
    ``pb_utils.ResponseIterator.cancel()`` calls: the called model sees
    ``request.is_cancelled()`` turn True; its responses keep coming until its final flag
    (a model that ignores the cancellation sends them all), as in Triton."""

    __slots__ = ("_cancellation", "_responses")

    def __init__(self, responses: Iterator[T], cancellation: Cancellation) -> None:
        self._responses = responses
        self._cancellation = cancellation

    def __iter__(self) -> BlsResponses[T]:
        return self

    def __next__(self) -> T:
        return next(self._responses)

    def cancel(self) -> None:
        """Cancel the BLS request (thread-safe; nothing once it ended)."""
        self._cancellation.cancel()


class InferFuture(concurrent.futures.Future[Outputs]):
    """The outputs of a request running in the background (:meth:`LoadedModel.infer_async`).

    A ``concurrent.futures.Future``: ``result()`` gives the outputs or raises the request's
    ``InferenceError``; ``asyncio.wrap_future`` awaits it, and cancelling the awaiting task
    cancels the request. :meth:`cancel` works while the request is queued or running.
    """

    def __init__(self, cancellation: Cancellation) -> None:
        super().__init__()
        self._cancellation = cancellation

    def add_done_callback(
        self, fn: Callable[[concurrent.futures.Future[Outputs]], object], *,
        quick: bool = False,
    ) -> None:
        """Call ``fn(future)`` once the future is done (now, in this thread, if it is).

        A request that waited in a queue is completed by the thread of the instance that
        ran it; ``fn`` then runs in a worker thread of its own, so that it may block or
        make requests (of this model too) without holding the instance up. ``quick=True``
        runs it in the completing thread instead, as ``concurrent.futures`` does: for a
        callback that only hands the outcome on (``loop.call_soon_threadsafe``), never
        blocks and makes no request (the batcher may hold its queue's lock then)."""
        super().add_done_callback(fn if quick else functools.partial(_callback, fn))

    def cancel(self) -> bool:
        """Cancel the request, queued or running: the model sees ``request.is_cancelled()``
        turn True and the future fails at once with Triton's CANCELLED error
        (``InferenceError``, code ``TritonError.CANCELLED``); what the model still answers
        is dropped. ``cancelled()`` stays False: the outcome is that error. False once the
        future is done.
        """
        if self.done() or not self._cancellation.cancel():
            return False
        try:
            self.set_exception(cancelled_error())
        except concurrent.futures.InvalidStateError:  # the request finished meanwhile
            return False
        return True


_Call = Callable[[], Callable[[], None]]
"""A worker's call: it does the work and returns what gives the outcome away."""


class _Workers:
    """Long-lived daemon threads that run :func:`start`'s calls, one call per thread at a
    time, as many threads as calls in flight (a call waiting for an idle instance or for
    another call's outcome never waits for a free thread: no deadlock a thread per call
    would not have). A call takes an idle thread if there is one, else starts one; a thread
    idle for ``idle_s`` seconds ends. (Measured on add_sub in a stub process: a thread
    started per call cost 650-785 us of host CPU per request against 350 for ``infer``;
    handing the call to an idle worker, 260-460 against 210-350.)"""

    def __init__(self, idle_s: float) -> None:
        self._idle_s = idle_s
        self._reset()
        # A forked child has none of the parent's threads: it starts with no idle ones. (A
        # weak reference: the registration lasts for the process, a pool need not.)
        os.register_at_fork(after_in_child=functools.partial(_reset_in_child,
                                                             weakref.ref(self)))

    def _reset(self) -> None:
        self._lock = threading.Lock()
        # Each idle thread's hand-over queue; the last one to become idle is taken first
        # (its stack is warm, and the others expire when load drops).
        self._idle: list[queue.SimpleQueue[_Call]] = []

    def submit(self, call: _Call, name: str) -> None:
        """Run ``call`` in an idle worker thread (named ``name`` while it runs), or a new
        one; then the function ``call`` returned, which gives the outcome to whoever waits
        for it. ``call`` must not raise (its outcome goes to a future)."""
        with self._lock:
            handover = self._idle.pop() if self._idle else None
        if handover is not None:
            handover.put(functools.partial(_named, name, call))
            return
        handover = queue.SimpleQueue()
        # Through the queue, not the thread's arguments, which the thread keeps until it ends.
        handover.put(call)
        threading.Thread(target=self._work, args=(handover,), name=name, daemon=True).start()

    def _work(self, handover: queue.SimpleQueue[_Call]) -> None:
        call = handover.get()
        while True:
            finish = call()
            # Dropped now, not at the next call: the call holds the request's tensors (and
            # pool allocations).
            del call
            # Idle before the outcome is out: a caller that makes its next request as soon
            # as it has this one's finds this thread instead of starting another.
            with self._lock:
                self._idle.append(handover)
            finish()
            del finish
            try:
                call = handover.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if handover in self._idle:
                        self._idle.remove(handover)
                        return
                # submit() took this thread as the wait ended: its call is on the way.
                call = handover.get()


def _reset_in_child(workers: weakref.ref[_Workers]) -> None:
    pool = workers()
    if pool is not None:
        pool._reset()


def _named(name: str, call: _Call) -> Callable[[], None]:
    threading.current_thread().name = name
    return call()


_WORKERS = _Workers(idle_s=30.0)


def _succeed(future: InferFuture, outputs: Outputs) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
        future.set_result(outputs)


def _fail(future: InferFuture, error: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
        future.set_exception(error)


# Set while a FutureSink completes its future (in an instance's thread).
_completing = threading.local()


def _callback(fn: Callable[[concurrent.futures.Future[Outputs]], object],
              future: concurrent.futures.Future[Outputs]) -> None:  # fmt: skip
    if not getattr(_completing, "active", False):
        fn(future)
        return

    def work() -> Callable[[], None]:
        try:
            fn(future)
        except Exception:  # as concurrent.futures reports a callback's exception
            logging.getLogger("concurrent.futures").exception(
                "exception calling callback for %r", future)
        return _nothing

    _WORKERS.submit(work, "pb-tensor-callback")


def _nothing() -> None:
    return None


def first_outputs(first: Reply | None, model: str) -> Outputs:
    """The outputs of a request whose first response (or error) is ``first``, as
    :meth:`LoadedModel.infer` gives them.

    Raises:
        InferenceError: the request's error, or it got no response at all.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this frame
    if first is None:
        raise InferenceError(
            f"model '{model}' sent no response for the request (a decoupled model answers "
            "through stream())",
            TritonError.INTERNAL,
        )
    if first.error is not None:
        raise first.error
    return outputs_of(first)


class FutureSink:
    """Completes ``future`` with one request's outcome from the replies a batcher puts
    here (its ``Sink``), in the thread that ended the batch: a request queued this way
    needs no thread of its own waiting for it."""

    __slots__ = ("_first", "_future", "_model")

    def __init__(self, future: InferFuture, model: str) -> None:
        self._future = future
        self._model = model
        self._first: Reply | None = None

    def put(self, item: Reply | list[Reply | None] | None, /) -> None:
        """Take a reply, the request's end (None), or both together (a list)."""
        replies: list[Reply | None] = item if isinstance(item, list) else [item]
        for reply in replies:
            if reply is None:
                self._end()
            elif self._first is None and (reply.has_response or reply.error is not None):
                self._first = reply

    def _end(self) -> None:
        _completing.active = True
        try:
            try:
                outputs = first_outputs(self._first, self._model)
            except InferenceError as exc:
                _fail(self._future, exc)
            else:
                _succeed(self._future, outputs)
        finally:
            _completing.active = False
        self._first = None  # its tensors are the future's now (or dropped)


def start(future: InferFuture, call: Callable[[], Outputs], name: str) -> None:
    """Run ``call`` in a worker thread (a daemon thread named ``name`` while it runs, taken
    from idle ones or started); its outcome completes ``future`` (unless
    :meth:`InferFuture.cancel` completed it first)."""

    def work() -> Callable[[], None]:
        try:
            outputs = call()
        except BaseException as exc:
            return functools.partial(_fail, future, exc)
        return functools.partial(_succeed, future, outputs)

    _WORKERS.submit(work, name)


class StreamError:
    """An error response among a stream's responses, and whether it carried the final flag
    (a decoupled model may go on sending after an error response, as Triton delivers)."""

    __slots__ = ("error", "final")

    def __init__(self, error: InferenceError, final: bool) -> None:
        self.error, self.final = error, final


def stream_outputs(
    replies: Iterator[Reply], decoupled: bool
) -> Generator[Outputs | StreamError, None, None]:
    """The outputs of each response among ``replies`` (one request's), an error response as a
    :class:`StreamError`. A non-decoupled request has one response: what follows it (an
    error of a second send) is dropped, as Triton's front ends drop it. Each response's
    ``final`` says whether it carried the final flag."""
    __tracebackhide__ = True
    try:
        for reply in replies:
            if reply.error is None and not reply.has_response:
                continue
            final = not decoupled or bool(reply.flags & FINAL)
            if reply.error is not None:
                yield StreamError(reply.error, final)
            else:
                outputs = outputs_of(reply)
                outputs.final = final
                yield outputs
            if not decoupled:
                for _ in replies:
                    pass
                return
    finally:
        # Now, not when a traceback holding this frame goes: the run holds the model.
        close = getattr(replies, "close", None)
        if close is not None:
            close()


class ResponseStream(Iterator[Outputs]):
    """The responses of one request as they arrive (:meth:`LoadedModel.stream`): an
    iterator of :class:`Outputs` that ends at the final flag.

    :meth:`cancel` may be called from any thread; :meth:`close` (or leaving a ``for`` loop
    early) stops reading, which cancels the request too.
    """

    __slots__ = ("_cancellation", "_done", "_replies")

    def __init__(
        self, replies: Iterator[Outputs | StreamError], cancellation: Cancellation
    ) -> None:
        self._replies = replies
        self._cancellation = cancellation
        self._done = False

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> Outputs:
        """The next response's outputs.

        An error response raises; when it did not carry the final flag, the request goes on
        and the next call gives the responses the model sends after it (Triton delivers
        them). Leaving a ``for`` loop on the error drops the iterator, which closes it.

        Raises:
            StopIteration: the model sent its final flag.
            InferenceError: the model sent an error response, raised, crashed or timed out;
                or, once, Triton's CANCELLED error after :meth:`cancel`.
        """
        if self._done:
            raise StopIteration
        if not self._cancellation.cancelled:
            try:
                out = next(self._replies)
            except BaseException:
                self._done = True
                raise
            if not self._cancellation.cancelled:
                if isinstance(out, StreamError):
                    if out.final:
                        self.close()
                    error = out.error
                    # The error's traceback keeps this frame: without the stream in it, a
                    # caller that stops at the error (a for loop) lets the stream go, which
                    # ends the request then, not when the error itself goes.
                    del self, out
                    raise error
                return out
        self._done = True
        self.close()  # the engine waits (bounded) for the model to finish the request
        raise cancelled_error()

    @property
    def finished(self) -> bool:
        """Whether the stream ended: the final flag (or an error response carrying it),
        a failure, a cancellation, or :meth:`close`; ``next`` raises ``StopIteration`` then."""
        return self._done

    def cancel(self) -> None:
        """Cancel the request (thread-safe): the model sees ``request.is_cancelled()`` and
        ``response_sender.is_cancelled()`` turn True, and the iterator raises Triton's
        CANCELLED error (``InferenceError``, code ``TritonError.CANCELLED``) at its next
        step instead of giving further responses. Nothing once it ended."""
        self._cancellation.cancel()

    def close(self) -> None:
        """Stop reading: a request still running is cancelled, and its remaining responses
        are dropped (from the thread that iterates, not while another thread is in
        ``next``)."""
        self._done = True
        closer = getattr(self._replies, "close", None)
        if closer is not None:
            closer()
