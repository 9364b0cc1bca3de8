"""Instance updates (core's ``TritonModel::UpdateInstanceGroup``): a loaded model's
``instance_group`` changes without a reload, through ``LoadedModel.update_instance_group`` and
through a load of ``pb-tensor serve`` whose configuration changed only there. Upstream's
``qa/L0_model_update`` runs in ``tests/test_upstream_model_update.py``; the cases here check,
on CPU groups, what its GPU cases check (instances matched by signature, renamed groups,
sequences kept on removed instances), and what it does not (the instance kept of several,
the wait for a busy removed instance, failed updates, multi-version loads)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_support import needs_serve

from pb_tensor.runtime import LoadedModel, ModelLoadError, ModelRepository

_MODEL = '''
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]
        self.dir = os.path.dirname(os.path.dirname(args["model_repository"]))
        self.log("init " + self.name)

    def log(self, line):
        with open(os.path.join(self.dir, "log"), "a") as f:
            f.write(line + "\\n")

    def execute(self, requests):
        out = []
        for request in requests:
            sleep = float(pb_utils.get_input_tensor_by_name(request, "SLEEP").as_numpy()[0])
            if sleep < 0:  # the model loads itself (its configuration changed meanwhile)
                pb_utils.load_model("m")
                sleep = 0.0
            if sleep:
                self.log("run " + self.name)
            time.sleep(sleep)
            if sleep:
                self.log("ran " + self.name)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("NAME", np.array([self.name.encode()], dtype=np.object_))]))
        return out

    def finalize(self):
        self.log("fini " + self.name)
'''

_IO = """
backend: "python"
input [ { name: "SLEEP" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "NAME" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

MODES = pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])


def _write(work: Path, extra: str = "", versions: tuple[int, ...] = (1,)) -> Path:
    root = work / "models"
    for version in versions:
        (root / "m" / str(version)).mkdir(parents=True, exist_ok=True)
        (root / "m" / str(version) / "model.py").write_text(_MODEL)
    (root / "m" / "config.pbtxt").write_text(_IO + extra)
    (work / "log").write_text("")
    return root


def _log(work: Path) -> list[str]:
    return (work / "log").read_text().splitlines()


def _name(model: LoadedModel, sleep: float = 0.0, **kw: Any) -> str:
    out = model.infer({"SLEEP": np.array([sleep], np.float32)}, **kw)
    return str(out["NAME"][0].decode())


def _cpu(count: int, name: str = "", policy: str = "") -> dict[str, Any]:
    group: dict[str, Any] = {"count": count, "kind": "KIND_CPU"}
    if name:
        group["name"] = name
    if policy:  # another host policy: another signature, as another kind or device would be
        group["host_policy"] = policy
    return group


@MODES
def test_add_and_remove_keep_the_other_instances(tmp_path: Path, isolated: bool) -> None:
    """New instances get ``<group>_<c>`` names and an ``initialize``; kept ones keep their
    name and state (no second ``initialize``); of several of one signature core keeps the
    last (it pops them off the back); requests run on throughout and the statistics go
    on."""
    root = _write(tmp_path, "instance_group [ { count: 1 kind: KIND_CPU } ]")
    with ModelRepository(root) as repo:
        model = repo.load("m", isolated=isolated)
        stop = threading.Event()
        errors: list[BaseException] = []
        served = [0]

        def call() -> None:
            while not stop.is_set():
                try:
                    _name(model)
                    served[0] += 1
                except BaseException as exc:  # (the test reports it)
                    errors.append(exc)

        callers = [threading.Thread(target=call) for _ in range(4)]
        for t in callers:
            t.start()
        try:
            assert model.update_instance_group([_cpu(3)]) == (2, 0)
            assert model.instance_names == ["m_0_0", "m_0_1", "m_0_2"]
            assert model.update_instance_group([_cpu(1)]) == (0, 2)
            assert model.instance_names == ["m_0_2"]  # core reuses the last one
            assert model.update_instance_group([_cpu(1)]) == (0, 0)
            assert model.update_instance_group([_cpu(0)]) == (0, 0)  # count 0 counts as 1
        finally:
            stop.set()
            for t in callers:
                t.join()
        assert errors == []
        assert model.instance_names == ["m_0_2"]
        log = _log(tmp_path)
        assert log[:3] == ["init m_0_0", "init m_0_1", "init m_0_2"]
        assert sorted(log[3:]) == ["fini m_0_0", "fini m_0_1"]  # (whichever was idle first)
        assert model.statistics()["inference_count"] == served[0]
        assert model.config["instance_group"][0]["count"] == 1
        assert {_name(model) for _ in range(4)} == {"m_0_2"}
    assert _log(tmp_path)[-1] == "fini m_0_2"


