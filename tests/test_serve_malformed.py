"""Malformed requests get a 4xx with Triton's error body and the server keeps serving; a
client that goes away cancels its request (the model sees ``is_cancelled()``)."""

from __future__ import annotations

import json
import os
import socket
import struct
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from serve_support import EXAMPLES, add_sub_json, error_of, needs_serve, raw

pytestmark = needs_serve

LIMIT = 1 << 20  # --http-max-input-size of the server under test
PATH = "/v2/models/add_sub/infer"


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from pb_tensor.serve import Options, Server

    options = Options([EXAMPLES], http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, model_control_mode="explicit",
                      load_models=["add_sub", "string_identity"], max_input_size=LIMIT)
    with Server(options) as running:
        yield running


def _binary(header: dict[str, Any], blob: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + blob, {"Inference-Header-Content-Length": str(len(head))}


def _one_binary_input(shape: list[int], size: int, datatype: str = "FP32") -> dict[str, Any]:
    return {"inputs": [
        {"name": "INPUT0", "datatype": datatype, "shape": shape,
         "parameters": {"binary_data_size": size}},
        {"name": "INPUT1", "datatype": "FP32", "shape": [1], "data": [1.0]},
    ]}  # fmt: skip


def test_bytes_that_are_not_utf8_pass_through(server: Any) -> None:
    """rapidjson, Triton's parser, does not validate UTF-8 inside strings: neither does this."""
    body = (b'{"id": "\xff", "inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1], '
            b'"data": ["a\xfe"]}], "outputs": [{"name": "OUTPUT0", "parameters": '
            b'{"binary_data": true}}]}')
    status, headers, data = raw(server.http_url, "POST",
                                "/v2/models/string_identity/infer", body)
    assert status == 200
    head = int(headers["inference-header-content-length"])
    assert data[head:] == struct.pack("<I", 2) + b"a\xfe"


def _still_serving(url: str) -> None:
    status, _, data = raw(url, "POST", PATH, json.dumps(add_sub_json([1.0])).encode())
    assert status == 200
    assert json.loads(data)["outputs"][0]["data"] == [2.0]


def _cases() -> list[tuple[str, bytes, dict[str, str], str]]:
    floats = np.arange(4, dtype=np.float32).tobytes()
    body, headers = _binary(_one_binary_input([4], 16), floats)
    past_body, past_headers = _binary(_one_binary_input([4], 32), floats)
    wrong_count, wrong_headers = _binary(_one_binary_input([5], 16), floats)
    extra, extra_headers = _binary(_one_binary_input([4], 16), floats + b"xx")
    nested = add_sub_json([1.0, 2.0])
    nested["inputs"][0]["shape"] = [3]
    negative = add_sub_json([1.0])
    negative["inputs"][0]["shape"] = [-1]
    huge = add_sub_json([1.0])
    huge["inputs"][0]["shape"] = [2**40]
    overflow = add_sub_json([1.0])
    overflow["inputs"][0]["shape"] = [2**62, 8]
    unknown = add_sub_json([1.0])
    unknown["inputs"][0]["datatype"] = "FP128"
    strings = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [2],
                           "parameters": {"binary_data_size": 6}}]}
    strings_body, strings_headers = _binary(strings, struct.pack("<I", 2) + b"ab")
    return [
        ("json", b'{"inputs": [', {}, "failed to parse the request JSON buffer: Invalid "
         "value. at 12"),
        ("empty", b"", {}, "failed to parse the request JSON buffer: The document is empty. "
         "at 0"),
        ("not utf8", b'{"inputs": \xff}', {}, "failed to parse the request JSON buffer: "
         "Invalid value. at 11"),
        ("header past body", body, {"Inference-Header-Content-Length": str(len(body) + 1)},
         f"inference header size should be in range (0, {len(body)}), got: {len(body) + 1}"),
        ("header not a number", body, {"Inference-Header-Content-Length": "ab"},
         "Unable to parse Inference-Header-Content-Length, got: ab"),
        ("binary past body", past_body, past_headers, "unexpected size for input 'INPUT0', "
         "expecting 16 additional bytes for model 'add_sub'"),
        ("binary without header", body, {}, "failed to parse the request JSON buffer: The "
         "document root must not be followed by other values. at " + headers[
             "Inference-Header-Content-Length"]),
        ("binary count", wrong_count, wrong_headers, "[request id: <id_unknown>] input byte "
         "size mismatch for input 'INPUT0' for model 'add_sub'. Expected 20, got 16"),
        ("left over", extra, extra_headers, "unexpected additional input data for model "
         "'add_sub'"),
        ("json count", json.dumps(nested).encode(), {}, "Failed to parse 'data' field: shape "
         "does not match true shape"),
        ("negative dim", json.dumps(negative).encode(), {}, "Unable to parse 'shape': attempt "
         "to access JSON non-unsigned-integer as unsigned-integer"),
        ("enormous dim", json.dumps(huge).encode(), {}, "JSON input 'INPUT0' has a byte_size "
         f"({4 * 2**40} bytes) that exceeds the maximum allowed value of {LIMIT} bytes. Use "
         "--http-max-input-size to increase the limit."),
        ("element overflow", json.dumps(overflow).encode(), {}, "invalid shape for input "
         "'INPUT0': shape [4611686018427387904,8] causes total element count to exceed "
         "maximum size of 9223372036854775807"),
        ("datatype", json.dumps(unknown).encode(), {}, "invalid datatype for input INPUT0"),
        ("bytes elements", strings_body, strings_headers, "[request id: <id_unknown>] expected "
         "2 string elements for inference input 'INPUT0' for model 'add_sub', got 1"),
        ("oversized", b" " * (LIMIT + 1), {}, f"request JSON size of {LIMIT + 1} bytes exceeds "
         f"the maximum allowed input size of {LIMIT} bytes. Use --http-max-input-size to "
         "increase the limit."),
        ("reserved parameter", json.dumps({**add_sub_json(), "parameters": {
            "triton_x": 1}}).encode(), {}, "parameter keys starting with 'triton_' are "
         "reserved for Triton usage and should not be specified."),
    ]


