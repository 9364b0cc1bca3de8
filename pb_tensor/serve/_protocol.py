"""uvicorn's httptools protocol with request bodies handed over in large pieces.

Stock uvicorn pauses reading and wakes the application for every ~64 KiB of body and copies
each piece once more into a ``bytes`` for ``receive()``: a 64 MiB binary request takes ~260
round trips through the event loop and five copies of its bytes. Here the body collects in
one ``bytearray`` until the request's ``Content-Length`` (when it is within the server's
input limit; otherwise :data:`HIGH_WATER` bytes) before the application is woken, and
``receive()`` hands that buffer over as it is (the application owns it): a request body
arrives as one message. Parsing stays httptools'; flow control (pause reading past the
high-water mark) stays as uvicorn's, with that mark. Falls back to uvicorn's own protocol
when its internals are not the ones this was written against (:func:`protocol_class`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HIGH_WATER", "on_disconnect", "protocol_class"]

HIGH_WATER = 8 << 20
"""Bytes of request body buffered per connection before the application is woken (and
reading pauses until it takes them) when the request has no usable ``Content-Length``."""


_JOIN_LIMIT = 64 << 10
"""Response bodies up to this size leave in one write with the status line and headers."""


def protocol_class(limit: int) -> Any:
    """The HTTP protocol class to give ``uvicorn.Config(http=...)``: the large-piece
    protocol, buffering a request body of up to ``limit`` bytes (the server's input limit,
    past which the application refuses the request) whole; or ``"httptools"`` (uvicorn's
    own) when uvicorn's httptools protocol does not have the parts it builds on."""
    try:
        from uvicorn.protocols.http import httptools_impl
    except ImportError:  # no httptools
        return "h11"
    base = getattr(httptools_impl, "HttpToolsProtocol", None)
    cycle = getattr(httptools_impl, "RequestResponseCycle", None)
    needed = ("on_body", "on_headers_complete", "_should_upgrade")
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


def _build(base: Any, cycle_base: Any, limit: int) -> Any:
    class _Cycle(cycle_base):  # type: ignore[misc]
        pb_cycle = True
        pb_gone: Any = None
        pb_start: Any = None

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
            # uvicorn's receive(), without its copy of the body into a new bytes.
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
            body = self_.body
            self_.body = bytearray()
            return {"type": "http.request", "body": body, "more_body": self_.more_body}

    class _Protocol(base):  # type: ignore[misc]
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            cycle: Any = getattr(self, "cycle", None)
            # The application's task has not started yet: its receive is looked up later.
            if type(cycle) is cycle_base and isinstance(getattr(cycle, "body", None),
                                                        (bytes, bytearray)):
                cycle.__class__ = _Cycle
                cycle.body = bytearray()
                cycle.pb_high_water = HIGH_WATER
                for name, value in self.headers:
                    if name == b"content-length" and value.isdigit():
                        cycle.pb_high_water = max(1, min(int(value), limit))

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
            cycle.body += body
            if len(cycle.body) >= cycle.pb_high_water:
                self.flow.pause_reading()
                cycle.message_event.set()

    return _Protocol