@MODES
def test_signatures_match_instances_across_groups(tmp_path: Path, isolated: bool) -> None:
    """``test_instance_signature`` and ``test_instance_name_update`` on CPU groups: groups that
    differ only in name and count match the same instances, however the instances are
    grouped; a group of another signature (here another host policy) gets new ones."""
    root = _write(tmp_path, 'instance_group [ { name: "a" count: 2 kind: KIND_CPU }, '
                            '{ name: "b" count: 1 kind: KIND_CPU host_policy: "other" } ]')
    with ModelRepository(root) as repo:
        model = repo.load("m", isolated=isolated)
        assert model.instance_names == ["a_0", "a_1", "b_0"]
        # flatten: the same instances in other groups, renamed groups included
        groups = [_cpu(1, "x", "other"), _cpu(1, "y"), _cpu(1, "z")]
        assert model.update_instance_group(groups) == (0, 0)
        assert sorted(model.instance_names) == ["a_0", "a_1", "b_0"]
        # consolidate, in another order
        assert model.update_instance_group([_cpu(2, "a"), _cpu(1, "b", "other")]) == (0, 0)
        # one signature's instances go, the other's grow
        assert model.update_instance_group([_cpu(2, "c", "other")]) == (1, 2)
        assert model.instance_names == ["b_0", "c_1"]
        assert set(_log(tmp_path)) == {"init a_0", "init a_1", "init b_0", "init c_1",
                                       "fini a_0", "fini a_1"}  # fmt: skip


def test_removal_waits_for_the_batch_of_a_busy_instance(tmp_path: Path) -> None:
    """A removed instance that runs a request stops (``finalize``) once the request ended,
    before the update returns (core destroys it as it commits the update); the request
    completes normally."""
    root = _write(tmp_path, "instance_group [ { count: 2 kind: KIND_CPU } ]")
    with ModelRepository(root) as repo:
        model = repo.load("m", isolated=True)
        names: list[str] = []
        running = [threading.Thread(target=lambda: names.append(_name(model, 1.0)))
                   for _ in range(2)]  # fmt: skip
        for t in running:
            t.start()
        deadline = time.monotonic() + 30
        while sorted(_log(tmp_path)) != ["init m_0_0", "init m_0_1", "run m_0_0", "run m_0_1"]:
            assert time.monotonic() < deadline, _log(tmp_path)  # both run a request now
            time.sleep(0.01)
        assert model.update_instance_group([_cpu(1)]) == (0, 1)
        # When the update returned, the removed instance had finished its request, then
        # finalized (no finalize while it ran, none left for later).
        log = _log(tmp_path)
        assert log.index("ran m_0_0") < log.index("fini m_0_0")
        for t in running:
            t.join()
        assert sorted(names) == ["m_0_0", "m_0_1"]


