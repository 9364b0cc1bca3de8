"""What :meth:`LoadedModel.infer_async` and :meth:`LoadedModel.stream` return: handles of a
request in flight that the caller can cancel from any thread, as a Triton client cancels
(``future.cancel()`` of ``async_infer``, ``stop_stream(cancel_requests=True)``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Generator, Iterator
from typing import TypeVar

from pb_tensor.runtime._tracker import FINAL, Cancellation, Reply, cancelled_error
from pb_tensor.runtime._values import Outputs, outputs_of

__all__ = ["BlsResponses", "InferFuture", "ResponseStream", "start", "stream_outputs"]


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


def start(future: InferFuture, call: Callable[[], Outputs], name: str) -> None:
    """Run ``call`` in a daemon thread named ``name``; its outcome completes ``future``
    (unless :meth:`InferFuture.cancel` completed it first)."""

    def work() -> None:
        try:
            outputs = call()
        except BaseException as exc:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(exc)
        else:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_result(outputs)

    threading.Thread(target=work, name=name, daemon=True).start()


def stream_outputs(replies: Iterator[Reply], decoupled: bool) -> Generator[Outputs, None, None]:
    """The outputs of each response among ``replies`` (one request's); an error reply
    raises. A non-decoupled request has one response: what follows it (an error of a second
    send) is dropped, as Triton's front ends drop it. Each response's ``final`` says whether
    it carried the final flag."""
    __tracebackhide__ = True
    try:
        for reply in replies:
            if reply.error is not None:
                raise reply.error
            if reply.has_response:
                outputs = outputs_of(reply)
                outputs.final = not decoupled or bool(reply.flags & FINAL)
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

    def __init__(self, replies: Iterator[Outputs], cancellation: Cancellation) -> None:
        self._replies = replies
        self._cancellation = cancellation
        self._done = False

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> Outputs:
        """The next response's outputs.

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
                return out
        self._done = True
        self.close()  # the engine waits (bounded) for the model to finish the request
        raise cancelled_error()

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
