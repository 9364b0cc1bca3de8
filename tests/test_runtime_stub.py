"""Isolated mode only: stub crashes, hangs and restarts, cleanup of processes and shared
memory, record release, model control from a model."""

from __future__ import annotations

import json
import logging
import os
import shutil
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from runtime_models import EXAMPLES, HEADER, IDENTITY_CONFIG, build_repository

from pb_tensor.runtime import InferenceError, LoadedModel, ModelRepository
from pb_tensor.shm import SHM_DIR
from pb_tensor.utils import TritonError

IN = {"IN": np.array([0, 5], dtype=np.int32)}


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_repository(tmp_path_factory.mktemp("repo"))


def _error(model: LoadedModel, inputs: Mapping[str, object]) -> InferenceError:
    with pytest.raises(InferenceError) as info:
        model.infer(inputs)
    return info.value


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize(("trigger", "what"), [
    (1, "It exited with code 3."), (2, "It was killed by signal 9 (SIGKILL)."),
])  # fmt: skip
def test_stub_crash_is_reported_and_restarted(repo_dir: Path, trigger: int, what: str) -> None:
    with ModelRepository(repo_dir) as r, r.load("crash", timeout=60) as model:
        first = model.pid
        assert first is not None
        err = _error(model, {"IN": np.array([trigger], dtype=np.int32)})
        # Triton's text, then how the stub ended (os._exit(3) / SIGKILL).
        assert err.message() == (
            "Failed to process the request(s) for model instance 'crash_0', message: Stub "
            f"process 'crash_0' is not healthy. {what}"
        )
        assert err.code() == TritonError.INTERNAL
        assert model.pid is None
        assert _gone(first)
        assert model.is_ready() is False  # as Triton's readiness check: stub not healthy
        # The next call starts a new stub (initialize runs again).
        assert model.infer({"IN": np.array([7], np.int32)})["OUT"].tolist() == [7]
        assert model.pid not in (None, first)


def test_stub_timeout_kills_and_restarts(repo_dir: Path) -> None:
    with ModelRepository(repo_dir) as r, r.load("crash", timeout=30) as model:
        first = model.pid
        assert first is not None
        with pytest.raises(InferenceError) as info:
            model.infer({"IN": np.array([3], np.int32)}, timeout=0.5)
        assert info.value.message() == (
            "Failed to process the request(s) for model instance 'crash_0', message: Stub "
            "process 'crash_0' did not respond within the timeout of 0.5 s and was killed."
        )
        assert info.value.code() == TritonError.UNAVAILABLE
        assert _gone(first)
        assert model.infer({"IN": np.array([9], np.int32)})["OUT"].tolist() == [9]


def test_no_leftover_processes_or_shared_memory(repo_dir: Path) -> None:
    with ModelRepository(repo_dir) as r:
        pool_path = os.path.join(SHM_DIR, r.pool.name)
        models = [r.load("raises", timeout=60), r.load("bls_stream", timeout=60)]
        models[1].infer({"IN": np.array([2], np.int32)})  # loads decoupled_repeat for BLS
        pids = [m.pid for m in models]
        assert all(p is not None for p in pids)
        assert os.path.exists(pool_path)
    assert all(_gone(p) for p in pids if p is not None)
    assert not os.path.exists(pool_path)
    assert not models[0].loaded
    assert not models[1].loaded


def test_pool_records_are_released(repo_dir: Path) -> None:
    """Records of finished requests (inputs, outputs, BLS traffic) go back to the pool."""
    with ModelRepository(repo_dir) as r, r.load("bls_stream", timeout=60) as model:
        x = {"IN": np.array([3], dtype=np.int32)}
        model.infer(x)
        model.infer(x)  # the stubs hold the previous replies until their next command
        baseline = r.pool.stats().allocations
        for _ in range(20):
            out = model.infer(x)
            assert out["OUT"].tolist() == [0, 1, 2]
            del out
        assert r.pool.stats().allocations == baseline


