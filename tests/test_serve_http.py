"""pb-tensor serve over HTTP, driven by tritonclient.http and raw requests: health, metadata,
configuration, inference (JSON and binary data, BYTES, compression), errors as Triton's."""

from __future__ import annotations

import gzip
import json
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from serve_support import EXAMPLES, add_sub_json, error_of, needs_serve, params_echo, raw

pytestmark = needs_serve

MODELS = ["add_sub", "string_identity", "decoupled_repeat"]


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from pb_tensor.serve import Options, Server

    options = Options([EXAMPLES], http_port=0, grpc_port=0, metrics_port=0,
                      model_control_mode="explicit", load_models=MODELS)
    with Server(options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[Any]:
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(server.http_url) as c:
        yield c


def test_health_and_server_metadata(client: Any, server: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "triton"
    assert meta["extensions"] == [
        "model_repository", "system_shared_memory", "model_configuration",
        "binary_tensor_data", "parameters", "statistics", "logging"]
    assert raw(server.http_url, "GET", "/v2/health/live")[0] == 200
    assert raw(server.http_url, "POST", "/v2/health/live")[0] == 405
    assert raw(server.http_url, "GET", "/v2/nothing") == (
        404, raw(server.http_url, "GET", "/v2/nothing")[1], b'{"error":"Not Found"}')


def test_extensions_not_served_say_so(server: Any) -> None:
    for path, what in (("/v2/cudasharedmemory/status", "the CUDA shared memory extension"),
                       ("/v2/trace/setting", "the trace extension")):
        status, _, data = raw(server.http_url, "GET", path)
        assert (status, json.loads(data)) == (
            501, {"error": f"{what} is not supported by pb-tensor serve"})


def test_model_ready_metadata_config(client: Any, server: Any) -> None:
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "2")
    assert not client.is_model_ready("nope")
    assert client.get_model_metadata("add_sub") == {
        "name": "add_sub", "versions": ["1"], "platform": "python",
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1]},
                   {"name": "INPUT1", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1]},
                    {"name": "OUTPUT1", "datatype": "FP32", "shape": [-1]}],
    }  # fmt: skip
    config = client.get_model_config("string_identity")
    assert config["name"] == "string_identity"
    assert config["input"][0]["data_type"] == "TYPE_STRING"
    assert config["max_batch_size"] == 0  # int64 fields as JSON numbers
    assert isinstance(config["input"][0]["dims"][0], int)
    status, body = error_of(server.http_url, "/v2/models/add_sub/versions/3/infer",
                            json.dumps(add_sub_json()).encode())
    assert (status, body) == (404, "Request for unknown model: 'add_sub' version 3 is not found")


