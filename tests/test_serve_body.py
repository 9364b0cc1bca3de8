"""How request bodies reach the application: whole, in pieces, chunked, after
``Expect: 100-continue``, several requests on one connection, a client that leaves halfway
(pb-tensor's uvicorn protocol buffers a body up to its ``Content-Length``)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from serve_support import EXAMPLES, needs_serve

pytestmark = needs_serve

LIMIT = 1 << 20
PATH = "/v2/models/add_sub/infer"


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from pb_tensor.serve import Options, Server

    options = Options([EXAMPLES], http_port=0, grpc_port=0, metrics_port=0, allow_grpc=False,
                      allow_metrics=False, model_control_mode="explicit",
                      load_models=["add_sub"], max_input_size=LIMIT, in_process=True)
    with Server(options) as running:
        yield running


def _request(n: int) -> tuple[bytes, bytes, np.ndarray[Any, Any]]:
    """Header JSON and binary data of an add_sub request of ``n`` elements per input."""
    a = np.arange(n, dtype=np.float32)
    head = json.dumps({"inputs": [
        {"name": f"INPUT{i}", "datatype": "FP32", "shape": [n],
         "parameters": {"binary_data_size": 4 * n}} for i in (0, 1)],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    return head, a.tobytes() + (a + 1).tobytes(), 2 * a + 1  # fmt: skip


def _exchange(url: str, pieces: list[bytes], pause: float = 0.0) -> tuple[bytes, bytes]:
    """Send ``pieces`` on one connection (``pause`` s apart); the status line and body of
    the response."""
    host, port = url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(pause)
        reader = sock.makefile("rb")
        status = reader.readline()
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status.strip(), reader.read(length)


def _output0(body: bytes, n: int) -> list[float]:
    return np.frombuffer(body[-4 * n:], dtype=np.float32).tolist()


def _start(head: bytes, size: int, extra: bytes = b"") -> bytes:
    return (f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\n").encode() + extra + b"\r\n"


def test_body_in_slow_pieces(server: Any) -> None:
    n = 20000  # 160 KB of data, sent in four pieces with pauses between them
    head, data, expected = _request(n)
    body = head + data
    cut = len(body) // 4
    pieces = [_start(head, len(body)), body[:cut], body[cut:2 * cut], body[2 * cut:3 * cut],
              body[3 * cut:]]
    status, reply = _exchange(server.http_url, pieces, pause=0.05)
    assert status == b"HTTP/1.1 200 OK"
    assert _output0(reply, n) == expected.tolist()


def test_chunked_body_without_content_length(server: Any) -> None:
    n = 1000
    head, data, expected = _request(n)
    body = head + data
    start = (f"POST {PATH} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
             f"Inference-Header-Content-Length: {len(head)}\r\n\r\n").encode()
    chunks = b"".join(b"%x\r\n" % len(part) + part + b"\r\n"
                      for part in (body[:100], body[100:]))
    status, reply = _exchange(server.http_url, [start, chunks, b"0\r\n\r\n"], pause=0.02)
    assert status == b"HTTP/1.1 200 OK"
    assert _output0(reply, n) == expected.tolist()


def test_expect_100_continue(server: Any) -> None:
    n = 100
    head, data, expected = _request(n)
    body = head + data
    host, port = server.http_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(_start(head, len(body), b"Expect: 100-continue\r\n"))
        reader = sock.makefile("rb")
        assert reader.readline() == b"HTTP/1.1 100 Continue\r\n"
        assert reader.readline() == b"\r\n"
        sock.sendall(body)
        assert reader.readline() == b"HTTP/1.1 200 OK\r\n"
        length = 0
        while (line := reader.readline()) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        assert _output0(reader.read(length), n) == expected.tolist()


def test_requests_one_after_another_on_one_connection(server: Any) -> None:
    import http.client

    host, port = server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for n in (3, 70000, 5):  # the middle body is past uvicorn's own 64 KiB mark
            head, data, expected = _request(n)
            conn.request("POST", PATH, body=head + data,
                         headers={"Inference-Header-Content-Length": str(len(head))})
            response = conn.getresponse()
            assert response.status == 200
            assert _output0(response.read(), n) == expected.tolist()
    finally:
        conn.close()


def test_body_over_the_limit_is_refused_and_the_server_serves_on(server: Any) -> None:
    head, data, _ = _request(LIMIT // 8 + 1)
    status, reply = _exchange(server.http_url, [_start(head, len(head + data)), head + data])
    assert status == b"HTTP/1.1 400 Bad Request"
    assert json.loads(reply) == {"error": (
        f"request JSON size of {len(head + data)} bytes exceeds the maximum allowed input "
        f"size of {LIMIT} bytes. Use --http-max-input-size to increase the limit.")}
    head, data, expected = _request(4)
    status, reply = _exchange(server.http_url, [_start(head, len(head + data)), head + data])
    assert _output0(reply, 4) == expected.tolist()


def test_client_leaving_halfway_through_its_body(server: Any) -> None:
    head, data, expected = _request(50000)
    body = head + data
    host, port = server.http_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(_start(head, len(body)) + body[: len(body) // 2])
        time.sleep(0.1)
    head, data, expected = _request(4)
    status, reply = _exchange(server.http_url, [_start(head, len(head + data)), head + data])
    assert status == b"HTTP/1.1 200 OK"
    assert _output0(reply, 4) == expected.tolist()


def test_fallback_when_uvicorn_lacks_the_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    from uvicorn.protocols.http import httptools_impl

    from pb_tensor.serve._protocol import protocol_class

    assert protocol_class(LIMIT).__mro__[1] is httptools_impl.HttpToolsProtocol
    monkeypatch.delattr(httptools_impl.HttpToolsProtocol, "_should_upgrade")
    assert protocol_class(LIMIT) == "httptools"
