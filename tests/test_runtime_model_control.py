"""``pb_utils.load_model`` / ``unload_model`` from a model run by the runtime alone (no
server) as Triton's model control: a load of a model that is loaded and unchanged changes
nothing; a changed one loads its new copy while the old one serves, and the old one goes
on serving when the new one fails to load; an unload returns once started (the model takes
no new request, its ``finalize`` runs in the background); closing the repository waits for
it. Core's ``ModelLifeCycle`` / ``ModelRepositoryManager`` (upstream's ``qa/L0_lifecycle``)."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from runtime_models import HEADER, IDENTITY_CONFIG

from pb_tensor.runtime import ModelRepository

# The target answers with its copy's generation (the count of initialize calls in a log)
# and logs its finalize, which waits while a "hold" file exists (20 s at most).
_TARGET = HEADER + textwrap.dedent("""
    # (<root>/models/target/1/model.py: the log is in <root>)
    DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

    def _log(what):
        with open(os.path.join(DIR, "log"), "a") as f:
            f.write(what + "\\n")

    class TritonPythonModel:
        def initialize(self, args):
            _log("init")
            with open(os.path.join(DIR, "log")) as f:
                self.generation = f.read().split().count("init")

        def execute(self, requests):
            return [ok(r, np.array([self.generation], dtype=np.int32)) for r in requests]

        def finalize(self):
            _log("fin-start")
            deadline = time.monotonic() + 20
            while os.path.exists(os.path.join(DIR, "hold")) and time.monotonic() < deadline:
                time.sleep(0.01)
            _log("fin-end")
""")

# Runs the calls its request names (JSON in IN's bytes) and answers with what each gave.
_CALLER = HEADER + textwrap.dedent("""
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for request in requests:
                calls = json.loads(value(request).astype(np.uint8).tobytes().decode())
                seen = []
                for call in calls:
                    try:
                        if call == "bls":
                            answer = pb_utils.InferenceRequest(
                                model_name="target", requested_output_names=["OUT"],
                                inputs=[pb_utils.Tensor("IN", np.array([0], np.int32))],
                            ).exec()
                            if answer.has_error():
                                seen.append(answer.error().message())
                            else:
                                seen.append(int(pb_utils.get_output_tensor_by_name(
                                    answer, "OUT").as_numpy()[0]))
                        elif call == "ready":
                            seen.append(pb_utils.is_model_ready("target"))
                        else:
                            getattr(pb_utils, call)("target")
                            seen.append("ok")
                    except pb_utils.TritonModelException as exc:
                        seen.append(str(exc))
                data = np.frombuffer(json.dumps(seen).encode(), dtype=np.uint8)
                out.append(ok(request, data.astype(np.int32)))
            return out
""")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for name, code in (("target", _TARGET), ("caller", _CALLER)):
        (tmp_path / "models" / name / "1").mkdir(parents=True)
        (tmp_path / "models" / name / "config.pbtxt").write_text(IDENTITY_CONFIG)
        (tmp_path / "models" / name / "1" / "model.py").write_text(code)
    (tmp_path / "log").write_text("")
    return tmp_path


def _calls(caller: object, *calls: str) -> list[object]:
    data = np.frombuffer(json.dumps(list(calls)).encode(), dtype=np.uint8).astype(np.int32)
    out = caller.infer({"IN": data})["OUT"]  # type: ignore[attr-defined]
    answer: list[object] = json.loads(out.astype(np.uint8).tobytes().decode())
    return answer


def _touch(root: Path) -> None:
    now = time.time_ns() + 1_000_000
    os.utime(root / "models" / "target" / "1" / "model.py", ns=(now, now))


def _log(root: Path) -> list[str]:
    return (root / "log").read_text().split()


def _until_logged(root: Path, what: str) -> None:
    deadline = time.monotonic() + 30
    while what not in _log(root) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert what in _log(root)


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "stub"])
def test_load_reloads_only_what_changed(root: Path, isolated: bool) -> None:
    with ModelRepository(root / "models") as repo:
        caller = repo.load("caller", isolated=isolated, timeout=60)
        assert _calls(caller, "load_model", "bls", "load_model", "bls") == ["ok", 1, "ok", 1]
        assert _log(root) == ["init"]
        _touch(root)
        assert _calls(caller, "load_model", "bls") == ["ok", 2]
        _until_logged(root, "fin-end")  # the old copy went once the new one served
        assert _log(root) == ["init", "init", "fin-start", "fin-end"]


def test_a_failed_reload_keeps_the_loaded_copy(root: Path) -> None:
    with ModelRepository(root / "models") as repo:
        caller = repo.load("caller", isolated=False)
        assert _calls(caller, "load_model", "bls") == ["ok", 1]
        model_py = root / "models" / "target" / "1" / "model.py"
        model_py.write_text("raise RuntimeError('broken')\n")
        _touch(root)
        got = _calls(caller, "load_model", "bls", "ready")
        assert str(got[0]).startswith("Failed to load model: Failed to process the request "
                                      "for model 'caller_0', message: load failed for model "
                                      "'target': ")  # fmt: skip
        assert "broken" in str(got[0])
        assert got[1:] == [1, True]
        assert _log(root) == ["init"]


def test_unload_returns_once_started(root: Path) -> None:
    (root / "hold").touch()
    try:
        with ModelRepository(root / "models") as repo:
            caller = repo.load("caller", isolated=False)
            got = _calls(caller, "load_model", "unload_model", "ready")
            # finalize waits for the hold file: the unload returned before it ended, and the
            # model was no longer ready.
            assert got[:2] == ["ok", "ok"]
            assert str(got[2]).endswith(
                "Request for unknown model: 'target' has no available versions")
            assert "fin-end" not in _log(root)
            (root / "hold").unlink()
            _until_logged(root, "fin-end")
    finally:
        (root / "hold").unlink(missing_ok=True)


def test_close_waits_for_unloads_in_the_background(root: Path) -> None:
    (root / "hold").touch()
    with ModelRepository(root / "models") as repo:
        caller = repo.load("caller", isolated=True, timeout=60)
        assert _calls(caller, "load_model", "unload_model") == ["ok", "ok"]
        import threading

        def release() -> None:
            time.sleep(1.0)
            (root / "hold").unlink()

        threading.Thread(target=release, daemon=True).start()
    assert _log(root)[-1] == "fin-end"


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "stub"])
def test_load_updates_instances_in_place(root: Path, isolated: bool) -> None:
    """A load after a change of ``instance_group`` alone updates the loaded copy's instances
    (core's ``UpdateInstanceGroup``): the new instance initializes, the first one keeps
    serving (no reload, no finalize); the model's files changing reloads it again."""
    config = root / "models" / "target" / "config.pbtxt"
    with ModelRepository(root / "models") as repo:
        caller = repo.load("caller", isolated=isolated, timeout=60)
        assert _calls(caller, "load_model", "bls") == ["ok", 1]
        config.write_text(IDENTITY_CONFIG + "instance_group [ { count: 2 kind: KIND_CPU } ]\n")
        now = time.time_ns() + 1_000_000
        os.utime(config, ns=(now, now))
        assert _calls(caller, "load_model", "load_model") == ["ok", "ok"]
        assert _log(root) == ["init", "init"]
        assert set(_calls(caller, *["bls"] * 8)) <= {1, 2}
        _touch(root)
        assert _calls(caller, "load_model") == ["ok"]
        _until_logged(root, "fin-end")
        assert _log(root)[:4] == ["init", "init", "init", "init"]