@MODES
def test_failed_update_changes_nothing(tmp_path: Path, isolated: bool) -> None:
    root = _write(tmp_path)
    with ModelRepository(root) as repo:
        model = repo.load("m", isolated=isolated)
        with pytest.raises(ModelLoadError, match="has kind KIND_GPU but no GPUs are available"):
            model.update_instance_group([_cpu(2), {"count": 1, "kind": "KIND_GPU"}])
        with pytest.raises(ModelLoadError, match="kind KIND_CPU but specifies one or more GPUs"):
            model.update_instance_group([{"count": 1, "kind": "KIND_CPU", "gpus": [0]}])
        with pytest.raises(TypeError, match="instance_group must be a list of mappings"):
            model.update_instance_group("count: 2")  # type: ignore[arg-type]
        assert model.instance_names == ["m_0"]
        assert _name(model) == "m_0"
        assert _log(tmp_path) == ["init m_0"]
    with pytest.raises(ModelLoadError, match="the model is not loaded"):
        model.update_instance_group([_cpu(2)])


def test_sequences_stay_on_removed_instances_until_they_end(tmp_path: Path) -> None:
    """``*_with_ongoing_sequences`` on CPU groups: the instances of running sequences are
    removed once those sequences ended; the others at once; new sequences go to the new
    instance meanwhile."""
    root = _write(tmp_path, "instance_group [ { count: 3 kind: KIND_CPU } ]\n"
                            "sequence_batching { max_sequence_idle_microseconds: 8000000 }")
    with ModelRepository(root) as repo:
        model = repo.load("m", isolated=True)
        first = _name(model, correlation_id=1, sequence_start=True)
        second = _name(model, correlation_id=2, sequence_start=True)
        assert first != second
        # every instance goes; one of another signature comes
        assert model.update_instance_group([_cpu(1, "new", "other")]) == (1, 3)
        assert model.instance_names == ["new_0"]
        free = ({"m_0_0", "m_0_1", "m_0_2"} - {first, second}).pop()
        assert [line for line in _log(tmp_path) if line.startswith("fini")] == [f"fini {free}"]
        assert _name(model, correlation_id=1) == first  # a running sequence keeps its instance
        assert _name(model, correlation_id=3, sequence_start=True) == "new_0"
        assert _name(model, correlation_id=1, sequence_end=True) == first
        deadline = time.monotonic() + 30
        while f"fini {first}" not in _log(tmp_path):
            assert time.monotonic() < deadline, _log(tmp_path)
            time.sleep(0.05)
        assert f"fini {second}" not in _log(tmp_path)
        assert _name(model, correlation_id=2, sequence_end=True) == second
        assert _name(model, correlation_id=3, sequence_end=True) == "new_0"
    fini = [line for line in _log(tmp_path) if line.startswith("fini")]
    assert sorted(fini) == sorted(f"fini {n}" for n in ("m_0_0", "m_0_1", "m_0_2", "new_0"))


# -- serve ---------------------------------------------------------------------------------------
def _server(root: Path, in_process: bool = True) -> Any:
    from pb_tensor.serve import Options, Server

    options = Options([str(root)], http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, allow_grpc=False, model_control_mode="explicit",
                      load_models=["m"], in_process=in_process)  # fmt: skip
    return Server(options)


def _touch(path: Path) -> None:
    """A modification time past any the file system gave so far (its clock is coarse)."""
    now = time.time_ns() + 1_000_000_000
    os.utime(path, ns=(now, now))


