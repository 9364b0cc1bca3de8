"""The load generator of ``bench_serve.py``: cheap per call and the same for every server.

Every request is built once, as the bytes that go on the wire, and sent again and again:

- HTTP/1.1: the request line, headers and body as one ``bytes``, written to a plain socket;
  the answer is read with a minimal reader (status line, ``Content-Length``, then the whole
  body into a buffer of that size, reused by the next answer of the same size; or a
  chunked body, which KServe sends). A status other than 200 is an error.
- gRPC: HTTP/2 spoken directly on a plain socket: the connection preface and settings
  once, then per call one prebuilt HEADERS frame (HPACK literals, no dynamic table) and one
  DATA frame holding the serialised ``ModelInferRequest`` (only the stream id changes).
  The answer is read frame by frame until the stream ends; a call that did not bring
  exactly one gRPC message (an error status comes as trailers only) is an error. The
  connection window is kept open with ``WINDOW_UPDATE``s, server ``PING``s and
  ``SETTINGS`` are acknowledged.

Each answer's body (HTTP) or message (gRPC) must equal the first answer of that server,
which was decoded and checked for the right values (``check`` of :func:`drive`); an answer
that differs in bytes is decoded and checked on its own, so every answer is verified.

One connection per client, one request in flight per connection, all connections driven by
one thread with ``selectors`` (no thread hops in the client): ``clients`` concurrent
clients cost one process' CPU, and the client CPU per call is measured (``getrusage``) and
printed next to each result, so what the load generator costs is visible.
"""

from __future__ import annotations

import resource
import selectors
import socket
import struct
import time
from collections.abc import Callable

__all__ = ["Answer", "call", "drive", "grpc_client", "http_client"]

Answer = Callable[[bytes | bytearray], None]
"""Checks one decoded answer (raises ``RuntimeError`` when it is wrong)."""

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_MAX_WINDOW = 2**31 - 1
_DATA, _HEADERS, _RST, _SETTINGS, _PING, _GOAWAY, _WINDOW = 0, 1, 3, 4, 6, 7, 8
_END_STREAM, _ACK = 0x1, 0x1


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(
        ">I", stream) + payload


def _literal(name_index: int, value: bytes) -> bytes:
    """HPACK literal without indexing, name from the static table, value not Huffman coded
    (indexes under 15 and values under 127 bytes only)."""
    return bytes((name_index, len(value))) + value


class _Connection:
    """One client connection: ``start()`` sends the request, ``feed()`` takes bytes and says
    whether the answer is complete; ``answer`` is then its body (HTTP) or message (gRPC)."""

    sock: socket.socket
    answer: bytes | bytearray = b""

    def start(self) -> None:
        raise NotImplementedError

    def feed(self, data: bytes) -> bool:
        raise NotImplementedError