def test_large_responses_are_not_pinned_while_idle() -> None:
    with ModelRepository(EXAMPLES) as r, r.load("add_sub", timeout=60) as model:
        small = np.ones(4, np.float32)
        model.infer({"INPUT0": small, "INPUT1": small})
        model.infer({"INPUT0": small, "INPUT1": small})
        baseline = r.pool.stats().allocations
        big = np.ones(1 << 20, np.float32)  # 4 MiB per tensor
        out = model.infer({"INPUT0": big, "INPUT1": big})
        assert out["OUTPUT0"][0] == 2.0
        del out
        # The small requests' inputs and outputs travel inside the messages (see _channel:
        # INLINE_MAX), so they hold no record; the stub now keeps the big request's two
        # input records until its next command. Without another request the stub was told
        # the big outputs were loaded, so once the caller drops them their records are freed
        # (the stub reads the ack while idle): pinned, they would be two allocations more.
        expected = baseline + 2
        deadline = time.monotonic() + 10
        while r.pool.stats().allocations != expected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.pool.stats().allocations == expected


def test_cancel_reaches_a_long_running_execute(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "ticker" / "1").mkdir(parents=True)
    (root / "ticker" / "config.pbtxt").write_text(
        IDENTITY_CONFIG + "model_transaction_policy { decoupled: true }\n"
    )
    (root / "ticker" / "1" / "model.py").write_text(HEADER + textwrap.dedent("""
        class TritonPythonModel:
            def execute(self, requests):
                sender = requests[0].get_response_sender()
                sent = 0
                while not requests[0].is_cancelled() and sent < 20000:
                    sender.send(ok(requests[0], np.array([sent], dtype=np.int32)))
                    sent += 1
                    time.sleep(0.005)
                flag = 1 if requests[0].is_cancelled() else 0
                sender.send(ok(requests[0], np.array([-flag], dtype=np.int32)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
    """))
    with ModelRepository(root) as r, r.load("ticker", timeout=60) as model:
        pid = model.pid
        stream = model.stream({"IN": np.array([0], dtype=np.int32)})
        assert next(stream)["OUT"].tolist() == [0]
        assert next(stream)["OUT"].tolist() == [1]
        # The stub's watcher reads the cancellation while execute runs; the model sees
        # is_cancelled() and finishes. (Otherwise it would run for 100 s, and the runtime
        # would give up waiting after 10 s and kill the stub.)
        stream.close()
        assert model.pid == pid
        first = next(model.stream({"IN": np.array([0], dtype=np.int32)}))
        assert first["OUT"].tolist() == [0]


