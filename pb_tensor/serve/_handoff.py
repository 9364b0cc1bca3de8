"""Handing a request's blocking part from an event loop to a worker thread and its outcome
back, with less on the way than ``loop.run_in_executor`` and ``asyncio.wrap_future``.

``run_in_executor`` builds a ``concurrent.futures.Future`` (with its condition variable), a
work item, an asyncio future chained to it both ways, and checks for threads to start on
every call; the outcome travels future -> callback -> ``call_soon_threadsafe`` -> future.
Here a call is one tuple on a queue, and the worker sets the awaiting asyncio future through
one ``call_soon_threadsafe``. Measured on this project's 2-core machine (an empty function,
uvloop, 5,000 calls): 13-24 us of CPU per call at one caller against 29-40 us, and 2-3 us
against 17-21 us with 16 callers (busy workers take the next call without sleeping).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pb_tensor.runtime import InferFuture

__all__ = ["Handoff", "await_future"]

T = TypeVar("T")

_Call = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    # On the loop's thread. A task cancelled meanwhile (a client that went away) cancelled
    # its future: the outcome is dropped (the caller cancelled the request itself).
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _send(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any,
          error: BaseException | None) -> None:  # fmt: skip
    # A loop closed meanwhile (the server stopping) has no one left to tell.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_settle, future, result, error)


class Handoff:
    """Up to ``max_workers`` daemon threads that run calls for event loops: ``await
    handoff.run(fn)`` runs ``fn()`` in one of them and gives its result (or raises its
    exception) on the awaiting loop. A thread is started when a call finds none idle (up to
    the limit; further calls wait in the queue, as with ``ThreadPoolExecutor``)."""

    def __init__(self, max_workers: int, name: str) -> None:
        if max_workers < 1:
            raise ValueError(f"Handoff needs max_workers >= 1, not {max_workers}")
        self._max = max_workers
        self._name = name
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread; its result.

        Raises:
            RuntimeError: the hand-off was closed.
            BaseException: what ``fn`` raised.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submit((loop, future, fn))
        return await future

    def _submit(self, call: _Call) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: closed, no new calls")
            start = self._idle == 0 and self._threads < self._max
            if start:
                self._threads += 1
            elif self._idle:
                self._idle -= 1  # taken now, so that the next call counts right
        self._queue.put(call)
        if start:
            threading.Thread(target=self._work, name=f"{self._name}-{self._threads}",
                             daemon=True).start()  # fmt: skip

    def _work(self) -> None:
        get = self._queue.get
        while True:
            call = get()
            if call is None:  # close()
                return
            loop, future, fn = call
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:  # goes to the awaiting task
                error = exc
            # Dropped before the wait for the next call: they hold the request's data.
            del call, fn
            # Idle before the outcome is out: a caller that makes its next request as soon
            # as it has this one's finds this thread instead of starting another.
            with self._lock:
                self._idle += 1
            _send(loop, future, result, error)
            del loop, future, result, error

    def close(self) -> None:
        """Let every worker end once the calls queued before are done; later calls raise."""
        with self._lock:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)


async def await_future(future: Any) -> Any:
    """Await a ``concurrent.futures.Future`` with one ``call_soon_threadsafe`` for its
    outcome (``asyncio.wrap_future`` chains two futures both ways). Cancelling the awaiting
    task cancels ``future`` (for :class:`~pb_tensor.runtime.InferFuture`: the request).

    Raises:
        BaseException: the future's exception.
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[Any] = loop.create_future()

    def done(f: Any) -> None:
        # On the thread that completed f (or this one, if it was done already).
        error = f.exception() if not f.cancelled() else asyncio.CancelledError()
        _send(loop, waiter, None if error is not None else f.result(), error)

    if isinstance(future, InferFuture):
        future.add_done_callback(done, quick=True)  # in the completing thread: it only sends
    else:
        future.add_done_callback(done)
    try:
        return await waiter
    except asyncio.CancelledError:
        future.cancel()
        raise
