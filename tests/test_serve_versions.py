"""Model versions under ``pb-tensor serve`` as Triton serves them: every version the model's
``version_policy`` names (core's ``VersionsToLoad``: ``latest { num_versions: N }``, the
default one; ``all``; ``specific``, without the versions that have no directory), each with
its own row in the repository index, its own statistics and metrics; a request that names
no version goes to the newest one; the model metadata lists the versions served."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_support import EXAMPLES, needs_serve

pytestmark = needs_serve


def _repository(tmp_path: Path, versions: list[int], policy: str) -> str:
    root = tmp_path / "models"
    model = root / "add_sub"
    shutil.copytree(Path(EXAMPLES) / "add_sub", model)
    shutil.rmtree(model / "1")
    for version in versions:
        shutil.copytree(Path(EXAMPLES) / "add_sub" / "1", model / str(version))
    config = model / "config.pbtxt"
    config.write_text(config.read_text() + policy)
    return str(root)


def _server(repository: str, mode: str = "none", exit_on_error: bool = True) -> Any:
    from pb_tensor.serve import Options, Server

    options = Options([repository], http_port=0, grpc_port=0, metrics_port=0,
                      model_control_mode=mode, exit_on_error=exit_on_error,
                      load_models=["add_sub"] if mode == "explicit" else [],
                      in_process=True)  # fmt: skip
    return Server(options)


def _version_of_answer(client: Any, version: str = "") -> str:
    import tritonclient.http as httpclient

    inputs = []
    for name in ("INPUT0", "INPUT1"):
        given = httpclient.InferInput(name, [4], "FP32")
        given.set_data_from_numpy(np.ones(4, dtype=np.float32))
        inputs.append(given)
    answer: str = client.infer("add_sub", inputs, model_version=version).get_response()[
        "model_version"]
    return answer


def _rows(client: Any) -> list[tuple[str, str]]:
    return [(m.get("version", ""), m.get("state", ""))
            for m in client.get_model_repository_index() if m["name"] == "add_sub"]


@pytest.mark.parametrize(("versions", "policy", "served"), [
    ([1, 2, 3], "", [3]),
    ([1, 2, 3], "version_policy: { latest { num_versions: 2 } }\n", [2, 3]),
    ([1, 2, 3], "version_policy: { all { } }\n", [1, 2, 3]),
    ([1, 3, 10], "version_policy: { specific { versions: [ 1, 3, 7 ] } }\n", [1, 3]),
])  # fmt: skip
def test_the_version_policy_decides_the_versions_served(
    tmp_path: Path, versions: list[int], policy: str, served: list[int]
) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with _server(_repository(tmp_path, versions, policy)) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert _rows(client) == [(str(v), "READY") for v in served]
        assert client.get_model_metadata("add_sub")["versions"] == [str(v) for v in served]
        assert client.get_model_metadata("add_sub", str(served[0]))["versions"] == [
            str(served[0])]
        assert _version_of_answer(client) == str(served[-1])
        for version in versions:
            if version in served:
                assert client.is_model_ready("add_sub", str(version))
                assert _version_of_answer(client, str(version)) == str(version)
            else:
                assert not client.is_model_ready("add_sub", str(version))
                with pytest.raises(InferenceServerException) as caught:
                    _version_of_answer(client, str(version))
                assert caught.value.message() == (
                    f"Request for unknown model: 'add_sub' version {version} is not found")
        stats = client.get_inference_statistics("add_sub")["model_stats"]
        assert [s["version"] for s in stats] == [str(v) for v in served]
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        assert list(grpc.get_model_metadata("add_sub").versions) == [str(v) for v in served]
        with urllib.request.urlopen(server.metrics_url, timeout=10) as answer:
            metrics = answer.read().decode()
        counted = {line.split('version="')[1].split('"')[0] for line in metrics.splitlines()
                   if line.startswith('nv_inference_count{model="add_sub"')}  # fmt: skip
        assert counted == {str(v) for v in served}


def test_a_policy_that_serves_no_version_fails_the_load(tmp_path: Path) -> None:
    """Core's ``AsyncLoad`` refuses such a load before it records a version: the load fails
    with its text, the index has no row for the model (its record has no version), and a
    request gets ``has no available versions``."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    policy = "version_policy: { specific { versions: [ 7 ] } }\n"
    with _server(_repository(tmp_path, [1, 2], policy), "explicit",
                 exit_on_error=False) as server:  # fmt: skip
        client = httpclient.InferenceServerClient(server.http_url)
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("add_sub")
        assert caught.value.message().endswith(
            "at least one version must be available under the version policy of model "
            "'add_sub'\n")
        assert not client.is_model_ready("add_sub")
        assert [m for m in client.get_model_repository_index() if m["name"] == "add_sub"] == []
        given = httpclient.InferInput("INPUT0", [4], "FP32")
        given.set_data_from_numpy(np.zeros(4, np.float32))
        with pytest.raises(InferenceServerException,
                           match="Request for unknown model: 'add_sub' has no available "
                                 "versions"):  # fmt: skip
            client.infer("add_sub", [given, given])


