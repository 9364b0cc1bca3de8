"""pb-tensor serve over gRPC, driven by tritonclient.grpc: the unary methods, ModelStreamInfer
for a decoupled model (ids echoed, final flags, errors in-stream), repository control."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from serve_support import EXAMPLES, needs_serve

pytestmark = needs_serve


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from pb_tensor.serve import Options, Server

    options = Options([EXAMPLES], http_port=0, grpc_port=0, metrics_port=0,
                      allow_http=False, allow_metrics=False, model_control_mode="explicit",
                      load_models=["add_sub", "string_identity", "decoupled_repeat"])
    with Server(options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[Any]:
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        yield c


def _add_sub_inputs(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> list[Any]:
    import tritonclient.grpc as grpcclient

    inputs = [grpcclient.InferInput("INPUT0", list(a.shape), "FP32"),
              grpcclient.InferInput("INPUT1", list(b.shape), "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def test_unary_methods(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("add_sub")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "triton"
    assert "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("add_sub", as_json=True)
    assert model["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1"]},
                               {"name": "INPUT1", "datatype": "FP32", "shape": ["-1"]}]
    config = client.get_model_config("string_identity", as_json=True)["config"]
    assert config["input"][0]["data_type"] == "TYPE_STRING"
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["add_sub"]["state"] == "READY"
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        client.get_cuda_shared_memory_status()
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    assert caught.value.message() == (
        "CudaSharedMemoryStatus is not supported by pb-tensor serve")


def test_infer(client: Any) -> None:
    a = np.arange(5, dtype=np.float32)
    result = client.infer("add_sub", _add_sub_inputs(a, a + 1), request_id="g1")
    assert result.get_response().id == "g1"
    assert result.as_numpy("OUTPUT0").tolist() == (2 * a + 1).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == [-1.0] * 5
    import tritonclient.grpc as grpcclient

    text = grpcclient.InferInput("INPUT0", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"x", "é".encode()], dtype=object))
    assert client.infer("string_identity", [text]).as_numpy("OUTPUT0").tolist() == [
        b"x", "é".encode()]


def test_errors(client: Any) -> None:
    from tritonclient.utils import InferenceServerException

    a = np.arange(2, dtype=np.float32)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nope", _add_sub_inputs(a, a))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert caught.value.message() == "Request for unknown model: 'nope' is not found"
    with pytest.raises(InferenceServerException) as caught:
        client.infer("add_sub", _add_sub_inputs(a, a.astype(np.float32)[:1].repeat(3)))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    import tritonclient.grpc as grpcclient

    n = grpcclient.InferInput("N", [1], "INT32")
    n.set_data_from_numpy(np.array([2], dtype=np.int32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("decoupled_repeat", [n])
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    assert caught.value.message() == (
        "ModelInfer RPC doesn't support models with decoupled transaction policy")


def test_stream_decoupled(server: Any) -> None:
    import tritonclient.grpc as grpcclient

    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        n = grpcclient.InferInput("N", [1], "INT32")
        n.set_data_from_numpy(np.array([3], dtype=np.int32))
        client.async_stream_infer("decoupled_repeat", [n], request_id="s1",
                                  enable_empty_final_response=True)
        got = [results.get(timeout=30) for _ in range(4)]
        assert [e for _, e in got] == [None] * 4
        assert [r.get_response().id for r, _ in got] == ["s1"] * 4
        assert [r.as_numpy("OUT").tolist() for r, _ in got[:3]] == [[0], [1], [2]]
        final = [r.get_response().parameters["triton_final_response"].bool_param
                 for r, _ in got]
        assert final == [False, False, False, True]
        assert got[3][0].get_response().outputs == []
        # An error arrives in the stream, which stays open for the next request.
        client.async_stream_infer("nope", [n], request_id="bad")
        result, error = results.get(timeout=30)
        assert result is None
        assert error.message() == "Request for unknown model: 'nope' is not found"
        n.set_data_from_numpy(np.array([1], dtype=np.int32))
        client.async_stream_infer("decoupled_repeat", [n], request_id="s2")
        result, error = results.get(timeout=30)
        assert error is None
        assert result.get_response().id == "s2"
        assert result.as_numpy("OUT").tolist() == [0]
        client.stop_stream()
    assert results.empty()  # no empty final response without enable_empty_final_response


def test_stream_non_decoupled(server: Any) -> None:
    import tritonclient.grpc as grpcclient

    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        a = np.ones(3, dtype=np.float32)
        client.async_stream_infer("add_sub", _add_sub_inputs(a, a), request_id="n1")
        result, error = results.get(timeout=30)
        client.async_stream_infer("add_sub", _add_sub_inputs(a, a[:2]), request_id="n2")
        bad, bad_error = results.get(timeout=30)
        client.stop_stream()
    assert error is None
    assert result.as_numpy("OUTPUT0").tolist() == [2.0, 2.0, 2.0]
    assert result.get_response().parameters["triton_final_response"].bool_param
    assert bad is None  # the model's error response, in the stream
    assert bad_error.message() == (
        "INPUT0 and INPUT1 must have the same shape, got (3,) and (2,)")


def test_repository_control(triton_server: Any) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    server = triton_server(EXAMPLES, model_control_mode="explicit", in_process=True,
                           allow_http=False, allow_metrics=False)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model("add_sub")
        config = client.get_model_config("add_sub", as_json=True)["config"]
        config["max_batch_size"] = 4
        config["input"][0]["dims"] = ["3"]
        config["input"][1]["dims"] = ["3"]
        client.load_model("add_sub", config=json.dumps(config))
        meta = client.get_model_metadata("add_sub", as_json=True)
        assert meta["inputs"][0]["shape"] == ["-1", "3"]
        client.unload_model("add_sub")
        assert not client.is_model_ready("add_sub")
        with pytest.raises(InferenceServerException) as caught:
            client.get_model_config("add_sub")
        assert caught.value.message() == (
            "Request for unknown model: 'add_sub' has no available versions")
        # Load parameters Triton's gRPC front end refuses (tritonclient's load_model sends
        # only valid ones: the requests go through the service's own stub).
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        channel = grpc.insecure_channel(server.grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for key, value, text in [
            ("config", {"bytes_param": b"{}"},
             "invalid value type for load parameter 'config', expected string_param."),
            ("file:1/model.py", {"string_param": "x"},
             "invalid value type for load parameter 'file:1/model.py', expected bytes_param."),
            ("note", {"string_param": "x"}, "unrecognized load parameter 'note'."),
        ]:  # fmt: skip
            request = service_pb2.RepositoryModelLoadRequest(model_name="add_sub")
            for field, given in value.items():
                setattr(request.parameters[key], field, given)
            with pytest.raises(grpc.RpcError) as failed:
                stub.RepositoryModelLoad(request)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert failed.value.details() == text  # type: ignore[attr-defined]
        channel.close()
        assert not client.is_model_ready("add_sub")


_WAITS = '''
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.wait, args=(request,)).start()

    def wait(self, request):
        marker = pb_utils.get_input_tensor_by_name(request, "MARKER").as_numpy()[0]
        sender = request.get_response_sender()
        deadline = time.monotonic() + 20
        while not sender.is_cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(marker.decode(), "w") as f:
            f.write("cancelled" if sender.is_cancelled() else "not cancelled")
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''
_WAITS_CONFIG = """
name: "waits"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "MARKER" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def test_closed_stream_cancels_its_requests(triton_server: Any, tmp_path: Any) -> None:
    import os
    import time

    import tritonclient.grpc as grpcclient

    (tmp_path / "waits" / "1").mkdir(parents=True)
    (tmp_path / "waits" / "config.pbtxt").write_text(_WAITS_CONFIG)
    (tmp_path / "waits" / "1" / "model.py").write_text(_WAITS)
    server = triton_server(str(tmp_path), allow_http=False, allow_metrics=False)
    marker = tmp_path / "marker"
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: None)
        tensor = grpcclient.InferInput("MARKER", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([str(marker).encode()], dtype=object))
        client.async_stream_infer("waits", [tensor])
        time.sleep(0.3)
        assert not marker.exists()  # the model waits for the cancellation
        client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 30
    while not marker.exists() or not os.path.getsize(marker):
        assert time.monotonic() < deadline, "the model did not see the cancellation"
        time.sleep(0.02)
    assert marker.read_text() == "cancelled"