def test_infer_json_and_binary(client: Any) -> None:
    import tritonclient.http as httpclient

    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 0.5, dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [4], "FP32"),
              httpclient.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(a)                       # binary
    inputs[1].set_data_from_numpy(b, binary_data=False)    # JSON
    outputs = [httpclient.InferRequestedOutput("OUTPUT0"),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = client.infer("add_sub", inputs, outputs=outputs, request_id="r1")
    response = result.get_response()
    assert response["id"] == "r1"
    assert response["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert response["outputs"][1]["data"] == [-0.5, 0.5, 1.5, 2.5]
    assert result.as_numpy("OUTPUT0").tolist() == [0.5, 1.5, 2.5, 3.5]
    assert result.as_numpy("OUTPUT1").tolist() == [-0.5, 0.5, 1.5, 2.5]
    # No outputs named: tritonclient asks for every output in binary.
    every = client.infer("add_sub", inputs)
    assert every.as_numpy("OUTPUT1").tolist() == [-0.5, 0.5, 1.5, 2.5]
    assert "id" not in every.get_response()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compression(client: Any, server: Any, algorithm: str) -> None:
    import tritonclient.http as httpclient

    a = np.arange(6, dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [6], "FP32"),
              httpclient.InferInput("INPUT1", [6], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    result = client.infer("add_sub", inputs, request_compression_algorithm=algorithm,
                          response_compression_algorithm=algorithm)
    assert result.as_numpy("OUTPUT0").tolist() == (2 * a).tolist()
    body = json.dumps(add_sub_json()).encode()
    packed = gzip.compress(body) if algorithm == "gzip" else zlib.compress(body)
    status, headers, data = raw(server.http_url, "POST", "/v2/models/add_sub/infer", packed,
                                {"Content-Encoding": algorithm, "Accept-Encoding": algorithm})
    assert status == 200
    assert headers["content-encoding"] == algorithm
    unpacked = gzip.decompress(data) if algorithm == "gzip" else zlib.decompress(data)
    assert json.loads(unpacked)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]


def test_unsupported_compression(server: Any) -> None:
    status, headers, data = raw(server.http_url, "POST", "/v2/models/add_sub/infer", b"{}",
                                {"Content-Encoding": "br"})
    assert (status, json.loads(data)) == (501, {"error": "Unsupported compression type"})
    assert headers["accept-encoding"] == "gzip, deflate"


def test_bytes_tensors(client: Any) -> None:
    import tritonclient.http as httpclient

    values = np.array([b"ab", "cé".encode(), b""], dtype=object)
    for binary in (True, False):
        tensor = httpclient.InferInput("INPUT0", [3], "BYTES")
        tensor.set_data_from_numpy(values, binary_data=binary)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
        result = client.infer("string_identity", [tensor], outputs=[out])
        expected = [b"ab", "cé".encode(), b""] if binary else ["ab", "cé", ""]
        assert result.as_numpy("OUTPUT0").tolist() == expected


def test_errors_are_tritons(client: Any, server: Any) -> None:
    from tritonclient.utils import InferenceServerException

    body = json.dumps(add_sub_json()).encode()
    assert error_of(server.http_url, "/v2/models/nope/infer", body) == (
        400, "Request for unknown model: 'nope' is not found")
    assert error_of(server.http_url, "/v2/models/decoupled_repeat/infer", body) == (
        501, "HTTP end point doesn't support models with decoupled transaction policy")
    one = add_sub_json()
    one["inputs"] = one["inputs"][:1]
    status, text = error_of(server.http_url, "/v2/models/add_sub/infer",
                            json.dumps(one).encode())
    assert status == 400
    assert text == (
        "[request id: <id_unknown>] expected 2 inputs but got 1 inputs for model 'add_sub'. "
        "Got input(s) ['INPUT0'], but missing required input(s) ['INPUT1']. Please provide "
        "all required input(s).")
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("nope")
    assert caught.value.message() == "Request for unknown model: 'nope' is not found"
    assert caught.value.status() == "400"


def test_repository_index(client: Any) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["add_sub"] == {"name": "add_sub", "version": "1", "state": "READY"}
    assert index["bls_add_sub"] == {"name": "bls_add_sub"}
    assert {m["name"] for m in client.get_model_repository_index()} >= set(MODELS)


def test_fixture_load_override_and_unload(triton_server: Any) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    server = triton_server(EXAMPLES, model_control_mode="explicit", in_process=True)
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert not client.is_model_ready("add_sub")
        client.load_model("add_sub")
        assert client.is_model_ready("add_sub")
        config = client.get_model_config("add_sub")
        config["parameters"] = {"note": {"string_value": "overridden"}}
        with open(f"{EXAMPLES}/add_sub/1/model.py", "rb") as f:
            model_py = f.read()
        client.load_model("add_sub", config=json.dumps(config),
                          files={"file:1/model.py": model_py})
        assert client.get_model_config("add_sub")["parameters"] == {
            "note": {"string_value": "overridden"}}
        client.unload_model("add_sub")
        assert not client.is_model_ready("add_sub")
        # The unload returned once it started (as Triton's): UNLOADING until finalize ran.
        deadline = time.monotonic() + 30
        while True:
            index = {m["name"]: m for m in client.get_model_repository_index()}
            if index["add_sub"]["state"] != "UNLOADING" or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert index["add_sub"] == {"name": "add_sub", "version": "1", "state": "UNAVAILABLE",
                                    "reason": "unloaded"}
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("no_such_model")
        assert caught.value.message() == (
            "failed to load 'no_such_model', failed to poll from model repository")


@pytest.mark.parametrize(("parameters", "status", "message"), [
    ({"config": 3}, 500, "attempt to access JSON non-string as string"),
    ({"file:1/model.py": True}, 500, "attempt to access JSON non-string as string"),
    ({"note": "x"}, 500, "unexpected error on creating Triton parameter"),
    ({"unload_dependents": "yes"}, 500, "unexpected error on creating Triton parameter"),
])  # fmt: skip
def test_load_parameters_triton_refuses(triton_server: Any, parameters: dict[str, Any],
                                        status: int, message: str) -> None:
    # Triton's HTTP front end reads every load parameter as a string and makes only "config"
    # and "file:..." ones load parameters: anything else fails the load, as here.
    server = triton_server(EXAMPLES, model_control_mode="explicit", in_process=True,
                           allow_grpc=False)
    body = json.dumps({"parameters": parameters}).encode()
    assert error_of(server.http_url, "/v2/repository/models/add_sub/load", body) == (
        status, message)
    code, _, _ = raw(server.http_url, "GET", "/v2/models/add_sub/ready")
    assert code == 400  # nothing was loaded


_WRITES = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            x += 1  # a model may write into its inputs, as into Triton's copy
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
'''
_WRITES_CONFIG = """
name: "writes"
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""


@pytest.mark.parametrize("in_process", [True, False])
def test_models_may_write_into_inputs(triton_server: Any, tmp_path: Any,
                                      in_process: bool) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    (tmp_path / "writes" / "1").mkdir(parents=True)
    (tmp_path / "writes" / "config.pbtxt").write_text(_WRITES_CONFIG)
    (tmp_path / "writes" / "1" / "model.py").write_text(_WRITES)
    server = triton_server(str(tmp_path), in_process=in_process, allow_metrics=False)
    x = np.arange(3, dtype=np.int32)
    for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
        with module.InferenceServerClient(url) as client:
            tensor = module.InferInput("X", [3], "INT32")
            tensor.set_data_from_numpy(x)
            assert client.infer("writes", [tensor]).as_numpy("Y").tolist() == [1, 2, 3]
    assert x.tolist() == [0, 1, 2]


def test_generate_and_generate_stream(server: Any) -> None:
    status, headers, data = raw(server.http_url, "POST", "/v2/models/add_sub/generate",
                                json.dumps({"INPUT0": [1.0, 2.0], "INPUT1": [0.5, 0.5]}).encode())
    assert status == 200
    assert json.loads(data) == {"model_name": "add_sub", "model_version": "1",
                                "OUTPUT0": [1.5, 2.5], "OUTPUT1": [0.5, 1.5]}
    status, _, data = raw(server.http_url, "POST", "/v2/models/string_identity/generate",
                          json.dumps({"INPUT0": "one"}).encode())
    assert json.loads(data)["OUTPUT0"] == "one"  # a single element comes back as a scalar
    status, headers, data = raw(server.http_url, "POST",
                                "/v2/models/decoupled_repeat/generate_stream",
                                json.dumps({"N": 3}).encode())
    assert status == 200
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    events = [json.loads(line[len("data: "):]) for line in data.decode().split("\n\n") if line]
    assert [e["OUT"] for e in events] == [0, 1, 2]
    assert events[0]["model_name"] == "decoupled_repeat"
    assert error_of(server.http_url, "/v2/models/add_sub/generate",
                    json.dumps({"INPUT0": [1.0]}).encode()) == (
        400, "[request id: <id_unknown>] expected 2 inputs but got 1 inputs for model "
             "'add_sub'. Got input(s) ['INPUT0'], but missing required input(s) ['INPUT1']. "
             "Please provide all required input(s).")
    assert error_of(server.http_url, "/v2/models/decoupled_repeat/generate_stream",
                    json.dumps({"N": [1, 2]}).encode()) == (
        400, "The schema can not convert input 'N' to tensor with proper shape")


def test_generate_on_a_decoupled_model(server: Any) -> None:
    """Triton's ``generate`` takes a decoupled model that sends exactly one response; for
    any other count the status is the first response's (200) and the body Triton's error."""
    path = "/v2/models/decoupled_repeat/generate"
    status, headers, data = raw(server.http_url, "POST", path, json.dumps({"N": 1}).encode())
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert json.loads(data) == {"model_name": "decoupled_repeat", "model_version": "1",
                                "OUT": 0}
    not_one = ("generate expects model to produce exactly 1 response, use generate stream "
               "for model that generates various number of responses")
    for n in (3, 0):  # three responses; only the final flag
        status, _, data = raw(server.http_url, "POST", path, json.dumps({"N": n}).encode())
        assert (status, json.loads(data)) == (200, {"error": not_one})


def test_strict_model_config_refuses_a_model_without_config(triton_server: Any) -> None:
    import tritonclient.http as httpclient

    server = triton_server(EXAMPLES, model_control_mode="explicit", in_process=True,
                           load_models=["auto_complete", "add_sub"], exit_on_error=False,
                           strict_model_config=True, allow_grpc=False, allow_metrics=False)
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert client.is_model_ready("add_sub")
        assert not client.is_model_ready("auto_complete")
        index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["auto_complete"]["state"] == "UNAVAILABLE"
    assert index["auto_complete"]["reason"].startswith("no ")
    assert index["auto_complete"]["reason"].endswith(
        "auto_complete/config.pbtxt (strict model config)")


def test_load_override_file_paths_as_core_joins_them(triton_server: Any) -> None:
    # Core's JoinPath appends "/1/model.py" to the model directory (not an absolute path);
    # a path that leaves the directory is refused with core's text.
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    server = triton_server(EXAMPLES, model_control_mode="explicit", in_process=True,
                           allow_grpc=False)
    with open(f"{EXAMPLES}/add_sub/1/model.py", "rb") as f:
        model_py = f.read()
    with httpclient.InferenceServerClient(server.http_url) as client:
        client.load_model("add_sub")
        config = json.dumps(client.get_model_config("add_sub"))
        client.load_model("add_sub", config=config, files={"file:/1/model.py": model_py})
        assert client.is_model_ready("add_sub")
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("add_sub", config=config,
                              files={"file:1/../../escape.py": model_py})  # fmt: skip
        message = caught.value.message()
        assert message.startswith("failed to load 'add_sub': Invalid file parameter "
                                  "'file:1/../../escape.py' with normalized path '")
        assert message.endswith("escape.py' must stay within model directory.")


@pytest.mark.parametrize("in_process", [False, True], ids=["stubs", "in_process"])
def test_a_model_name_python_backend_refuses(triton_server: Any, in_process: bool) -> None:
    # python_backend refuses to start a stub whose name holds a shell character.
    import base64

    server = triton_server(EXAMPLES, model_control_mode="explicit", in_process=in_process,
                           allow_grpc=False)
    with open(f"{EXAMPLES}/add_sub/1/model.py", "rb") as f:
        model_py = base64.b64encode(f.read()).decode()
    config = {"name": "a;b", "backend": "python",
              "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                        {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]}],
              "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                         {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [4]}]}
    body = json.dumps({"parameters": {"config": json.dumps(config),
                                      "file:1/model.py": model_py}}).encode()
    status, message = error_of(server.http_url, "/v2/repository/models/a;b/load", body)
    assert status == 400
    assert message == ("load failed for model 'a;b': version 1 is at UNAVAILABLE state: "
                       "Invalid argument: Invalid stub name: contains invalid characters;\n")


@pytest.mark.parametrize("in_process", [False, True], ids=["stubs", "in_process"])
def test_double_parameters_reach_the_model(triton_server: Any, tmp_path: Any,
                                           in_process: bool) -> None:  # fmt: skip
    # Triton takes a JSON number that is not an integer (HTTP) and double_param (gRPC) as a
    # double parameter since 24.02; python_backend puts it in request.parameters().
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    params_echo(tmp_path)
    server = triton_server(str(tmp_path), in_process=in_process, allow_metrics=False)
    for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
        with module.InferenceServerClient(url) as client:
            tensor = module.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([1], np.int32))
            result = client.infer("echo", [tensor], parameters={"ratio": 0.25, "n": 3})
            got = json.loads(result.as_numpy("OUT")[0])
            assert got == {"ratio": 0.25, "n": 3}
            assert type(got["ratio"]) is float


def test_a_failed_load_in_cores_words(triton_server: Any, tmp_path: Any) -> None:
    # core's ModelLifeCycle: the load request's error names the version's state and its
    # reason (python_backend's INTERNAL status and the model's error); the index row holds
    # the reason.
    import shutil

    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    from upstream_models import PYTHON_MODELS

    (tmp_path / "init_error" / "1").mkdir(parents=True)
    shutil.copy(PYTHON_MODELS / "init_error" / "model.py", tmp_path / "init_error" / "1")
    shutil.copy(PYTHON_MODELS / "init_error" / "config.pbtxt", tmp_path / "init_error")
    server = triton_server(str(tmp_path), model_control_mode="explicit", allow_grpc=False,
                           allow_metrics=False)  # fmt: skip
    path = tmp_path / "init_error" / "1" / "model.py"
    reason = (f"Internal: NameError: name 'lorem_ipsum' is not defined\n\nAt:\n  {path}(33): "
              "initialize\n")
    with httpclient.InferenceServerClient(server.http_url) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("init_error")
        assert caught.value.message() == (
            f"load failed for model 'init_error': version 1 is at UNAVAILABLE state: {reason};\n")
        assert client.get_model_repository_index() == [
            {"name": "init_error", "version": "1", "state": "UNAVAILABLE", "reason": reason}]


def test_an_ensemble_on_a_model_that_fails_to_load_quotes_its_status(
    triton_server: Any, tmp_path: Any,
) -> None:
    # core's CheckNode: "... which has no loaded version. Model 'm' loading failed with
    # error: <the composing model's load status>".
    import tritonclient.http as httpclient
    from runtime_models import ensemble, step
    from tritonclient.utils import InferenceServerException

    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n"
        "        raise ValueError('no')\n")  # fmt: skip
    (tmp_path / "broken" / "config.pbtxt").write_text(
        'backend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]\n')
    (tmp_path / "e" / "1").mkdir(parents=True)
    (tmp_path / "e" / "config.pbtxt").write_text(
        ensemble([step("broken", {"IN": "IN"}, {"OUT": "OUT"})]))
    server = triton_server(str(tmp_path), model_control_mode="explicit", allow_grpc=False,
                           allow_metrics=False)  # fmt: skip
    with httpclient.InferenceServerClient(server.http_url) as client, \
            pytest.raises(InferenceServerException) as caught:  # fmt: skip
        client.load_model("e")
    message = caught.value.message()
    assert ("ensemble 'e' depends on 'broken' which has no loaded version. Model 'broken' "
            "loading failed with error: version 1 is at UNAVAILABLE state: Internal: "
            "ValueError: no\n") in message, message
