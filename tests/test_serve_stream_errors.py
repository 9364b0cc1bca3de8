"""Errors on ``ModelStreamInfer`` as Triton's stream handler (``stream_infer_handler.cc``)
sends them: a request refused when it was submitted gets an error holding only its id; a
decoupled model's error response that is not final carries ``triton_final_response: false``
and the responses after it follow; a request whose sender the model let go of gets nothing
more; a stream opened with the ``triton_grpc_error: true`` header ends with the status of the
first error a request meets while it runs (refusals stay in the stream), and its requests
still running are cancelled. HTTP's ``generate_stream`` sends the events after a non-final
error too."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_models import DECOUPLED_CONFIG, STEPS_MODEL, write_model
from serve_support import needs_serve, raw

pytestmark = needs_serve

@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream_errors")
    write_model(root, "steps", STEPS_MODEL, DECOUPLED_CONFIG)
    return root


@pytest.fixture(params=[False, True], ids=["stubs", "in_process"])
def server(request: pytest.FixtureRequest, repository: Path) -> Iterator[Any]:
    from pb_tensor.serve import Options, Server

    options = Options([str(repository)], http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, in_process=request.param)
    with Server(options) as running:
        yield running


def _stream(server: Any, requests: list[Any], metadata: tuple[tuple[str, str], ...] = (),
            ) -> tuple[list[Any], Any]:  # fmt: skip
    """The replies to ``requests`` on one stream (the client half-closes after them), and
    the ``grpc.RpcError`` that ended it (None when it ended well)."""
    import grpc

    from pb_tensor.serve._protos import message

    request_cls = message("ModelInferRequest")
    reply_cls = message("ModelStreamInferResponse")
    replies: list[Any] = []
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                     request_serializer=request_cls.SerializeToString,
                                     response_deserializer=reply_cls.FromString)
        try:
            for reply in call(iter(requests), timeout=30, metadata=metadata):
                replies.append(reply)
        except grpc.RpcError as exc:
            return replies, exc
    return replies, None


def _request(mode: int, request_id: str, dtype: str = "INT32") -> Any:
    from pb_tensor.serve._protos import message

    request = message("ModelInferRequest")(model_name="steps", id=request_id)
    request.inputs.add(name="IN", datatype=dtype, shape=[1])
    request.raw_input_contents.append(
        np.array([mode], np.int32 if dtype == "INT32" else np.int64).tobytes())
    return request


def _final(reply: Any) -> bool:
    return bool(reply.infer_response.parameters["triton_final_response"].bool_param)


def test_responses_after_an_error_response(server: Any) -> None:
    replies, ended = _stream(server, [_request(0, "a")])
    assert ended is None
    assert [(r.error_message, _final(r)) for r in replies] == [
        ("", False), ("bad step", False), ("", False)]
    error = replies[1].infer_response
    assert (error.id, error.model_name, error.model_version) == ("a", "steps", "")
    assert [np.frombuffer(replies[i].infer_response.raw_output_contents[0], np.int32).tolist()
            for i in (0, 2)] == [[1], [2]]  # fmt: skip


def test_a_dropped_sender_sends_nothing_more(server: Any) -> None:
    # Triton deletes the response factory with the sender: no final flag, no error; the
    # stream goes on with its other requests.
    replies, ended = _stream(server, [_request(1, "a"), _request(7, "b")])
    assert ended is None
    assert sorted((r.infer_response.id, r.error_message, _final(r)) for r in replies) == [
        ("a", "", False), ("b", "", True)]


def test_a_refusal_holds_only_the_request_id(server: Any) -> None:
    replies, ended = _stream(server, [_request(7, "a", dtype="INT64"), _request(7, "b")])
    assert ended is None
    refused, answered = replies
    assert refused.error_message == (
        "[request id: a] inference input 'IN' data-type is 'INT64', but model 'steps' expects "
        "'INT32'")
    assert refused.infer_response.id == "a"
    assert refused.infer_response.model_name == ""
    assert dict(refused.infer_response.parameters) == {}
    assert (answered.infer_response.id, _final(answered)) == ("b", True)


def test_triton_grpc_error_ends_the_stream_at_a_model_error(server: Any) -> None:
    import grpc

    header = (("triton_grpc_error", "true"),)
    # A refusal stays in the stream; the model's error response (not final) ends it with its
    # status, and nothing of the request comes after it.
    replies, ended = _stream(server, [_request(7, "r", dtype="INT64"), _request(0, "a")],
                             header)  # fmt: skip
    assert ended is not None
    assert ended.code() is grpc.StatusCode.UNAVAILABLE
    assert ended.details() == "bad step"
    assert [(r.infer_response.id, r.error_message != "") for r in replies] == [
        ("r", True), ("a", False)]
    # Without an error the stream ends well.
    replies, ended = _stream(server, [_request(7, "b")], header)
    assert ended is None
    assert [r.infer_response.id for r in replies] == ["b"]


def test_triton_grpc_error_with_tritonclient(server: Any) -> None:
    import tritonclient.grpc as grpcclient

    results: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put(error or result),
                            headers={"triton_grpc_error": "true"})  # fmt: skip
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([0], np.int32))
        client.async_stream_infer("steps", [tensor])
        assert results.get(timeout=30).as_numpy("OUT").tolist() == [1]
        error = results.get(timeout=30)
        assert str(error.status()) == "StatusCode.UNAVAILABLE"
        assert error.message() == "bad step"
        client.stop_stream()
    assert results.empty()  # the response after the error never came


def test_generate_stream_goes_on_after_an_error(server: Any) -> None:
    def events(mode: int) -> list[Any]:
        status, _, data = raw(server.http_url, "POST", "/v2/models/steps/generate_stream",
                              json.dumps({"IN": [mode]}).encode())
        assert status == 200
        return [json.loads(line[len("data: "):]) for line in data.decode().split("\n\n")
                if line]  # fmt: skip

    assert [e.get("OUT", e.get("error")) for e in events(0)] == [1, "bad step", 2]
    assert [e["OUT"] for e in events(1)] == [1]  # the sender went: the response ends there
