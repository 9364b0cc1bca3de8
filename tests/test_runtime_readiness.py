"""A model's readiness as python_backend checks it (``TRITONBACKEND_ModelInstanceReady``):
the check runs beside the model's requests, waits at most five seconds for ``is_ready()``,
and a check asked while one is in flight waits for that one's answer; ``pb_utils.is_model_ready``
asks the same check (``TRITONSERVER_ServerModelIsReady``), a model asking about itself from
``execute`` included."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from runtime_models import write_model

from pb_tensor.runtime import LoadedModel, ModelRepository
from pb_tensor.runtime._readiness import ReadinessCheck, ReadyState

# -- the check itself, with a recording probe ----------------------------------------------------


class _Probe:
    """An engine's side of the check: answers ``is_ready()`` when the test says so."""

    def __init__(self, unhealthy: str | None = None, user: bool = True) -> None:
        self.unhealthy = unhealthy
        self.user = user
        self.asked = 0
        self.answer: ReadyState | None = (True, None)  # None: not within the timeout
        self.later: Callable[[ReadyState], None] | None = None

    def health(self) -> str | None:
        return self.unhealthy

    @property
    def user_readiness(self) -> bool:
        return self.user

    def ask_ready(self, timeout: float, later: Callable[[ReadyState], None]) -> ReadyState | None:
        self.asked += 1
        self.later = later
        return self.answer


def test_health_and_a_model_without_is_ready_ask_nothing() -> None:
    check = ReadinessCheck()
    dead = _Probe(unhealthy="Stub process 'm_0' is not healthy.")
    assert check.check(dead, "m_0") == "Stub process 'm_0' is not healthy."
    plain = _Probe(user=False)
    assert check.check(plain, "m_0") is None
    assert (dead.asked, plain.asked) == (0, 0)


@pytest.mark.parametrize(
    ("answer", "why"),
    [((True, None), None),
     ((False, None), "Model 'm_0' is not ready (user-defined check failed)."),
     ((False, "is_ready() must return a boolean value"), "is_ready() must return a boolean value")],
)  # fmt: skip
def test_answers(answer: ReadyState, why: str | None) -> None:
    probe = _Probe()
    probe.answer = answer
    assert ReadinessCheck().check(probe, "m_0") == why


def test_a_late_answer_goes_to_the_checks_waiting_for_it() -> None:
    check = ReadinessCheck(timeout=5.0)
    probe = _Probe()
    probe.answer = None  # the model took longer than the timeout
    assert check.check(probe, "m_0") == "Timed out waiting for user-defined is_ready() response"
    got: list[str | None] = []
    waiter = threading.Thread(target=lambda: got.append(check.check(probe, "m_0")))
    waiter.start()
    deadline = time.monotonic() + 10
    while check._cond._waiters == 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)  # (until the second check waits for the first one's answer)
    assert probe.later is not None
    probe.later((True, None))
    waiter.join(10)
    assert got == [None]
    assert probe.asked == 1  # the second check asked the model nothing


def test_a_check_waiting_too_long_for_the_one_in_flight() -> None:
    check = ReadinessCheck(timeout=0.05)
    probe = _Probe()
    probe.answer = None
    check.check(probe, "m_0")
    assert check.check(probe, "m_0") == "Timed out waiting for in-flight is_ready() response"
    assert probe.later is not None
    probe.later((False, None))  # the answer, at last: the next check asks again
    probe.answer = (True, None)
    assert check.check(probe, "m_0") is None
    assert probe.asked == 2


# -- models ---------------------------------------------------------------------------------------

