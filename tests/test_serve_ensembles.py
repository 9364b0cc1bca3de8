"""Ensembles under ``pb-tensor serve`` run on the server's models, as Triton's do: one set of
instances per composing model (their statistics count the ensemble's requests), composing
models loaded with the ensemble, and Triton's dependency rules when a composing model is
unloaded or reloaded (core's ``ModelRepositoryManager`` dependency graph)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_models import ensemble, step
from serve_support import EXAMPLES, needs_serve

pytestmark = needs_serve

# add_sub twice: (a + b) + (a - b) and (a + b) - (a - b)
TWICE = ensemble(
    [step("add_sub", {"INPUT0": "INPUT0", "INPUT1": "INPUT1"},
          {"OUTPUT0": "sum", "OUTPUT1": "diff"}),
     step("add_sub", {"INPUT0": "sum", "INPUT1": "diff"},
          {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"})],
    inputs='{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }, '
           '{ name: "INPUT1" data_type: TYPE_FP32 dims: [ -1 ] }',
    outputs='{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }, '
            '{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1 ] }',
)  # fmt: skip


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(Path(EXAMPLES) / "add_sub", root / "add_sub")
    # The same ensemble under a name that sorts before add_sub: with every model loaded at
    # start, it loads add_sub first, which the server then does not load a second time.
    for name in ("twice", "a_twice"):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(TWICE)
    return str(root)


def _server(repository: str, mode: str, in_process: bool, load: list[str]) -> Any:
    from pb_tensor.serve import Options, Server

    options = Options([repository], http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, allow_grpc=False, model_control_mode=mode,
                      load_models=load, in_process=in_process)  # fmt: skip
    return Server(options)


def _infer(client: Any, model: str) -> Any:
    import tritonclient.http as httpclient

    inputs = []
    for name in ("INPUT0", "INPUT1"):
        given = httpclient.InferInput(name, [4], "FP32")
        given.set_data_from_numpy(np.arange(4, dtype=np.float32))
        inputs.append(given)
    return client.infer(model, inputs)


def _successes(client: Any, model: str) -> int:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    count: int = stats["inference_stats"]["success"]["count"]
    return count


def _states(client: Any) -> dict[str, tuple[str, str]]:
    """The index's (state, reason) per model once no model is UNLOADING any more (an unload
    returns once it started, as Triton's does; bounded wait)."""
    deadline = time.monotonic() + 30
    while True:
        states = {m["name"]: (m.get("state", ""), m.get("reason", ""))
                  for m in client.get_model_repository_index()}  # fmt: skip
        if all(s != "UNLOADING" for s, _ in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.02)


@pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "stub"])
def test_an_ensemble_runs_on_the_servers_composing_models(repository: str,
                                                          in_process: bool) -> None:
    import tritonclient.http as httpclient

    with _server(repository, "none", in_process, []) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        x = np.arange(4, dtype=np.float32)
        for ensemble in ("twice", "a_twice"):
            assert _infer(client, ensemble).as_numpy("OUTPUT0").tolist() == (2 * x).tolist()
        # Every step ran on the add_sub the server serves (one stub), as in Triton.
        assert _successes(client, "add_sub") == 4
        assert _successes(client, "twice") == 1  # the ensemble's own, as core records them
        names = sorted(m.name for m in server.core.loaded_models())
        assert names == ["a_twice", "add_sub", "twice"]


@pytest.fixture
def explicit(repository: str) -> Iterator[Any]:
    import tritonclient.http as httpclient

    with _server(repository, "explicit", True, ["twice"]) as server:
        yield server, httpclient.InferenceServerClient(server.http_url)


def test_loading_an_ensemble_loads_its_composing_models(explicit: Any) -> None:
    _, client = explicit
    assert _states(client) == {"a_twice": ("", ""), "add_sub": ("READY", ""),
                               "twice": ("READY", "")}  # fmt: skip
    assert _infer(client, "add_sub").as_numpy("OUTPUT1").tolist() == [0, 0, 0, 0]


def test_unloading_a_composing_model_unloads_its_ensembles(explicit: Any) -> None:
    from tritonclient.utils import InferenceServerException

    _, client = explicit
    client.unload_model("add_sub")
    states = _states(client)
    assert states["add_sub"] == ("UNAVAILABLE", "unloaded")
    assert states["twice"] == (
        "UNAVAILABLE",
        "ensemble twice contains models that are not available or ambiguous: add_sub",
    )
    with pytest.raises(InferenceServerException,
                       match="Request for unknown model: 'twice' has no available versions"):
        _infer(client, "twice")
    client.load_model("twice")  # loads add_sub again with it
    assert _states(client)["add_sub"] == ("READY", "")
    assert _infer(client, "twice").as_numpy("OUTPUT0").tolist() == [0, 2, 4, 6]


