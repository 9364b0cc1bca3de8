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

__all__ = ["HIGH_WATER", "protocol_class"]

HIGH_WATER = 8 << 20
"""Bytes of request body buffered per connection before the application is woken (and
reading pauses until it takes them) when the request has no usable ``Content-Length``."""


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


def _build(base: Any, cycle_base: Any, limit: int) -> Any:
    class _Cycle(cycle_base):  # type: ignore[misc]
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
