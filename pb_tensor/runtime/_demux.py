"""Several readers of one stub's channel: the batches in flight on the stub (a decoupled
model's instance takes its next batch once ``execute`` returned, as Triton's does, while the
previous batch's responses still come) and the runtime's own calls (readiness, metrics,
finalize).

Whoever waits for a message reads the channel itself, one reader at a time, and puts what is
for another waiter in that waiter's box: with one batch in flight (the common case) its reader
never hands a message over. The stub's own calls (BLS, model control) and its log records are
served by whoever reads them, as they come.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pb_tensor import Tensor
from pb_tensor.runtime._channel import Channel, ChannelClosed, Message

__all__ = ["BATCH_KINDS", "CALL_REPLIES", "READINESS", "Demux", "NoAnswer"]

BATCH_KINDS = frozenset(("response", "done"))
"""Messages about one batch: their body ends with the batch id."""

CALL_REPLIES = frozenset(("loaded", "failed", "ready", "metrics", "finalized"))
"""The stub's answers to the runtime's calls (one call at a time: the instance is held)."""

READINESS = "ready_state"
"""The stub's answer to a readiness check, and the key of the box it goes to: checks run
beside requests and other calls (see ``_readiness``), so their answers have a box of their
own."""

# The longest a waiter sleeps before looking again (a signal handler's exception reaches it
# within this).
_SLICE = 0.2


class NoAnswer(TimeoutError):
    """No message for the waiter within its deadline (a ``TimeoutError`` a signal handler
    raises in the caller's wait is the caller's, not this)."""


class Demux:
    """Routes a channel's messages to their waiters: batch messages by batch id, call replies
    to the one call waiting, everything else to ``serve`` (in the reading thread)."""

    def __init__(self, channel: Channel, serve: Callable[[str, list[Tensor], Any], None]) -> None:
        self.channel = channel
        self._serve = serve
        self._cond = threading.Condition(threading.Lock())
        self._boxes: dict[int | str | None, deque[Message]] = {None: deque(),
                                                               READINESS: deque()}
        # The reading thread (while it serves a stub's call, the call may wait for this
        # stub too: a BLS request to the same model reads in that thread, nested).
        self._reader: int | None = None
        self._closed: str | None = None

    def open(self, batch_id: int) -> None:
        """Messages for ``batch_id`` are kept for :meth:`next` from now on."""
        with self._cond:
            self._boxes[batch_id] = deque()

    def close(self, batch_id: int) -> None:
        """Messages for ``batch_id`` are dropped from now on (its reader is gone)."""
        with self._cond:
            self._boxes.pop(batch_id, None)

    def next(self, key: int | str | None, deadline: float | None) -> Message:
        """The next message for batch ``key`` (None: the runtime's call; :data:`READINESS`:
        a readiness check's answer), waiting until
        ``deadline`` (``time.monotonic()``; None: no limit).

        Raises:
            ChannelClosed: the stub is gone.
            NoAnswer: nothing came before the deadline.
        """
        cond = self._cond
        me = threading.get_ident()
        with cond:
            while True:
                box = self._boxes.get(key)
                if box:
                    return box.popleft()
                if self._closed is not None:
                    raise ChannelClosed(self._closed)
                if self._reader == me:
                    break  # nested: a stub call this thread serves waits for this stub
                if self._reader is None:
                    self._reader = me
                    try:
                        cond.release()
                        try:
                            return self._read(key, deadline)
                        finally:
                            cond.acquire()
                    finally:
                        self._reader = None
                        cond.notify_all()
                wait = _SLICE
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise NoAnswer("no answer before the deadline")
                cond.wait(wait)
        return self._read(key, deadline)

    def idle(self) -> bool:
        """Whether nobody reads and no batch is open (only the idle watcher may read then)."""
        with self._cond:
            return (self._reader is None and self._closed is None
                    and not any(type(key) is int for key in self._boxes))  # (batch ids)

    def pump(self) -> bool:
        """Read one message that is there now, if nobody else reads, and route it (a log
        record is served, an answer goes to its box): the stub's idle watcher calls this so
        that what a stub sends between requests (a background thread's log records) comes
        out as it is sent, not with the next request. Never waits. Whether it read one.

        Raises:
            ChannelClosed: the stub is gone.
        """
        me = threading.get_ident()
        with self._cond:
            if self._reader is not None:
                return False
            if self._closed is not None:
                raise ChannelClosed(self._closed)
            self._reader = me
        try:
            if not self.channel.poll(0):
                return False
            message = self._recv()
            served, target = self._target(message)
            if not served:
                with self._cond:
                    box = self._boxes.get(target)
                    if box is not None:
                        box.append(message)
            return True
        finally:
            with self._cond:
                self._reader = None
                self._cond.notify_all()

    def _recv(self) -> Message:
        try:
            return self.channel.recv()
        except ChannelClosed as exc:
            with self._cond:
                self._closed = str(exc) or "end of stream"
                self._cond.notify_all()
            raise

    def _target(self, message: Message) -> tuple[bool, int | str | None]:
        """(False, the box ``message`` goes to), or (True, None) for a message of the stub's
        own (a log record, BLS, model control), served here."""
        kind, tensors, body = message
        if kind in BATCH_KINDS:
            batch_id: int = body[-1]
            return False, batch_id
        if kind in CALL_REPLIES:
            return False, None
        if kind == READINESS:
            return False, READINESS
        self._serve(kind, tensors, body)
        return True, None

    def _read(self, key: int | str | None, deadline: float | None) -> Message:
        """As the reader: read until a message for ``key`` comes, routing the others."""
        channel = self.channel
        while True:
            with self._cond:
                box = self._boxes.get(key)
                if box:  # read by a nested reader (a stub call this thread served)
                    return box.popleft()
            if deadline is not None:
                remaining = max(0.0, deadline - time.monotonic())
                if not channel.poll(remaining):
                    raise NoAnswer(f"no answer within {remaining} s")
            message = self._recv()
            served, target = self._target(message)
            if served:
                continue
            if target == key:
                return message
            with self._cond:
                box = self._boxes.get(target)
                if box is not None:  # else a batch nobody reads any more: dropped
                    box.append(message)
                    self._cond.notify_all()
