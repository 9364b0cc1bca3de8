"""What happens when a decoupled model's ``async def execute`` ends in the background.

Triton's stub schedules a decoupled model's coroutine on its event loop and returns to its
message loop at once (``RunCoroutine(..., in_background=true)``); when the coroutine raises,
``BackgroundFutureDone`` only logs the traceback, and requests it did not finish never get
their final response. Here the traceback is logged the same way, and the requests of that
``execute`` call that did not end yet end with the error (stricter: a caller sees an error
where Triton's client waits forever).
"""

from __future__ import annotations

import concurrent.futures
import logging
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from pb_tensor.runtime._seam import (
    InferenceResponse,
    InferenceResponseSender,
    TritonError,
    close_sender,
    sender_is_closed,
)

__all__ = ["BackgroundBatch", "background_done"]

log = logging.getLogger("pb_tensor.runtime")

_FINAL = 1


class BackgroundBatch(Protocol):
    """The part of a host's batch the end of its coroutine needs."""

    done: bool
    senders: dict[int, InferenceResponseSender]

    @property
    def sink(self) -> Callable[[int, InferenceResponse | None, int], None]: ...


def background_done(
    batch: BackgroundBatch,
    size: int,
    describe: Callable[[BaseException], str],
    future: concurrent.futures.Future[Any],
) -> None:
    """The done callback of a decoupled coroutine's future (``size`` requests): log what it
    raised, as upstream's stub logs it, and end each request whose sender is not closed with
    ``describe(exc)`` as an error response with the final flag (senders the model asks for
    from now on come closed)."""
    if future.cancelled():
        return
    exc = future.exception()
    if exc is None:
        return
    log.error("%s", "".join(traceback.format_exception(exc)))
    batch.done = True
    error = TritonError(describe(exc))
    for index in range(size):
        sender = batch.senders.get(index)
        if sender is not None:
            if sender_is_closed(sender):
                continue
            close_sender(sender)
        batch.sink(index, InferenceResponse(error=error), _FINAL)
