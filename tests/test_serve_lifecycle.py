"""A model's lifecycle under ``pb-tensor serve`` as in Triton's core (``ModelLifeCycle``,
``ModelRepositoryManager``): a loaded model goes on serving while it reloads, and after a
reload that failed; an unload returns once it started (the model is ``UNLOADING`` until its
``finalize`` ran); load and unload requests for one model run one at a time; the server's
shutdown waits for the unloads still going on. Upstream's ``qa/L0_lifecycle`` checks the same
(``test_model_availability_on_reload``, ``test_model_reload_fail``,
``test_shutdown_while_background_unloading``)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_support import EXAMPLES, needs_serve

pytestmark = needs_serve

# initialize and finalize each write to a log and wait while a "hold" file exists (20 s at
# most, so that a failing test cannot hang); OUT is the copy's generation (its number of
# initialize calls in the log).
_MODEL = '''
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _wait(path):
    deadline = time.monotonic() + 20
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.dir = config["parameters"]["dir"]["string_value"]
        self.log("init-start")
        _wait(os.path.join(self.dir, "hold_init"))
        with open(os.path.join(self.dir, "log")) as f:
            self.generation = f.read().split().count("init-start")

    def log(self, what):
        with open(os.path.join(self.dir, "log"), "a") as f:
            f.write(what + "\\n")

    def execute(self, requests):
        out = np.array([self.generation], dtype=np.int32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]) for _ in requests]

    def finalize(self):
        self.log("fin-start")
        _wait(os.path.join(self.dir, "hold_fin"))
        self.log("fin-end")
'''


@pytest.fixture
def work(tmp_path: Path) -> Path:
    model = tmp_path / "models" / "slow"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(_MODEL)
    (model / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        f'parameters {{ key: "dir" value: {{ string_value: "{tmp_path}" }} }}\n'
    )
    (tmp_path / "log").write_text("")
    return tmp_path


def _server(work: Path, load: list[str], in_process: bool = True) -> Any:
    from pb_tensor.serve import Options, Server

    options = Options([str(work / "models")], http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, allow_grpc=False, model_control_mode="explicit",
                      load_models=load, in_process=in_process)  # fmt: skip
    return Server(options)


def _client(server: Any) -> Any:
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(server.http_url)


def _generation(client: Any) -> int:
    import tritonclient.http as httpclient

    given = httpclient.InferInput("IN", [1], "INT32")
    given.set_data_from_numpy(np.zeros(1, dtype=np.int32))
    return int(client.infer("slow", [given]).as_numpy("OUT")[0])


def _log(work: Path) -> list[str]:
    return (work / "log").read_text().split()


def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not hold within 30 s")
        time.sleep(0.01)


def _touch(work: Path) -> None:
    """Mark the model's directory changed: Triton reloads a loaded model only then (or with
    a configuration override)."""
    now = time.time_ns() + 1_000_000
    os.utime(work / "models" / "slow" / "1" / "model.py", ns=(now, now))


def _row(client: Any) -> dict[str, str]:
    (row,) = [m for m in client.get_model_repository_index() if m["name"] == "slow"]
    return {k: v for k, v in row.items() if k != "name"}


def _in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # (the test reports it)
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "stub"])
def test_a_model_serves_while_it_reloads(work: Path, in_process: bool) -> None:
    with _server(work, ["slow"], in_process) as server:
        client = _client(server)
        assert _generation(client) == 1
        (work / "hold_init").touch()
        _touch(work)
        thread, errors = _in_thread(lambda: _client(server).load_model("slow"))
        _until(lambda: _log(work).count("init-start") == 2)
        # The new copy is in its initialize: the loaded one still serves.
        assert client.is_model_ready("slow")
        assert _row(client) == {"version": "1", "state": "READY"}
        assert _generation(client) == 1
        (work / "hold_init").unlink()
        thread.join(30)
        assert not errors
        assert _generation(client) == 2
        # The old copy is unloaded once the new one serves.
        _until(lambda: "fin-end" in _log(work))
        assert _log(work) == ["init-start", "init-start", "fin-start", "fin-end"]


def test_a_model_that_fails_to_reload_keeps_serving(work: Path) -> None:
    from tritonclient.utils import InferenceServerException

    with _server(work, ["slow"]) as server:
        client = _client(server)
        config = client.get_model_config("slow")
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("slow", config=json.dumps(config),
                              files={"file:1/model.py": b"raise RuntimeError('broken')\n"})
        assert caught.value.message().startswith("load failed for model 'slow': ")
        assert "broken" in caught.value.message()
        assert client.is_model_ready("slow")
        assert _row(client) == {"version": "1", "state": "READY"}
        assert _generation(client) == 1
        assert _log(work) == ["init-start"]


def test_unload_returns_once_started(work: Path) -> None:
    from tritonclient.utils import InferenceServerException

    with _server(work, ["slow"]) as server:
        client = _client(server)
        (work / "hold_fin").touch()
        client.unload_model("slow")
        # finalize waits for hold_fin: the unload returned before it ended.
        assert "fin-end" not in _log(work)
        assert _row(client) == {"version": "1", "state": "UNLOADING"}
        assert not client.is_model_ready("slow")
        with pytest.raises(InferenceServerException) as caught:
            _generation(client)
        assert caught.value.message() == (
            "Request for unknown model: 'slow' has no available versions")
        # A load meanwhile loads a new copy; the old one's end does not change its state.
        _touch(work)
        client.load_model("slow")
        assert _generation(client) == 2
        (work / "hold_fin").unlink()
        _until(lambda: "fin-end" in _log(work))
        assert _row(client) == {"version": "1", "state": "READY"}
        client.unload_model("slow")
        _until(lambda: _row(client)["state"] != "UNLOADING")
        assert _row(client) == {"version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}


def test_shutdown_waits_for_unloads_in_the_background(work: Path) -> None:
    with _server(work, ["slow"], in_process=False) as server:
        client = _client(server)
        (work / "hold_fin").touch()
        client.unload_model("slow")

        def release() -> None:
            time.sleep(1.0)
            (work / "hold_fin").unlink()

        threading.Thread(target=release, daemon=True).start()
    # The server's close waited for the unload that was still running.
    assert _log(work)[-1] == "fin-end"


def test_loads_of_one_model_run_one_at_a_time(work: Path) -> None:
    with _server(work, []) as server:
        (work / "hold_init").touch()
        first, errors_1 = _in_thread(lambda: _client(server).load_model("slow"))
        _until(lambda: _log(work).count("init-start") == 1)
        _touch(work)  # (the second load finds the model changed: it reloads it)
        second, errors_2 = _in_thread(lambda: _client(server).load_model("slow"))
        time.sleep(0.3)
        # The second load waits for the first (Triton's LockNodes): one initialize at a time.
        assert _log(work) == ["init-start"]
        (work / "hold_init").unlink()
        first.join(30)
        second.join(30)
        assert not errors_1
        assert not errors_2
        # The second load reloaded the model: the first copy was unloaded, one copy serves.
        _until(lambda: "fin-end" in _log(work))
        assert _log(work) == ["init-start", "init-start", "fin-start", "fin-end"]
        assert [m.name for m in server.core.loaded_models()] == ["slow"]
        assert _generation(_client(server)) == 2


def test_a_load_of_an_unchanged_model_changes_nothing(work: Path) -> None:
    # core's InitializeModelInfo: a loaded model whose directory did not change since it
    # loaded is "unmodified", and a load request leaves it as it is (no initialize, the
    # same statistics); a change to its directory and a configuration override each reload
    # it. A plain load after an override keeps the override (upstream's L0_lifecycle
    # test_config_override) until the directory changes.
    with _server(work, ["slow"]) as server:
        client = _client(server)
        assert _generation(client) == 1
        client.load_model("slow")
        assert _log(work) == ["init-start"]
        assert _generation(client) == 1
        stats = client.get_inference_statistics("slow")["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 2
        _touch(work)
        client.load_model("slow")
        assert _generation(client) == 2
        config = client.get_model_config("slow")
        config["parameters"]["note"] = {"string_value": "overridden"}
        client.load_model("slow", config=json.dumps(config))
        assert _generation(client) == 3
        assert client.get_model_config("slow")["parameters"]["note"] == {
            "string_value": "overridden"}
        client.load_model("slow")
        assert _generation(client) == 3
        assert "note" in client.get_model_config("slow")["parameters"]
        _touch(work)
        client.load_model("slow")  # the repository's files changed: they load again
        assert _generation(client) == 4
        assert "note" not in client.get_model_config("slow")["parameters"]


@pytest.fixture(autouse=True)
def _no_hold_left(work: Path) -> Iterator[None]:
    yield
    for name in ("hold_init", "hold_fin"):
        (work / name).unlink(missing_ok=True)


def test_a_model_in_two_repositories_does_not_load(tmp_path: Path) -> None:
    # core's Poll: a model name in two repositories is "not unique across all model
    # repositories": it does not load, and the index says why (upstream's L0_lifecycle
    # test_model_repository_index: UNAVAILABLE, "model appears in two or more
    # repositories"); at start it fails the start (exit-on-error) or is left out.
    from tritonclient.utils import InferenceServerException

    from pb_tensor.serve import Options, ServeError, Server

    first, second = tmp_path / "first", tmp_path / "second"
    for root in (first, second):
        shutil.copytree(Path(EXAMPLES) / "add_sub", root / "add_sub")
    shutil.copytree(Path(EXAMPLES) / "string_identity", first / "string_identity")

    def options(mode: str, exit_on_error: bool) -> Options:
        return Options([str(first), str(second)], http_port=0, grpc_port=0, metrics_port=0,
                       allow_metrics=False, allow_grpc=False, model_control_mode=mode,
                       exit_on_error=exit_on_error, in_process=True)  # fmt: skip

    with pytest.raises(ServeError, match="failed to load all models"), \
            Server(options("none", True)):
        pass
    with Server(options("none", False)) as server:
        client = _client(server)
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["add_sub"] == {"name": "add_sub", "state": "UNAVAILABLE",
                                    "reason": "model appears in two or more repositories"}
        assert index["string_identity"]["state"] == "READY"
    with Server(options("explicit", True)) as server:
        client = _client(server)
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("add_sub")
        assert caught.value.message() == (
            "failed to load 'add_sub', failed to poll from model repository")
        assert not client.is_model_ready("add_sub")