def test_readiness_of_a_stub_that_died_after_the_liveness_check(
    repo_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The race CI met: the stub passed the liveness check and was gone before the readiness
    # question reached it (the channel's send failed with a broken pipe). Not ready, with
    # python_backend's text; before, the channel's error escaped from is_ready(). (A model
    # with an is_ready() of its own: without one, a check asks the stub nothing.)
    from pb_tensor.runtime._channel import ChannelClosed

    caplog.set_level(logging.DEBUG, logger="pb_tensor.runtime")
    with ModelRepository(repo_dir) as r, r.load("readiness", timeout=60) as model:
        pid = model.pid
        assert pid is not None
        (instance,) = model._instances
        channel = instance.engine.channel
        assert channel is not None

        def broken(kind: str, body: object = None, tensors: object = ()) -> None:
            raise ChannelClosed("[Errno 32] Broken pipe")

        os.kill(pid, 9)
        monkeypatch.setattr(channel, "send", broken)
        assert model.is_ready() is False
    assert any(
        r.getMessage().startswith("Model 'readiness' version 1 is not ready: Stub process ")
        and "is not healthy" in r.getMessage() for r in caplog.records
    )


def test_records_of_a_background_thread_come_as_they_are_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A model's thread logs after its request ended; nothing else reaches the stub. The
    # record shows anyway (python_backend's parent reads its stub's messages on a thread of
    # its own); before, it came with the stub's next message.
    model_dir = tmp_path / "background"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text('name: "background"\n' + IDENTITY_CONFIG)
    (model_dir / "1" / "model.py").write_text(HEADER + textwrap.dedent("""
        import threading
        class TritonPythonModel:
            def execute(self, requests):
                def later():
                    time.sleep(0.3)
                    pb_utils.Logger.log_warn("a record from the background")
                threading.Thread(target=later).start()
                return [ok(r) for r in requests]
    """))
    caplog.set_level(logging.WARNING, logger="pb_tensor.runtime")
    with ModelRepository(tmp_path) as r, r.load("background", timeout=60) as model:
        model.infer({"IN": np.array([1], np.int32)})
        deadline = time.monotonic() + 30
        while "a record from the background" not in caplog.text:
            assert time.monotonic() < deadline, "the record did not come"
            time.sleep(0.02)


def test_model_control_from_a_model(tmp_path: Path, repo_dir: Path) -> None:
    # pb_utils.is_model_ready raises for a model that is not loaded, as Triton's does (core's
    # GetModel error; upstream's qa bls_model_loading catches it), and every failed call
    # carries upstream's stub prefix naming the calling instance.
    root = tmp_path / "repo"
    shutil.copytree(repo_dir / "identity", root / "identity")
    (root / "control" / "1").mkdir(parents=True)
    (root / "control" / "config.pbtxt").write_text(IDENTITY_CONFIG)
    (root / "control" / "1" / "model.py").write_text(HEADER + textwrap.dedent("""
        import json

        class TritonPythonModel:
            def execute(self, requests):
                seen = []
                def ready(name, version=""):
                    try:
                        seen.append(pb_utils.is_model_ready(name, version))
                    except pb_utils.TritonModelException as exc:
                        seen.append(str(exc))
                def control(call, *args):
                    try:
                        call(*args)
                        seen.append("ok")
                    except pb_utils.TritonModelException as exc:
                        seen.append(str(exc))
                ready("identity")
                control(pb_utils.load_model, "identity")
                ready("identity")
                ready("identity", "1")
                ready("identity", "2")
                ready("identity", "one")
                ready("identity", "-1")
                control(pb_utils.unload_model, "identity")
                ready("identity")
                control(pb_utils.load_model, "no_such_model")
                out = np.frombuffer(json.dumps(seen).encode(), dtype=np.uint8).astype(np.int32)
                return [ok(r, out) for r in requests]
    """))
    prefix = "Failed to process the request for model 'control_0', message: "
    ready = "Failed to check model readiness: " + prefix
    expected = [
        ready + "Request for unknown model: 'identity' is not found",
        "ok",
        True,
        True,
        ready + "Request for unknown model: 'identity' version 2 is not found",
        ready + "failed to get model version from specified version string 'one' (details: "
        "stol), version should be an integral value > 0",
        ready + "failed to get model version from specified version string '-1', version "
        "should be an integral value > 0",
        "ok",
        ready + "Request for unknown model: 'identity' has no available versions",
        "Failed to load model: " + prefix + "failed to load 'no_such_model', failed to poll "
        "from model repository",
    ]  # fmt: skip
    for isolated in (False, True):
        with ModelRepository(root) as r, r.load("control", isolated=isolated, timeout=60) as model:
            got = model.infer(IN)["OUT"].astype(np.uint8).tobytes().decode()
            assert json.loads(got) == expected, isolated


def test_stub_exits_when_parent_dies(run_python: object) -> None:
    code = f"""
import os, sys
from pb_tensor.runtime import ModelRepository
repo = ModelRepository({str(EXAMPLES)!r})
model = repo.load("add_sub")
print(model.pid, repo.pool.name, flush=True)
os._exit(0)
"""
    result = run_python(code, timeout=60)  # type: ignore[operator]
    assert result.returncode == 0, result.stderr
    pid_text, pool_name = result.stdout.split()
    pid = int(pid_text)
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)
    # The creator died without closing the pool: its segment is left for the OS to reclaim
    # only by name, so remove it here to keep /dev/shm clean.
    path = os.path.join(SHM_DIR, pool_name)
    if os.path.lexists(path):  # a sealed pool's name is a link to the dead creator's fd
        os.unlink(path)