class _Http(_Connection):
    def __init__(self, address: tuple[str, int], path: str, body: bytes,
                 headers: dict[str, str]) -> None:
        head = [f"POST {path} HTTP/1.1", f"Host: {address[0]}:{address[1]}",
                f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""
        self._body: bytearray | None = None
        self._got = 0
        self._chunked = False
        self._spare: bytearray | None = None

    def start(self) -> None:
        self._buf, self._body, self._got, self._chunked = b"", None, 0, False
        self.sock.sendall(self.request)

    def _chunks(self) -> bool:
        """Decode a chunked body collected in ``_buf``; whether it is complete."""
        buf, pos, parts = self._buf, 0, []
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return False
            size = int(buf[pos:eol].split(b";")[0], 16)
            if size == 0:
                if buf.find(b"\r\n\r\n", eol) < 0 and not buf.endswith(b"\r\n\r\n"):
                    return False
                parts.append(b"")
                break
            if len(buf) < eol + 2 + size + 2:
                return False
            parts.append(buf[eol + 2:eol + 2 + size])
            pos = eol + 2 + size + 2
        self.answer = b"".join(parts)
        self._chunked = False
        return True

    def feed(self, data: bytes) -> bool:
        if self._chunked:
            self._buf += data
            return self._chunks()
        if self._body is None:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            head = self._buf[:end].decode("latin-1").split("\r\n")
            if head[0][9:12] != "200":
                raise RuntimeError(f"HTTP answer {head[0]!r}: {self._buf[end + 4:]!r}")
            length = next((int(line.split(":", 1)[1]) for line in head[1:]
                           if line[:15].lower() == "content-length:"), None)
            data = self._buf[end + 4:]
            if length is None:
                if not any(line.lower() == "transfer-encoding: chunked" for line in head):
                    raise RuntimeError(f"HTTP answer without a length: {head}")
                self._chunked = True
                self._buf = data
                return self._chunks()
            # The last answer's buffer is reused when the size matches (an answer is valid
            # until the next call): no fresh pages to fault in for every large answer.
            spare = self._spare
            self._body = spare if spare is not None and len(spare) == length else bytearray(
                length)
        body = self._body
        body[self._got:self._got + len(data)] = data
        self._got += len(data)
        if self._got < len(body):
            return False
        if self._got > len(body):
            raise RuntimeError("HTTP answer longer than its Content-Length")
        self.answer = self._spare = body
        return True

    def read_into(self) -> bool | None:
        """Read the rest of a large body straight into its buffer; None when the headers
        are not read yet."""
        if self._body is None:
            return None
        view = memoryview(self._body)[self._got:]
        got = self.sock.recv_into(view)
        if got == 0:
            raise RuntimeError("the server closed the connection")
        self._got += got
        if self._got < len(self._body):
            return False
        self.answer = self._spare = self._body
        return True


class _Grpc(_Connection):
    def __init__(self, address: tuple[str, int], method: str, message: bytes) -> None:
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        authority = f"{address[0]}:{address[1]}".encode()
        self._block = (b"\x83\x86" + _literal(4, method.encode()) + _literal(1, authority)
                       + b"\x0f\x10" + bytes((len(b"application/grpc"),)) + b"application/grpc"
                       + b"\x00\x02te\x08trailers")
        self._data = b"\x00" + struct.pack(">I", len(message)) + message
        self._stream = -1
        self._window = 65535  # the server's connection window for what we send
        self._received = 0
        self._buf = b""
        self._message = bytearray()
        settings = struct.pack(">HI", 2, 0) + struct.pack(">HI", 4, _MAX_WINDOW)
        self.sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0, settings)
                          + _frame(_WINDOW, 0, 0, struct.pack(">I", _MAX_WINDOW - 65535)))

    def start(self) -> None:
        self._stream += 2
        self._message = bytearray()
        if len(self._data) > self._window:
            self._wait_window()
        self._window -= len(self._data)
        self.sock.sendall(_frame(_HEADERS, 0x4, self._stream, self._block)
                          + _frame(_DATA, _END_STREAM, self._stream, self._data))

    def _wait_window(self) -> None:
        self.sock.setblocking(True)
        try:
            while len(self._data) > self._window:
                data = self.sock.recv(1 << 16)
                if not data:
                    raise RuntimeError("the server closed the connection")
                self._buf += data
                self._frames()
        finally:
            self.sock.setblocking(False)

    def feed(self, data: bytes) -> bool:
        self._buf += data
        return self._frames()

    def _frames(self) -> bool:
        done = False
        buf = self._buf
        pos = 0
        replies = b""
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            stream = int.from_bytes(buf[pos + 5:pos + 9], "big") & _MAX_WINDOW
            payload = buf[pos + 9:pos + 9 + length]
            pos += 9 + length
            if kind == _DATA and stream == self._stream:
                self._message += payload
                self._received += length
            elif kind == _SETTINGS and not flags & _ACK:
                replies += _frame(_SETTINGS, _ACK, 0, b"")
            elif kind == _PING and not flags & _ACK:
                replies += _frame(_PING, _ACK, 0, payload)
            elif kind == _WINDOW and stream == 0:
                self._window += int.from_bytes(payload, "big") & _MAX_WINDOW
            elif kind in (_GOAWAY, _RST):
                raise RuntimeError(f"gRPC: the server sent frame type {kind}: {payload!r}")
            if stream == self._stream and flags & _END_STREAM and kind in (_DATA, _HEADERS):
                done = True
        self._buf = buf[pos:]
        if self._received > 1 << 30:  # keep the connection window open
            replies += _frame(_WINDOW, 0, 0, struct.pack(">I", self._received))
            self._received = 0
        if replies:
            self.sock.sendall(replies)
        if done:
            message = bytes(self._message)
            if len(message) < 5 or int.from_bytes(message[1:5], "big") != len(message) - 5:
                raise RuntimeError("gRPC call ended without one answer (an error status)")
            self.answer = message[5:]
        return done


