"""uvicorn's httptools protocol with request bodies read straight into their own buffer.

Stock uvicorn pauses reading and wakes the application for every ~64 KiB of body and copies
each piece once more into a ``bytes`` for ``receive()``: a 64 MiB binary request takes ~260
round trips through the event loop and five copies of its bytes. Here a request whose
``Content-Length`` is within the server's input limit gets a ``bytearray`` of that length
when its headers are parsed, the socket is read straight into it (the transport sees a
``BufferedProtocol``: no ``bytes`` per read), and the application is woken once, when the
body is complete; ``receive()`` hands that buffer over as it is (the application owns it).
Large bodies' buffers are kept for the next request of the same size once nothing refers to
them any more (:class:`_Bodies`): fresh memory costs a page fault per 4 KiB page, more than
the copy itself. Every byte still goes through httptools' parser, which frames the body;
flow control (pause reading past the high-water mark) stays as uvicorn's. A request without
a usable ``Content-Length`` (chunked, or past the input limit) collects in a ``bytearray``
up to :data:`HIGH_WATER` bytes before the application is woken. Falls back to uvicorn's own
protocol when its internals are not the ones this was written against
(:func:`protocol_class`).
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HIGH_WATER", "on_disconnect", "protocol_class"]

HIGH_WATER = 8 << 20
"""Bytes of request body buffered per connection before the application is woken (and
reading pauses until it takes them) when the request has no usable ``Content-Length``."""


_JOIN_LIMIT = 64 << 10
"""Response bodies up to this size leave in one write with the status line and headers."""

_READ_SIZE = 256 << 10
"""Bytes read at a time (uvloop's own read size), into a body's own buffer or, outside
one (request lines, headers, chunked bodies), into a scratch buffer."""

_KEEP_MIN = 1 << 20
"""Bodies from this size on have their buffer kept for reuse (smaller ones come from
malloc's reused memory anyway)."""

_KEEP_COUNT = 4
"""Buffers kept for reuse at most (per server)."""

_KEEP_SECONDS = 30.0
"""A kept buffer not reused for this long is let go."""


def protocol_class(limit: int) -> Any:
    """The HTTP protocol class to give ``uvicorn.Config(http=...)``: the protocol reading
    a request body of up to ``limit`` bytes (the server's input limit, past which the
    application refuses the request) straight into its own buffer, handed over whole; or
    ``"httptools"`` (uvicorn's own) when uvicorn's httptools protocol does not have the parts
    it builds on."""
    try:
        from uvicorn.protocols.http import httptools_impl
    except ImportError:  # no httptools
        return "h11"
    base = getattr(httptools_impl, "HttpToolsProtocol", None)
    cycle = getattr(httptools_impl, "RequestResponseCycle", None)
    needed = ("on_body", "on_headers_complete", "on_message_complete", "data_received",
              "_should_upgrade")
    if base is None or cycle is None or not all(hasattr(base, n) for n in needed):
        return "httptools"
    return _build(base, cycle, limit)


class _Held:
    """A stand-in transport that collects what uvicorn writes for one response, so that the
    status line, the headers and a small body leave in one ``write``."""

    __slots__ = ("closed", "parts", "transport")

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def _uninitialized_maker() -> Callable[[Any, int], bytearray] | None:
    pythonapi = getattr(ctypes, "pythonapi", None)  # CPython only
    if pythonapi is None or sys.implementation.name != "cpython":
        return None
    prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)
    make: Callable[[Any, int], bytearray] = prototype(
        ("PyByteArray_FromStringAndSize", pythonapi))
    return make


_UNINITIALIZED = _uninitialized_maker()


def _new_buffer(size: int) -> bytearray:
    """A ``bytearray`` of ``size`` bytes that the caller overwrites whole before anyone reads
    it: on CPython its memory is not written here (``PyByteArray_FromStringAndSize`` with no
    data), so the system commits its pages as the body arrives, as when a body grew piece
    by piece: a client that announces a large body and sends nothing costs address space,
    not memory (``bytearray(size)`` writes zeros into every page first).

    Raises:
        MemoryError: no memory for it.
    """
    if _UNINITIALIZED is None or size == 0:
        return bytearray(size)
    return _UNINITIALIZED(None, size)


def _references(kept: list[bytearray], i: int) -> int:
    return sys.getrefcount(kept[i])


# What _references() counts for a buffer that only the list refers to. Measured, not
# assumed: what getrefcount counts for its own argument differs between Python versions.
_IDLE = _references([bytearray(1)], 0)


class _Bodies:
    """Request-body buffers of one server, kept for the next request of the same size.

    A kept buffer is reused only when nothing but this list refers to it any more: every
    view of it (the inputs of a request, a response still being written from it) holds a
    reference to it, so a reused buffer is one nobody can see. Fresh memory costs a page
    fault per page (64 MiB: ~16,000 faults, measured 40-120 ms on a small virtual machine,
    three times the copy of the same bytes); a reused buffer costs none. At most
    :data:`_KEEP_COUNT` buffers of :data:`_KEEP_MIN` bytes or more are kept; one not reused
    for :data:`_KEEP_SECONDS` is let go. Reference counts tell only on CPython: elsewhere
    nothing is kept. Used on the event loop's thread only.
    """

    def __init__(self) -> None:
        self._kept: list[bytearray] = []
        self._used: list[float] = []
        self._timer: asyncio.TimerHandle | None = None
        self._enabled = sys.implementation.name == "cpython"

    def take(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes that nothing else refers to (its contents are
        stale: the caller overwrites all of it before anyone reads it)."""
        if size < _KEEP_MIN or not self._enabled:
            return _new_buffer(size)
        kept = self._kept
        for i in range(len(kept)):
            if len(kept[i]) == size and _references(kept, i) == _IDLE:
                self._used[i] = time.monotonic()
                return kept[i]
        buffer = _new_buffer(size)
        if len(kept) >= _KEEP_COUNT:
            del kept[0], self._used[0]
        kept.append(buffer)
        self._used.append(time.monotonic())
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(_KEEP_SECONDS, self._trim)
        return buffer

    def _trim(self) -> None:
        self._timer = None
        old = time.monotonic() - _KEEP_SECONDS
        keep = [i for i, used in enumerate(self._used) if used > old]
        self._kept = [self._kept[i] for i in keep]
        self._used = [self._used[i] for i in keep]
        if self._kept:
            self._timer = asyncio.get_running_loop().call_later(_KEEP_SECONDS, self._trim)


def on_disconnect(receive: Any, callback: Any) -> bool:
    """Call ``callback()`` when the client of the request whose ``receive`` this is goes
    away (at most once; not after the response is complete). False when the protocol is
    not this module's (the caller watches ``receive()`` instead); the callback runs at
    once when the client is gone already."""
    cycle = getattr(receive, "__self__", None)
    if cycle is None or not getattr(cycle, "pb_cycle", False):
        return False
    if cycle.disconnected:
        callback()
    else:
        cycle.pb_gone = callback
    return True


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's one ``Content-Length``; None without one, with several, or with a
    ``Transfer-Encoding`` (which frames the body instead)."""
    found = None
    for name, value in headers:
        if name == b"content-length":
            if found is not None or not value.isdigit():
                return None
            found = int(value)
        elif name == b"transfer-encoding":
            return None
    return found


def _build(base: Any, cycle_base: Any, limit: int) -> Any:
    bodies = _Bodies()
    scratch = bytearray(_READ_SIZE)
    scratch_view = memoryview(scratch)

    class _Cycle(cycle_base):  # type: ignore[misc]
        pb_cycle = True
        pb_gone: Any = None
        pb_start: Any = None
        # The body's own buffer (a Content-Length within the limit) and how much of it has
        # arrived; None: the body collects in ``body`` as uvicorn's does.
        pb_target: bytearray | None = None
        pb_got = 0

        async def send(self, message: Any) -> None:
            # The start of a response with a Content-Length is held back and written with
            # the first body message (one write, one system call, for a small response); a
            # streamed one (server-sent events) starts at once.
            self_: Any = self
            if message["type"] == "http.response.start" and not self_.response_started and any(
                    name == b"content-length" for name, _ in message.get("headers", ())):
                self_.pb_start = message
                return
            start = self_.pb_start
            if start is None:
                await super().send(message)
                return
            self_.pb_start = None
            body = message.get("body", b"")
            if len(body) > _JOIN_LIMIT:
                await super().send(start)
                await super().send(message)
                return
            transport = self_.transport
            held = _Held(transport)
            self_.transport = held
            try:
                await super().send(start)
                await super().send(message)
            finally:
                self_.transport = transport
            if held.parts and not transport.is_closing():
                transport.write(b"".join(held.parts))
            if held.closed:
                transport.close()

        async def receive(self) -> dict[str, Any]:
            # uvicorn's receive(), without its copy of the body into a new bytes; a body
            # with its own buffer is handed over once it is complete.
            self_: Any = self
            if self_.waiting_for_100_continue and not self_.transport.is_closing():
                self_.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self_.waiting_for_100_continue = False
            if not self_.disconnected and not self_.response_complete:
                self_.flow.resume_reading()
                await self_.message_event.wait()
                self_.message_event.clear()
            if self_.disconnected or self_.response_complete:
                return {"type": "http.disconnect"}
            target = self_.pb_target
            if target is not None:
                # Only the complete body (on_message_complete) or the client leaving sets
                # the event; waiting again for anything else is only a safeguard.
                while self_.more_body:
                    await self_.message_event.wait()
                    self_.message_event.clear()
                    if self_.disconnected or self_.response_complete:
                        return {"type": "http.disconnect"}
                self_.pb_target = None
                return {"type": "http.request", "body": target, "more_body": False}
            body = self_.body
            self_.body = bytearray()
            return {"type": "http.request", "body": body, "more_body": self_.more_body}

    class _Protocol(base):  # type: ignore[misc]
        # True while the parser is fed bytes that were read into the body's buffer already.
        pb_in_place = False

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            cycle: Any = getattr(self, "cycle", None)
            # The application's task has not started yet: its receive is looked up later.
            if type(cycle) is cycle_base and isinstance(getattr(cycle, "body", None),
                                                        (bytes, bytearray)):
                cycle.__class__ = _Cycle
                cycle.body = bytearray()
                size = _content_length(self.headers)
                cycle.pb_high_water = HIGH_WATER if size is None else max(1, min(size, limit))
                if size is not None and size <= limit:
                    cycle.pb_target = bodies.take(size)

        def connection_lost(self, exc: Exception | None) -> None:
            cycle: Any = getattr(self, "cycle", None)
            super().connection_lost(exc)
            if type(cycle) is _Cycle and cycle.disconnected and cycle.pb_gone is not None:
                gone, cycle.pb_gone = cycle.pb_gone, None
                gone()

        def on_body(self, body: bytes) -> None:
            cycle: Any = self.cycle
            if type(cycle) is not _Cycle:
                super().on_body(body)
                return
            if (self.parser.should_upgrade() and self._should_upgrade()
                    ) or cycle.response_complete:
                return
            target = cycle.pb_target
            if target is None:
                cycle.body += body
                if len(cycle.body) >= cycle.pb_high_water:
                    self.flow.pause_reading()
                    cycle.message_event.set()
                return
            got = cycle.pb_got
            if not self.pb_in_place:  # bytes read with the headers, or into the scratch
                target[got:got + len(body)] = body
            cycle.pb_got = got = got + len(body)
            if got >= len(target):  # complete: on_message_complete wakes the application
                self.flow.pause_reading()

    class _Reader(asyncio.BufferedProtocol):
        """What the transport sees: reads into the body's own buffer while a body with one
        is arriving, into a scratch buffer otherwise, and feeds every byte read to the
        uvicorn protocol (``http``) as uvicorn's transport would."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.http = _Protocol(*args, **kwargs)
            self._reading: memoryview | None = None

        def connection_made(self, transport: Any) -> None:
            self.http.connection_made(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            self._reading = None
            self.http.connection_lost(exc)

        def eof_received(self) -> bool | None:
            result: bool | None = self.http.eof_received()
            return result

        def pause_writing(self) -> None:
            self.http.pause_writing()

        def resume_writing(self) -> None:
            self.http.resume_writing()

        def get_buffer(self, sizehint: int) -> memoryview:
            cycle: Any = self.http.cycle
            if type(cycle) is _Cycle and not cycle.response_complete:
                target = cycle.pb_target
                # The parser is inside this body (its headers were the last parsed): what
                # comes next on the wire is the body's, up to its length. At most
                # _READ_SIZE at a time: the parser's copy of each piece for on_body then
                # reads it from the cache and reuses the same memory (whole-body reads
                # cost 21-23 ms of CPU per 64 MiB in the parser against 11-13 ms).
                got = cycle.pb_got
                if target is not None and got < len(target):
                    self._reading = view = memoryview(target)[got:got + _READ_SIZE]
                    return view
            self._reading = None
            return scratch_view

        def buffer_updated(self, nbytes: int) -> None:
            view, self._reading = self._reading, None
            http = self.http
            if view is None:
                http.data_received(scratch_view[:nbytes])
                return
            http.pb_in_place = True
            try:
                http.data_received(view[:nbytes])
            finally:
                http.pb_in_place = False

    return _Reader