_FINAL_IN_RESPONSE = '''
import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                out = pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == n - 1 else 0
                sender.send(pb_utils.InferenceResponse([out]), flags=flags)
'''
_FINAL_IN_RESPONSE_CONFIG = """
name: "final_in_response"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


@pytest.mark.parametrize("in_process", [False, True], ids=["stubs", "in_process"])
def test_stream_final_flag_on_the_real_response(triton_server: Any, tmp_path: Any,
                                                in_process: bool) -> None:
    """A response sent with the final flag carries triton_final_response=true itself, and
    no empty final follows it even when the request enables empty finals (Triton's stream
    handler sends one only for a flags-only final)."""
    import tritonclient.grpc as grpcclient

    (tmp_path / "final_in_response" / "1").mkdir(parents=True)
    (tmp_path / "final_in_response" / "config.pbtxt").write_text(_FINAL_IN_RESPONSE_CONFIG)
    (tmp_path / "final_in_response" / "1" / "model.py").write_text(_FINAL_IN_RESPONSE)
    server = triton_server(str(tmp_path), allow_http=False, allow_metrics=False,
                           in_process=in_process)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        n = grpcclient.InferInput("N", [1], "INT32")
        n.set_data_from_numpy(np.array([3], dtype=np.int32))
        client.async_stream_infer("final_in_response", [n], request_id="f1",
                                  enable_empty_final_response=True)
        got = [results.get(timeout=30) for _ in range(3)]
        n.set_data_from_numpy(np.array([1], dtype=np.int32))
        client.async_stream_infer("final_in_response", [n], request_id="f2")
        single, single_error = results.get(timeout=30)
        client.stop_stream()
    assert [e for _, e in got] == [None] * 3
    assert [r.as_numpy("OUT").tolist() for r, _ in got] == [[0], [1], [2]]
    assert [r.get_response().parameters["triton_final_response"].bool_param
            for r, _ in got] == [False, False, True]
    assert single_error is None
    assert single.get_response().id == "f2"
    assert single.get_response().parameters["triton_final_response"].bool_param
    assert results.empty()  # no empty final after a response that carried the flag


_SLOW_ECHO = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.5)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
'''
_SLOW_ECHO_CONFIG = """
name: "slow_echo"
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def test_stream_answers_non_decoupled_requests_in_request_order(
        triton_server: Any, tmp_path: Any) -> None:
    """Triton's stream handler queues non-decoupled requests (and those refused before they
    ran) and writes their responses in the order the requests came: a fast request behind a
    slow one on another model waits for it."""
    import shutil

    import tritonclient.grpc as grpcclient

    (tmp_path / "slow_echo" / "1").mkdir(parents=True)
    (tmp_path / "slow_echo" / "config.pbtxt").write_text(_SLOW_ECHO_CONFIG)
    (tmp_path / "slow_echo" / "1" / "model.py").write_text(_SLOW_ECHO)
    shutil.copytree(f"{EXAMPLES}/add_sub", tmp_path / "add_sub")
    server = triton_server(str(tmp_path), allow_http=False, allow_metrics=False,
                           in_process=True)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        x = grpcclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([7], dtype=np.int32))
        client.async_stream_infer("slow_echo", [x], request_id="slow")
        a = np.ones(2, dtype=np.float32)
        client.async_stream_infer("add_sub", _add_sub_inputs(a, a), request_id="fast")
        client.async_stream_infer("nope", [x], request_id="unknown")
        got = [results.get(timeout=30) for _ in range(3)]
        client.stop_stream()
    first, second, third = got
    assert first[1] is None
    assert first[0].get_response().id == "slow"
    assert first[0].as_numpy("Y").tolist() == [7]
    assert second[1] is None
    assert second[0].get_response().id == "fast"
    assert second[0].as_numpy("OUTPUT0").tolist() == [2.0, 2.0]
    assert third[0] is None
    assert third[1].message() == "Request for unknown model: 'nope' is not found"