def http_client(address: str, path: str, body: bytes, headers: dict[str, str]
                ) -> Callable[[], _Connection]:
    """A factory of HTTP client connections posting ``body`` to ``path``."""
    host, port = address.rsplit(":", 1)
    return lambda: _Http((host, int(port)), path, body, headers)


def grpc_client(address: str, method: str, message: bytes) -> Callable[[], _Connection]:
    """A factory of gRPC client connections calling ``method`` with the serialised
    ``message``."""
    host, port = address.rsplit(":", 1)
    return lambda: _Grpc((host, int(port)), method, message)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _readable(conn: _Connection) -> bool:
    """Take what the socket has; whether the answer is complete."""
    done = conn.read_into() if isinstance(conn, _Http) else None
    if done is None:
        data = conn.sock.recv(1 << 20)
        if not data:
            raise RuntimeError("the server closed the connection")
        done = conn.feed(data)
    return done


def call(conn: _Connection) -> bytes | bytearray:
    """One call on ``conn``, blocking; its answer.

    Raises:
        RuntimeError: the call failed.
    """
    conn.sock.setblocking(True)
    conn.start()
    while not _readable(conn):
        pass
    return conn.answer


def drive(make: Callable[[], _Connection], clients: int, requests: int, check: Answer
          ) -> tuple[float, list[float], float]:
    """Requests per second, the latencies (seconds) and the client's CPU seconds per call
    of ``requests`` calls from ``clients`` connections, each keeping one call in flight.

    Raises:
        RuntimeError: a call failed or answered wrongly.
    """
    conns: list[_Connection] = []
    selector = selectors.DefaultSelector()
    try:
        for _ in range(clients):
            conns.append(make())
        reference = bytes(call(conns[0]))
        check(reference)
        for conn in conns[1:]:
            if call(conn) != reference:
                check(conn.answer)
        return _run(selector, conns, requests, reference, check)
    finally:
        selector.close()
        for conn in conns:
            conn.sock.close()


def _run(selector: selectors.BaseSelector, conns: list[_Connection], requests: int,
         reference: bytes, check: Answer) -> tuple[float, list[float], float]:
    started: dict[int, float] = {}
    latencies: list[float] = []
    sent = 0
    cpu = _cpu()
    begin = time.perf_counter()
    for conn in conns[:requests]:
        conn.sock.setblocking(False)
        selector.register(conn.sock, selectors.EVENT_READ, conn)
        started[id(conn)] = time.perf_counter()
        conn.start()
        sent += 1
    pending = sent
    while pending:
        events = selector.select(120)
        if not events:
            raise RuntimeError("no answer within 120 s")
        for key, _ in events:
            conn = key.data
            if not _readable(conn):
                continue
            now = time.perf_counter()
            latencies.append(now - started[id(conn)])
            if conn.answer != reference:
                check(conn.answer)
            if sent < requests:
                started[id(conn)] = time.perf_counter()
                conn.start()
                sent += 1
            else:
                pending -= 1
    elapsed = time.perf_counter() - begin
    cpu = _cpu() - cpu
    return len(latencies) / elapsed, latencies, cpu / len(latencies)
