"""The server's readiness as tritonserver's (``InferenceServer::IsReady``): with
``--strict-readiness`` (the default) the server is ready only while every model it tried to
load is ready (a model that failed to load, one whose ``is_ready()`` says no, one whose stub
died: not ready; one that was unloaded after it loaded does not count), over HTTP
(``/v2/health/ready``) and gRPC (``ServerReady``); ``--strict-readiness=false`` reports ready
once started."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from serve_support import needs_serve, raw

pytestmark = needs_serve

_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

_FLAKY = """
import os
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.flag = os.path.join(args["model_repository"], "not_ready")
    def is_ready(self):
        return not os.path.exists(self.flag)
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""


def _repository(root: Path) -> Path:
    for name, code in (("flaky", _FLAKY), ("broken", "raise ImportError('no such model')\n")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(textwrap.dedent(code))
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n{_CONFIG}')
    return root


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return _repository(tmp_path)


def _server(repo: Path, **options: Any) -> Any:
    from pb_tensor.serve import Options, Server

    return Server(Options([str(repo)], http_port=0, grpc_port=0, metrics_port=0,
                          exit_on_error=False, model_control_mode="explicit",
                          load_models=["*"], **options))  # fmt: skip


def _ready(server: Any) -> tuple[bool, bool]:
    """(HTTP's answer, gRPC's answer)."""
    import tritonclient.grpc as grpcclient

    status = raw(server.http_url, "GET", "/v2/health/ready")[0]
    assert status in (200, 400)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        return status == 200, bool(client.is_server_ready())


@pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "isolated"])
def test_strict_readiness_follows_every_model(repo: Path, in_process: bool) -> None:
    import tritonclient.http as httpclient

    with _server(repo, in_process=in_process) as server:
        # "broken" failed to load (the server goes on: exit_on_error off): not ready
        assert _ready(server) == (False, False)
        with httpclient.InferenceServerClient(server.http_url) as client:
            assert client.is_model_ready("flaky")
            # Unloading a model that failed to load leaves its failure (core unloads only
            # READY versions): still not ready; loaded once it is fixed, ready.
            client.unload_model("broken")
            assert _ready(server) == (False, False)
            (repo / "broken" / "1" / "model.py").write_text(textwrap.dedent(_FLAKY))
            client.load_model("broken")
            assert _ready(server) == (True, True)
            client.unload_model("broken")  # an unloaded model does not count (once the
            _until_ready(server)  # unloading in the background ended: UNLOADING is not ready)
            (repo / "flaky" / "not_ready").write_text("")  # flaky's is_ready() says no
            assert not client.is_model_ready("flaky")
            assert _ready(server) == (False, False)
            (repo / "flaky" / "not_ready").unlink()
            assert _ready(server) == (True, True)
            if not in_process:  # a stub that died: not ready until a request restarts it
                model = server.core.model("flaky")
                os.kill(model.pid, 9)
                deadline = time.monotonic() + 10
                while model.not_ready_reason() is None and time.monotonic() < deadline:
                    time.sleep(0.05)  # (until the kill shows)
                assert _ready(server) == (False, False)
                assert client.infer("flaky", [_input()]).as_numpy("OUT").tolist() == [7]
                assert _ready(server) == (True, True)


def _until_ready(server: Any) -> None:
    deadline = time.monotonic() + 30
    while _ready(server) != (True, True):
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.05)


def _input() -> Any:
    import numpy as np
    import tritonclient.http as httpclient

    value = httpclient.InferInput("IN", [1], "INT32")
    value.set_data_from_numpy(np.array([7], dtype=np.int32))
    return value


def test_readiness_without_strictness(repo: Path) -> None:
    with _server(repo, in_process=True, strict_readiness=False) as server:
        assert _ready(server) == (True, True)
        (repo / "flaky" / "not_ready").write_text("")
        assert _ready(server) == (True, True)