@needs_serve
def test_serve_updates_instances_and_reloads_changed_versions(tmp_path: Path) -> None:
    """A load whose configuration changed only in ``instance_group`` updates the loaded
    versions in place (statistics kept, no ``initialize`` of the kept instances); a version
    whose files changed reloads, the others are updated."""
    import tritonclient.http as httpclient

    root = _write(tmp_path, 'version_policy: { all { } }\n'
                            "instance_group [ { count: 1 kind: KIND_CPU } ]", versions=(1, 2))
    with _server(root) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        given = httpclient.InferInput("SLEEP", [1], "FP32")
        given.set_data_from_numpy(np.zeros(1, np.float32))
        client.infer("m", [given], model_version="1")
        config = root / "m" / "config.pbtxt"
        config.write_text(config.read_text().replace("count: 1", "count: 2"))
        _touch(config)
        client.load_model("m")
        assert sorted(_log(tmp_path)) == ["init m_0_0", "init m_0_0", "init m_0_1",
                                          "init m_0_1"]  # fmt: skip
        stats = client.get_inference_statistics("m", "1")["model_stats"][0]
        assert stats["inference_count"] == 1  # the same copy: its statistics go on
        assert client.get_model_config("m")["instance_group"][0]["count"] == 2
        # version 2's file changed: it reloads (two instances), version 1 is updated (no-op)
        _touch(root / "m" / "2" / "model.py")
        (tmp_path / "log").write_text("")
        client.load_model("m")
        assert sorted(_log(tmp_path))[-2:] == ["init m_0_0", "init m_0_1"]
        deadline = time.monotonic() + 30  # (the old copy of version 2 goes in the background)
        while sorted(_log(tmp_path)) != ["fini m_0_0", "fini m_0_1", "init m_0_0",
                                         "init m_0_1"]:  # fmt: skip
            assert time.monotonic() < deadline, _log(tmp_path)
            time.sleep(0.05)
        assert client.get_inference_statistics("m", "1")["model_stats"][0][
            "inference_count"] == 1
        # an update that fails: Triton's text, the model goes on serving as it was
        config.write_text(config.read_text().replace("KIND_CPU", "KIND_GPU"))
        _touch(config)
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException) as caught:
            client.load_model("m")
        assert caught.value.message() == (
            "load failed for model 'm': version 1 is at READY state: instance group m_0 of "
            "model m has kind KIND_GPU but no GPUs are available;\n")
        assert client.is_model_ready("m", "1")
        assert client.is_model_ready("m", "2")
        client.infer("m", [given], model_version="1")


@needs_serve
def test_serve_config_override_updates_in_place(tmp_path: Path) -> None:
    """``load_model(config=...)`` with the served configuration and one more instance
    updates the model (upstream's ``test_load_api_with_config``); a later load without an
    override and without changes keeps it."""
    import tritonclient.http as httpclient

    root = _write(tmp_path, "instance_group [ { count: 1 kind: KIND_CPU } ]")
    with _server(root) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        config = client.get_model_config("m")
        config["instance_group"][0]["count"] += 1
        client.load_model("m", config=json.dumps(config))
        assert _log(tmp_path) == ["init m_0_0", "init m_0_1"]
        client.load_model("m")
        assert _log(tmp_path) == ["init m_0_0", "init m_0_1"]
        assert client.get_model_config("m")["instance_group"][0]["count"] == 2


@needs_serve
@pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "stub"])
def test_a_model_that_removes_its_own_instance(tmp_path: Path, in_process: bool) -> None:
    """A model whose request loads it (``pb_utils.load_model``) after its configuration lost
    an instance, the very one running that request: the update does not wait for that
    request (it would wait on itself); the instance finalizes in the background once the
    request ended."""
    import tritonclient.http as httpclient

    root = _write(tmp_path, "instance_group [ { count: 2 kind: KIND_CPU } ]")
    with _server(root, in_process) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        config = root / "m" / "config.pbtxt"
        config.write_text(config.read_text().replace("count: 2", "count: 1"))
        _touch(config)
        given = httpclient.InferInput("SLEEP", [1], "FP32")
        given.set_data_from_numpy(np.array([-1.0], np.float32))
        # (the first idle instance takes it: m_0_0, the one the update removes)
        answer = client.infer("m", [given])
        assert answer.as_numpy("NAME")[0] == b"m_0_0"
        deadline = time.monotonic() + 30
        while "fini m_0_0" not in _log(tmp_path):
            assert time.monotonic() < deadline, _log(tmp_path)
            time.sleep(0.05)
        assert _log(tmp_path) == ["init m_0_0", "init m_0_1", "fini m_0_0"]
        given.set_data_from_numpy(np.zeros(1, np.float32))
        assert client.infer("m", [given]).as_numpy("NAME")[0] == b"m_0_1"
