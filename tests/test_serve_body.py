"""How request bodies reach the application: whole, in pieces, chunked, after
``Expect: 100-continue``, several requests on one connection (one after another and
pipelined), a client that leaves halfway, on uvloop and on asyncio's loop (pb-tensor's
uvicorn protocol reads a body straight into a buffer of its ``Content-Length``); large
bodies' buffers reused only when nothing refers to them, and not written before the body
arrives."""

from __future__ import annotations

import json
import os
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
    import asyncio

    from uvicorn.protocols.http import httptools_impl

    from pb_tensor.serve._protocol import protocol_class

    reader = protocol_class(LIMIT)
    # uvloop reads into the protocol's buffers only for a BufferedProtocol that is not an
    # asyncio.Protocol.
    assert issubclass(reader, asyncio.BufferedProtocol)
    assert not issubclass(reader, asyncio.Protocol)
    monkeypatch.delattr(httptools_impl.HttpToolsProtocol, "_should_upgrade")
    assert protocol_class(LIMIT) == "httptools"


def test_pipelined_requests_in_one_write(server: Any) -> None:
    # The second request's headers and body arrive with the first's: each body is framed
    # by the parser, the first one's buffer ends where its Content-Length says.
    requests, answers = b"", []
    for n in (30000, 5):
        head, data, expected = _request(n)
        requests += _start(head, len(head + data)) + head + data
        answers.append(expected.tolist())
    host, port = server.http_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(requests)
        reader = sock.makefile("rb")
        for n, expected in zip((30000, 5), answers):
            assert reader.readline() == b"HTTP/1.1 200 OK\r\n"
            length = 0
            while (line := reader.readline()) != b"\r\n":
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            assert _output0(reader.read(length), n) == expected


_KEEPER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.last = None

    def execute(self, requests):
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            previous = x if self.last is None else self.last
            self.last = x  # a view of the request body, kept past the request
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array(previous))]))
        return responses
"""


def test_a_body_a_model_keeps_is_not_reused(tmp_path: Any) -> None:
    # Large bodies' buffers are reused for the next request of the same size, but only
    # when nothing refers to them any more: the model keeps each input (a view of its
    # request's body) until the next request and answers with it.
    import http.client

    from pb_tensor.serve import Options, Server

    (tmp_path / "keeper" / "1").mkdir(parents=True)
    (tmp_path / "keeper" / "1" / "model.py").write_text(_KEEPER)
    (tmp_path / "keeper" / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]\n')
    n = 1 << 20  # 4 MiB: past the size from which buffers are kept
    options = Options([str(tmp_path)], http_port=0, grpc_port=0, allow_grpc=False,
                      allow_metrics=False, max_input_size=8 << 20, in_process=True)
    with Server(options) as running:
        host, port = running.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            answers = []
            for value in (1, 2, 3, 4):
                data = np.full(n, value, dtype=np.float32).tobytes()
                head = json.dumps({"inputs": [
                    {"name": "IN", "datatype": "FP32", "shape": [n],
                     "parameters": {"binary_data_size": len(data)}}],
                    "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
                conn.request("POST", "/v2/models/keeper/infer", body=head + data,
                             headers={"Inference-Header-Content-Length": str(len(head))})
                response = conn.getresponse()
                assert response.status == 200
                out = np.frombuffer(response.read()[-4 * n:], dtype=np.float32)
                answers.append(set(out.tolist()))
        finally:
            conn.close()
    assert answers == [{1.0}, {1.0}, {2.0}, {3.0}]


def test_body_buffers_are_reused_only_when_nothing_refers_to_them() -> None:
    import asyncio

    from pb_tensor.serve._protocol import _KEEP_COUNT, _KEEP_MIN, _Bodies

    async def run() -> None:
        bodies = _Bodies()
        first = bodies.take(_KEEP_MIN)
        first_id = id(first)  # the pool keeps it alive: the id stays its own
        view = memoryview(first)[10:]
        del first
        assert id(bodies.take(_KEEP_MIN)) != first_id  # a view of it is alive
        del view
        again = bodies.take(_KEEP_MIN)
        assert id(again) == first_id  # nothing else refers to it: reused
        assert id(bodies.take(_KEEP_MIN)) != first_id  # `again` refers to it
        del again
        assert len(bodies.take(_KEEP_MIN + 1)) == _KEEP_MIN + 1  # no buffer of that size
        small = bodies.take(_KEEP_MIN - 1)
        del small
        assert len(bodies._kept) <= _KEEP_COUNT
        assert all(len(b) >= _KEEP_MIN for b in bodies._kept)

    asyncio.run(run())


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_an_announced_body_costs_no_memory_before_it_arrives() -> None:
    # A body's buffer is allocated when its headers are parsed, but its pages are not
    # written before its bytes arrive: clients announcing large bodies and sending nothing
    # do not make the server hold that memory.
    from pb_tensor.serve import Options, Server

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    size = 64 << 20
    options = Options([EXAMPLES], http_port=0, grpc_port=0, allow_grpc=False,
                      allow_metrics=False, model_control_mode="explicit",
                      load_models=["add_sub"], max_input_size=size, in_process=True)
    with Server(options) as running:
        host, port = running.http_url.rsplit(":", 1)
        before = resident()
        socks = [socket.create_connection((host, int(port)), timeout=30) for _ in range(4)]
        try:
            for sock in socks:
                sock.sendall((f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n"
                              "Expect: 100-continue\r\n\r\n").encode())
            for sock in socks:  # the server parsed the headers (and took the buffer)
                assert sock.makefile("rb").readline() == b"HTTP/1.1 100 Continue\r\n"
            grown = resident() - before
        finally:
            for sock in socks:
                sock.close()
    assert grown < size, f"{grown >> 20} MiB resident after announcing 4 x 64 MiB"


def test_bodies_on_asyncio_s_own_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without uvloop the HTTP service runs on asyncio's selector loop, whose transports read
    # into a BufferedProtocol's buffers as well: small, large and reused bodies.
    import http.client

    import pb_tensor.serve._server as server_module
    from pb_tensor.serve import Options, Server

    has = server_module._has
    monkeypatch.setattr(server_module, "_has", lambda m: m != "uvloop" and has(m))
    options = Options([EXAMPLES], http_port=0, grpc_port=0, allow_grpc=False,
                      allow_metrics=False, model_control_mode="explicit",
                      load_models=["add_sub"], max_input_size=16 << 20, in_process=True)
    with Server(options) as running:
        assert running._http.config.loop == "asyncio"
        host, port = running.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            for n in (3, 1 << 19, 1 << 19, 5):
                head, data, expected = _request(n)
                conn.request("POST", PATH, body=head + data,
                             headers={"Inference-Header-Content-Length": str(len(head))})
                response = conn.getresponse()
                assert response.status == 200
                assert _output0(response.read(), n) == expected.tolist()
        finally:
            conn.close()