@pytest.mark.parametrize(("body", "headers", "message"),
                         [c[1:] for c in _cases()], ids=[c[0] for c in _cases()])
def test_malformed_request(server: Any, body: bytes, headers: dict[str, str],
                           message: str) -> None:
    assert error_of(server.http_url, PATH, body, headers) == (400, message)
    _still_serving(server.http_url)


_SLOW = textwrap.dedent('''
    import os
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                marker = pb_utils.get_input_tensor_by_name(request, "MARKER").as_numpy()[0]
                deadline = time.monotonic() + 20
                while not request.is_cancelled() and time.monotonic() < deadline:
                    time.sleep(0.01)
                with open(marker.decode(), "w") as f:
                    f.write("cancelled" if request.is_cancelled() else "not cancelled")
                out = pb_utils.Tensor("OUT", np.zeros(1, dtype=np.int32))
                responses.append(pb_utils.InferenceResponse([out]))
            return responses
''')
_SLOW_CONFIG = """
name: "slow"
backend: "python"
input [ { name: "MARKER" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def _wait_for(path: str) -> str:
    deadline = time.monotonic() + 30
    while not os.path.exists(path) or not os.path.getsize(path):
        assert time.monotonic() < deadline, "the model did not finish the request"
        time.sleep(0.02)
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_disconnect_cancels_request(triton_server: Any, tmp_path: Any) -> None:
    (tmp_path / "slow" / "1").mkdir(parents=True)
    (tmp_path / "slow" / "config.pbtxt").write_text(_SLOW_CONFIG)
    (tmp_path / "slow" / "1" / "model.py").write_text(_SLOW)
    server = triton_server(str(tmp_path), allow_metrics=False)
    marker = str(tmp_path / "marker")
    body = json.dumps({"inputs": [{"name": "MARKER", "datatype": "BYTES", "shape": [1],
                                   "data": [marker]}]}).encode()
    _send_and_leave(server.http_url, body)
    assert _wait_for(marker) == "cancelled"
    # The instance is free again: the next request runs, and is cancelled the same way.
    second = str(tmp_path / "marker2")
    _send_and_leave(server.http_url, body.replace(marker.encode(), second.encode()))
    assert _wait_for(second) == "cancelled"
    # A gRPC call that runs past its deadline is cancelled the same way.
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    third = str(tmp_path / "marker3")
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("MARKER", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([third.encode()], dtype=object))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("slow", [tensor], client_timeout=0.5)
        assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert _wait_for(third) == "cancelled"


def _send_and_leave(url: str, body: bytes) -> None:
    host, port = url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)  # the request reaches the model


_CRASHES = '''
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] < 0:
                os._exit(3)  # the stub dies with the request in flight
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses
'''
_CRASHES_CONFIG = """
name: "crashes"
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""


def test_stub_crash_fails_only_its_request(triton_server: Any, tmp_path: Any) -> None:
    (tmp_path / "crashes" / "1").mkdir(parents=True)
    (tmp_path / "crashes" / "config.pbtxt").write_text(_CRASHES_CONFIG)
    (tmp_path / "crashes" / "1" / "model.py").write_text(_CRASHES)
    server = triton_server(str(tmp_path), allow_grpc=False, allow_metrics=False)
    path = "/v2/models/crashes/infer"

    def body(value: int) -> bytes:
        return json.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [1],
                                       "data": [value]}]}).encode()

    status, _, data = raw(server.http_url, "POST", path, body(-1))
    assert (status, json.loads(data)) == (500, {"error": (
        "Failed to process the request(s) for model instance 'crashes_0', message: Stub "
        "process 'crashes_0' is not healthy. It exited with code 3.")})
    status, _, data = raw(server.http_url, "POST", path, body(21))  # the stub is restarted
    assert status == 200
    assert json.loads(data)["outputs"][0]["data"] == [42]


def test_concurrent_clients_get_their_own_results(server: Any) -> None:
    """8 clients at once, HTTP and gRPC mixed: every response matches its request."""
    import threading

    import tritonclient.grpc as grpcclient

    failures: list[str] = []

    def http_client(k: int) -> None:
        for i in range(20):
            values = [float(k * 100 + i), float(i)]
            status, _, data = raw(server.http_url, "POST", PATH,
                                  json.dumps(add_sub_json(values)).encode())
            if status != 200 or json.loads(data)["outputs"][0]["data"] != [
                    2 * v for v in values]:
                failures.append(f"http {k} {i}: {status} {data[:200]!r}")

    def grpc_client(k: int) -> None:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            for i in range(20):
                a = np.array([k * 100 + i, i], dtype=np.float32)
                inputs = [grpcclient.InferInput("INPUT0", [2], "FP32"),
                          grpcclient.InferInput("INPUT1", [2], "FP32")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(a)
                out = client.infer("add_sub", inputs).as_numpy("OUTPUT0")
                if out.tolist() != (2 * a).tolist():
                    failures.append(f"grpc {k} {i}: {out}")

    threads = [threading.Thread(target=http_client if k % 2 else grpc_client, args=(k,))
               for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert failures == []