_MODELS = {
    # execute waits for the test's release file (bounded): a readiness check must not wait
    # for it. is_ready() answers what the "state" file says.
    "blocked": """
        class TritonPythonModel:
            def initialize(self, args):
                self.dir = args["model_repository"]
            def is_ready(self):
                path = os.path.join(self.dir, "state")
                if not os.path.exists(path):
                    return True
                with open(path) as f:
                    return f.read() == "ready"
            def execute(self, requests):
                open(os.path.join(self.dir, "started"), "w").close()
                deadline = time.monotonic() + 30
                while not os.path.exists(os.path.join(self.dir, "release")):
                    if time.monotonic() > deadline:  # never released: answer -1
                        return [ok(r, np.array([-1], np.int32)) for r in requests]
                    time.sleep(0.01)
                return [ok(r) for r in requests]
    """,
    # asks about itself and about "plain" from execute (pb_utils.is_model_ready)
    "asks": """
        class TritonPythonModel:
            def initialize(self, args):
                self.answer = True
            def is_ready(self):
                return self.answer
            def execute(self, requests):
                out = []
                for r in requests:
                    self.answer = bool(value(r)[0])
                    seen = [pb_utils.is_model_ready("asks"), pb_utils.is_model_ready("plain")]
                    out.append(ok(r, np.array(seen, dtype=np.int32)))
                return out
    """,
    "plain": """
        class TritonPythonModel:
            def execute(self, requests):
                return [ok(r) for r in requests]
    """,
    # is_ready() calls sys.exit: not ready, with the error (pybind11 catches any exception)
    "exits": """
        class TritonPythonModel:
            def is_ready(self):
                sys.exit(3)
            def execute(self, requests):
                return [ok(r) for r in requests]
    """,
    # is_ready() answers after 5.5 s, past python_backend's five-second limit
    "slow": """
        class TritonPythonModel:
            def is_ready(self):
                time.sleep(5.5)
                return True
            def execute(self, requests):
                return [ok(r) for r in requests]
    """,
}


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("readiness")
    for name, code in _MODELS.items():
        write_model(root, name, code)
    return root


@pytest.fixture(params=[False, True], ids=["in_process", "isolated"])
def repo(request: pytest.FixtureRequest, repo_dir: Path) -> Iterator[tuple[ModelRepository, bool]]:
    with ModelRepository(repo_dir) as r:
        yield r, request.param


def _load(repo: tuple[ModelRepository, bool], name: str) -> LoadedModel:
    r, isolated = repo
    return r.load(name, isolated=isolated, timeout=60)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_a_check_runs_beside_a_running_execute(
    repo: tuple[ModelRepository, bool], repo_dir: Path
) -> None:
    # The model's one instance runs a request that waits for the test; the checks answer
    # meanwhile (before, they waited for the instance to be idle).
    base = repo_dir / "blocked"
    for name in ("started", "release", "state"):
        (base / name).unlink(missing_ok=True)
    with _load(repo, "blocked") as model:
        results: list[dict[str, np.ndarray]] = []
        caller = threading.Thread(
            target=lambda: results.append(model.infer({"IN": np.array([4], np.int32)}))
        )
        caller.start()
        try:
            _wait_for(base / "started")
            assert model.is_ready() is True
            (base / "state").write_text("not ready")
            assert model.is_ready() is False
            assert model.not_ready_reason() == (
                "Model 'blocked_0' is not ready (user-defined check failed)."
            )
            assert not (base / "release").exists()  # execute still running all along
        finally:
            (base / "release").write_text("")
            caller.join(60)
        # released by the test (not the model's own deadline): the checks did not wait
        assert [r["OUT"].tolist() for r in results] == [[4]]


def test_is_model_ready_asks_the_models_check(repo: tuple[ModelRepository, bool]) -> None:
    # TRITONSERVER_ServerModelIsReady: the model's own is_ready() counts, for a model asking
    # about itself from its execute too (its one instance runs that request).
    with _load(repo, "asks") as model:
        _load(repo, "plain")
        assert model.infer({"IN": np.array([1], np.int32)})["OUT"].tolist() == [1, 1]
        assert model.infer({"IN": np.array([0], np.int32)})["OUT"].tolist() == [0, 1]
        assert model.is_ready() is False


def test_an_answer_past_five_seconds(
    repo: tuple[ModelRepository, bool], caplog: pytest.LogCaptureFixture
) -> None:
    # upstream's test_is_ready_takes_long_time, once: not ready when is_ready() takes longer
    # than five seconds; requests run meanwhile; the next check waits for the answer in
    # flight (asking the model nothing) and gets its True.
    caplog.set_level(logging.DEBUG, logger="pb_tensor.runtime")
    with _load(repo, "slow") as model:
        assert model.is_ready() is False
        assert caplog.records[-1].getMessage() == (
            "Model 'slow' version 1 is not ready: Timed out waiting for user-defined "
            "is_ready() response"
        )
        assert model.infer({"IN": np.array([2], np.int32)})["OUT"].tolist() == [2]
        assert model.is_ready() is True


def test_an_is_ready_that_exits(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "exits") as model:
        for _ in range(2):  # (the check answers again: its thread lives on)
            why = model.not_ready_reason()
            assert why is not None
            assert why.startswith("SystemExit: 3"), why
        assert model.infer({"IN": np.array([5], np.int32)})["OUT"].tolist() == [5]