def test_unloading_a_model_unloads_every_version(tmp_path: Path) -> None:
    import tritonclient.http as httpclient

    policy = "version_policy: { all { } }\n"
    with _server(_repository(tmp_path, [1, 2], policy), "explicit") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        client.unload_model("add_sub")
        assert not client.is_model_ready("add_sub", "1")
        assert not client.is_model_ready("add_sub", "2")
        rows = _rows(client)
        assert [v for v, _ in rows] == ["1", "2"]
        assert all(state in ("UNLOADING", "UNAVAILABLE") for _, state in rows)
        assert server.core.loaded_models() == []


def test_the_runtime_loads_the_newest_version_the_policy_serves(tmp_path: Path) -> None:
    from pb_tensor.runtime import ModelRepository

    policy = "version_policy: { specific { versions: [ 1 ] } }\n"
    with ModelRepository(_repository(tmp_path, [1, 2], policy)) as repo:
        assert repo.versions("add_sub") == [1, 2]
        assert repo.served_versions("add_sub") == [1]
        model = repo.load("add_sub", isolated=False)
        assert model.version == 1
        assert repo.load("add_sub", version=2, isolated=False).version == 2  # asked for


def test_the_runtime_reaches_only_the_versions_the_policy_serves(tmp_path: Path) -> None:
    # Without a server too, a BLS request or an ensemble step naming a version the policy
    # does not serve fails as in Triton (core's GetModel, CheckNode), where the repository
    # used to load that version on first use.
    from runtime_models import ensemble, step

    from pb_tensor.runtime import InferenceError, ModelLoadError, ModelRepository

    root = Path(_repository(tmp_path, [1, 2], "version_policy: { specific { versions: [ 1 ] } }\n"))
    pinned = ensemble(
        [step("add_sub", {"INPUT0": "INPUT0", "INPUT1": "INPUT1"},
              {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"})],
        inputs='{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }, '
               '{ name: "INPUT1" data_type: TYPE_FP32 dims: [ -1 ] }',
        outputs='{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }, '
                '{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1 ] }',
    ).replace("model_version: -1", "model_version: 2")  # fmt: skip
    (root / "pinned" / "1").mkdir(parents=True)
    (root / "pinned" / "config.pbtxt").write_text(pinned)
    with ModelRepository(root) as repo:
        with pytest.raises(InferenceError) as caught:
            repo.bls_target("add_sub", 2, False)
        assert caught.value.message() == (
            "Request for unknown model: 'add_sub' version 2 is not found")
        assert repo.bls_target("add_sub", 1, False).version == 1
        with pytest.raises(ModelLoadError) as failed:
            repo.load("pinned", isolated=False)
        assert str(failed.value).endswith(
            "ensemble 'pinned' depends on 'add_sub' whose required version 2 is not loaded.")


def test_pending_requests_are_counted_per_version(tmp_path: Path) -> None:
    # nv_inference_pending_request_count is per model version in Triton: a request to one
    # version is not pending in the other.
    policy = "version_policy: { all { } }\n"
    with _server(_repository(tmp_path, [1, 2], policy)) as server:
        core = server.core
        first, second = core.model("add_sub", "1"), core.model("add_sub", "2")
        core._enter(second)  # (a request of version 2 in flight)
        try:
            assert (core.pending(first), core.pending(second)) == (0, 1)
            with urllib.request.urlopen(server.metrics_url, timeout=10) as answer:
                lines = answer.read().decode().splitlines()
            assert 'nv_inference_pending_request_count{model="add_sub",version="1"} 0' in lines
            assert 'nv_inference_pending_request_count{model="add_sub",version="2"} 1' in lines
        finally:
            core._leave(second)