def test_reloading_a_composing_model_reloads_its_ensembles(explicit: Any,
                                                          repository: str) -> None:
    server, client = explicit
    before = {m.name: m for m in server.core.loaded_models()}
    # Triton reloads a loaded model only when its directory changed (or with an override).
    now = time.time_ns() + 1_000_000
    os.utime(Path(repository) / "add_sub" / "1" / "model.py", ns=(now, now))
    client.load_model("add_sub")
    after = {m.name: m for m in server.core.loaded_models()}
    assert after["add_sub"] is not before["add_sub"]
    assert after["twice"] is not before["twice"]
    _infer(client, "twice")
    assert _successes(client, "add_sub") == 2  # the new add_sub ran both steps


@pytest.mark.parametrize("asked", [False, True], ids=["with_the_ensemble", "asked_for"])
@pytest.mark.parametrize("dependents", [False, True])
def test_unload_dependents(explicit: Any, dependents: bool, asked: bool) -> None:
    # Triton's cascading removal: a composing model goes with its ensemble when it was
    # loaded with it (not asked for) and no other loaded ensemble runs on it.
    _, client = explicit
    if asked:
        client.load_model("add_sub")
    client.unload_model("twice", unload_dependents=dependents)
    states = _states(client)
    assert states["twice"][0] == "UNAVAILABLE"
    assert states["add_sub"][0] == ("UNAVAILABLE" if dependents and not asked else "READY")


def test_unload_dependents_keeps_what_another_ensemble_runs_on(explicit: Any) -> None:
    _, client = explicit
    client.load_model("a_twice")
    client.unload_model("twice", unload_dependents=True)
    assert _states(client)["add_sub"][0] == "READY"
    client.unload_model("a_twice", unload_dependents=True)
    assert _states(client)["add_sub"][0] == "UNAVAILABLE"


def test_cascaded_unloads_take_each_models_lock(explicit: Any) -> None:
    """Triton locks every model an unload touches: the composing model that goes with its
    ensemble (``unload_dependents``) waits while a load or unload of that model holds its
    lock, and an ensemble dropped with its composing model waits for the ensemble's."""
    server, client = explicit
    core = server.core

    def state(name: str) -> str:
        # (read from the core: tritonclient.http's gevent client stalls while another thread
        # of this process waits on a lock)
        return next(s.state for s in core.index(False) if s.name == name)

    for held, unload, waits in (("add_sub", "twice", "add_sub"),
                                ("twice", "add_sub", "twice")):  # fmt: skip
        client.load_model("twice")
        with core._control_lock(held):
            thread = threading.Thread(
                target=lambda u=unload: core.unload(u, unload_dependents=True))
            thread.start()
            time.sleep(0.5)
            assert state(waits) == "READY"  # (its lock is held: its unload waits)
        thread.join(30)
        assert state(waits) in ("UNLOADING", "UNAVAILABLE")


def test_a_composing_model_that_fails_to_reload_keeps_serving(explicit: Any) -> None:
    # Triton's "model availability claim" (ModelLifeCycle::OnLoadFinal; upstream's
    # L0_lifecycle test_model_reload_fail): the loaded copy goes on serving when its reload
    # fails, and so do the ensembles on it.
    import json

    from tritonclient.utils import InferenceServerException

    server, client = explicit
    before = {m.name: m for m in server.core.loaded_models()}
    config = json.dumps({"backend": "python"})
    with pytest.raises(InferenceServerException, match="load failed for model 'add_sub'"):
        client.load_model("add_sub", config=config,
                          files={"file:1/model.py": b"raise RuntimeError('broken')\n"})
    assert _states(client)["add_sub"] == ("READY", "")
    assert _states(client)["twice"] == ("READY", "")
    assert client.is_model_ready("add_sub")
    assert {m.name: m for m in server.core.loaded_models()} == before
    assert _infer(client, "twice").as_numpy("OUTPUT0").tolist() == [0, 2, 4, 6]
    assert _successes(client, "add_sub") == 2