def test_stream_error_fields_as_triton_sets_them(server: Any) -> None:
    """A request refused before it runs (unknown model, bad input) gets an error whose
    response holds only the request id; one whose model failed also names the model and
    carries ``triton_final_response`` (Triton's stream_infer_handler.cc)."""
    import grpc

    from pb_tensor.serve._protos import message

    request_cls = message("ModelInferRequest")
    reply_cls = message("ModelStreamInferResponse")
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                     request_serializer=request_cls.SerializeToString,
                                     response_deserializer=reply_cls.FromString)
        unknown = request_cls(model_name="nope", id="r1")
        failing = request_cls(model_name="add_sub", id="r2")
        for i, n in ((0, 3), (1, 2)):  # shapes differ: the model's own error response
            failing.inputs.add(name=f"INPUT{i}", datatype="FP32", shape=[n])
            failing.raw_input_contents.append(np.zeros(n, np.float32).tobytes())
        replies = list(call(iter([unknown, failing]), timeout=30))
    refused, failed = replies
    assert refused.error_message == "Request for unknown model: 'nope' is not found"
    assert refused.infer_response.id == "r1"
    assert refused.infer_response.model_name == ""
    assert dict(refused.infer_response.parameters) == {}
    assert failed.error_message == (
        "INPUT0 and INPUT1 must have the same shape, got (3,) and (2,)")
    assert failed.infer_response.id == "r2"
    assert failed.infer_response.model_name == "add_sub"
    assert failed.infer_response.parameters["triton_final_response"].bool_param
