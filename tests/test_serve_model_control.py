"""What a model served by ``pb-tensor serve`` reaches through BLS and ``pb_utils``' model
control: the server's models, as in Triton. A BLS request or ``is_model_ready`` for a model
the server has not loaded gets Triton's ``Request for unknown model`` error (a repository of
its own would load it); ``load_model`` / ``unload_model`` load and unload models for every
client in the explicit control mode and are refused in the others; models of every
``--model-repository`` reach each other; failed calls carry upstream's stub prefix."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_support import needs_serve

pytestmark = needs_serve

# Runs the calls a request's "calls" parameter lists (JSON: [[call, args...], ...]) and
# answers with what each gave: its result, or the text of the exception it raised.
CONTROLLER = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


def _bls(name):
    request = pb_utils.InferenceRequest(
        model_name=name, requested_output_names=["OUT"],
        inputs=[pb_utils.Tensor("IN", np.array([7], dtype=np.int32))])
    response = request.exec()
    if response.has_error():
        return response.error().message()
    return pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy().tolist()


CALLS = {
    "ready": pb_utils.is_model_ready,
    "load": pb_utils.load_model,
    "unload": pb_utils.unload_model,
    "bls": _bls,
    # load_model with files given as text (JSON carries no bytes)
    "load_files": lambda name, config, files: pb_utils.load_model(
        name, config, {k: v.encode() for k, v in files.items()}),
}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            seen = []
            for call, *args in json.loads(json.loads(request.parameters())["calls"]):
                try:
                    seen.append(CALLS[call](*args))
                except pb_utils.TritonModelException as exc:
                    seen.append(str(exc))
            out = np.array([json.dumps(seen).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
'''

CONTROLLER_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

IDENTITY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]
'''

IDENTITY_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

PREFIX = "Failed to process the request for model 'controller_0', message: "
READY = "Failed to check model readiness: " + PREFIX
LOAD = "Failed to load model: " + PREFIX
UNLOAD = "Failed to unload model: " + PREFIX
POLLING = "explicit model load / unload is not allowed if polling is enabled"


def _model(root: Path, name: str, code: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    (root / name / "1" / "model.py").write_text(code)


@pytest.fixture(scope="module")
def repositories(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    first = tmp_path_factory.mktemp("first")
    second = tmp_path_factory.mktemp("second")
    _model(first, "controller", CONTROLLER, CONTROLLER_CONFIG)
    _model(first, "identity", IDENTITY, IDENTITY_CONFIG)
    _model(second, "elsewhere", IDENTITY, IDENTITY_CONFIG)
    return [str(first), str(second)]


def _server(repositories: list[str], mode: str, in_process: bool) -> Any:
    from pb_tensor.serve import Options, Server

    load = ["controller"] if mode == "explicit" else []
    options = Options(repositories, http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, allow_grpc=False, model_control_mode=mode,
                      load_models=load, in_process=in_process)  # fmt: skip
    return Server(options)


def _calls(url: str, *calls: list[Any]) -> list[Any]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    given = httpclient.InferInput("IN", [1], "INT32")
    given.set_data_from_numpy(np.array([0], dtype=np.int32))
    result = client.infer("controller", [given], parameters={"calls": json.dumps(calls)})
    answer: list[Any] = json.loads(result.as_numpy("OUT")[0])
    return answer


@pytest.fixture(params=[True, False], ids=["in_process", "stub"])
def explicit(request: pytest.FixtureRequest, repositories: list[str]) -> Iterator[Any]:
    with _server(repositories, "explicit", request.param) as server:
        yield server


def test_a_model_sees_and_controls_the_servers_models(explicit: Any) -> None:
    import tritonclient.http as httpclient

    url = explicit.http_url
    client = httpclient.InferenceServerClient(url)
    unknown = "Request for unknown model: 'identity' is not found"
    # Not loaded by the server: Triton's errors, where a repository of its own would load it.
    assert _calls(url, ["ready", "identity"], ["bls", "identity"]) == [
        READY + unknown,
        "Model identity - Error when running inference: " + unknown,
    ]
    assert not client.is_model_ready("identity")
    # Loaded by the model: ready for the model and for every client.
    assert _calls(url, ["load", "identity"], ["ready", "identity"], ["ready", "identity", "1"],
                  ["bls", "identity"]) == [None, True, True, [7]]  # fmt: skip
    assert client.is_model_ready("identity")
    index = {m["name"]: m.get("state") for m in client.get_model_repository_index()}
    assert index["identity"] == "READY"
    given = httpclient.InferInput("IN", [2], "INT32")
    given.set_data_from_numpy(np.array([3, 4], dtype=np.int32))
    assert client.infer("identity", [given]).as_numpy("OUT").tolist() == [3, 4]
    # Unloaded by the model: gone for every client; Triton's texts once it had a version.
    assert _calls(url, ["unload", "identity"], ["ready", "identity"], ["bls", "identity"],
                  ["ready", "identity", "x"]) == [
        None,
        READY + "Request for unknown model: 'identity' has no available versions",
        "Model identity - Error when running inference: Request for unknown model: "
        "'identity' has no available versions",
        READY + "failed to get model version from specified version string 'x' (details: "
        "stol), version should be an integral value > 0",
    ]  # fmt: skip
    assert not client.is_model_ready("identity")
    assert _calls(url, ["load", "no_such_model"]) == [
        LOAD + "failed to load 'no_such_model', failed to poll from model repository"
    ]
    # A model of another --model-repository, loaded by a client, reached through BLS.
    client.load_model("elsewhere")
    assert _calls(url, ["bls", "elsewhere"], ["ready", "elsewhere"]) == [[7], True]


def test_a_model_loads_with_a_config_override_and_files(explicit: Any) -> None:
    # pb_utils.load_model's override as upstream's README shows it: the config as JSON, the
    # files under "file:<version>/<name>" keys; a new model made of them, reached by BLS.
    config = json.dumps({
        "backend": "python",
        "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [-1]}],
        "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [-1]}],
    })  # fmt: skip
    url = explicit.http_url
    files = {"file:1/model.py": IDENTITY}
    assert _calls(url, ["load_files", "made_here", config, files], ["bls", "made_here"],
                  ["ready", "made_here", "1"]) == [None, [7], True]
    assert _calls(url, ["load_files", "made_here", "", files]) == [
        LOAD + "Load parameter 'config' must be specified for model file override"]


def test_a_model_may_reload_and_unload_the_model_it_runs_in(explicit: Any,
                                                            repositories: list[str]) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    url = explicit.http_url
    client = httpclient.InferenceServerClient(url)
    # A reload: the new instance serves the next request while the old one (running this
    # request) unloads once it ended. (Triton reloads a loaded model only when its directory
    # changed: unchanged, the load changes nothing.)
    before = explicit.core.model("controller")
    assert _calls(url, ["load", "controller"]) == [None]
    assert explicit.core.model("controller") is before
    now = time.time_ns() + 1_000_000
    os.utime(Path(repositories[0]) / "controller" / "1" / "model.py", ns=(now, now))
    assert _calls(url, ["load", "controller"]) == [None]
    assert explicit.core.model("controller") is not before
    assert _calls(url, ["ready", "controller"]) == [True]
    # Triton's unload does not wait for the requests in flight (this one among them).
    assert _calls(url, ["unload", "controller"], ["ready", "controller"]) == [
        None, READY + "Request for unknown model: 'controller' has no available versions"]
    assert not client.is_model_ready("controller")  # unavailable once the call returned
    with pytest.raises(InferenceServerException, match="has no available versions"):
        _calls(url, ["ready", "controller"])


def test_model_control_from_a_model_needs_the_explicit_mode(repositories: list[str]) -> None:
    with _server(repositories, "none", True) as server:
        url = server.http_url
        assert _calls(url, ["load", "identity"], ["unload", "identity"], ["ready", "identity"],
                      ["bls", "elsewhere"]) == [LOAD + POLLING, UNLOAD + POLLING, True, [7]]


@pytest.mark.parametrize(("text", "version"), [
    ("", -1), ("3", 3), (" 5", 5), ("+2", 2), ("-0", 0), ("12abc", 12), ("1_000", 1),
    ("abc", None), ("\u0663", None), ("99999999999999999999", None), ("-1", -1),
])  # fmt: skip
def test_version_strings_are_read_as_std_stol_reads_them(text: str, version: int | None) -> None:
    # GetModelVersionFromString (server's common.cc, python_backend's model_loader.cc): stol
    # takes leading blanks, a sign and ASCII digits and ignores the rest; the front door and
    # the model-control calls each refuse what stol throws on, and negative versions.
    from pb_tensor.runtime import parse_model_version
    from pb_tensor.serve._core import parse_version
    from pb_tensor.serve._errors import ServeError

    assert parse_model_version(text) == version
    if version is None:
        with pytest.raises(ServeError, match=r"\(details: stol\)"):
            parse_version(text)
    elif version < 0 and text:
        with pytest.raises(ServeError, match="invalid model version specified"):
            parse_version(text)
    else:
        assert parse_version(text) == version