def test_a_model_that_fails_to_load_while_not_loaded_says_why(explicit: Any) -> None:
    import json

    from tritonclient.utils import InferenceServerException

    _, client = explicit
    client.unload_model("add_sub")
    assert _states(client)["twice"][0] == "UNAVAILABLE"
    config = json.dumps({"backend": "python"})
    with pytest.raises(InferenceServerException, match="load failed for model 'add_sub'"):
        client.load_model("add_sub", config=config,
                          files={"file:1/model.py": b"raise RuntimeError('broken')\n"})
    state, reason = _states(client)["add_sub"]
    assert state == "UNAVAILABLE"
    assert "broken" in reason


def _two_versions(tmp_path: Path, policy: str) -> Path:
    """add_sub with versions 1 and 2 (and ``policy``), and an ensemble pinned to 1."""
    root = tmp_path / "models"
    shutil.copytree(Path(EXAMPLES) / "add_sub", root / "add_sub")
    shutil.copytree(root / "add_sub" / "1", root / "add_sub" / "2")
    config = root / "add_sub" / "config.pbtxt"
    config.write_text(config.read_text() + policy)
    (root / "pinned" / "1").mkdir(parents=True)
    (root / "pinned" / "config.pbtxt").write_text(TWICE.replace("model_version: -1",
                                                               "model_version: 1"))
    return root


def test_a_step_pinned_to_a_version_the_server_does_not_serve(tmp_path: Path) -> None:
    # The server serves add_sub's latest version (2, the default version policy): an
    # ensemble pinned to version 1 does not load (core's CheckNode).
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    root = _two_versions(tmp_path, "")
    with _server(str(root), "explicit", True, ["add_sub"]) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert server.core.model("add_sub").version == 2
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("pinned")
        assert caught.value.message() == (
            "load failed for model 'pinned': failed to load model 'pinned' version 1: ensemble "
            "'pinned' depends on 'add_sub' whose required version 1 is not loaded.\n")


def test_a_step_pinned_to_a_version_the_server_serves(tmp_path: Path) -> None:
    # With a version policy that serves both versions, the pinned step runs on the
    # server's version 1; a request that names no version goes to version 2.
    import tritonclient.http as httpclient

    root = _two_versions(tmp_path, "version_policy: { all { } }\n")
    with _server(str(root), "explicit", True, ["add_sub", "pinned"]) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        (step,) = server.core.model("pinned").composing_models
        assert step is server.core.model("add_sub", "1")
        assert _infer(client, "pinned").as_numpy("OUTPUT0").tolist() == [0, 2, 4, 6]
        stats = {s["version"]: s["inference_stats"]["success"]["count"]
                 for s in client.get_inference_statistics("add_sub")["model_stats"]}
        assert stats == {"1": 2, "2": 0}
        assert _infer(client, "add_sub").as_numpy("OUTPUT0").tolist() == [0, 2, 4, 6]
        assert client.get_model_metadata("add_sub")["versions"] == ["1", "2"]


def test_an_ensemble_runs_on_models_of_another_repository(tmp_path: Path) -> None:
    # Triton finds an ensemble's composing models in every repository it serves.
    import tritonclient.http as httpclient

    from pb_tensor.serve import Options, Server

    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(Path(EXAMPLES) / "add_sub", second / "add_sub")
    (first / "twice" / "1").mkdir(parents=True)
    (first / "twice" / "config.pbtxt").write_text(TWICE)
    options = Options([str(first), str(second)], http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, allow_grpc=False, in_process=True)  # fmt: skip
    with Server(options) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert _infer(client, "twice").as_numpy("OUTPUT0").tolist() == [0, 2, 4, 6]
        (step,) = server.core.model("twice").composing_models
        assert step is server.core.model("add_sub")
        assert _successes(client, "add_sub") == 2


def test_an_ensemble_loaded_with_an_override_follows_its_reloaded_model(
    explicit: Any, repository: str
) -> None:
    # The ensemble reloads on the new composing model with the configuration it had (its
    # override), as Triton's dependency graph reloads it; before, it kept the old copy,
    # which the reload unloads.
    import json

    server, client = explicit
    config = client.get_model_config("twice")
    config["parameters"] = {"note": {"string_value": "overridden"}}
    client.load_model("twice", config=json.dumps(config))
    now = time.time_ns() + 1_000_000
    os.utime(Path(repository) / "add_sub" / "1" / "model.py", ns=(now, now))
    client.load_model("add_sub")
    (step,) = server.core.model("twice").composing_models
    assert step is server.core.model("add_sub")
    assert client.get_model_config("twice")["parameters"] == {
        "note": {"string_value": "overridden"}}
    assert _infer(client, "twice").as_numpy("OUTPUT0").tolist() == [0, 2, 4, 6]
