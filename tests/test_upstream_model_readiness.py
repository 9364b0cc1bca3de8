"""Upstream's ``qa/L0_backend_python/model_readiness`` (``test_model_readiness.py``,
unchanged) against ``pb-tensor serve``, as its ``test.sh`` runs it.

Two parts, each as ``test.sh`` lays out its repository and starts its server (with
``--log-verbose=1``; the second with ``--strict-readiness=false``, as the repository holds
models that are not ready on purpose):

* ``TestModelReadiness``: ``identity_fp32`` is ready and answers; its stub process killed
  with SIGSEGV / SIGKILL, it is not ready over HTTP and gRPC, and the server's log has core's
  line for each of the two checks (``test.sh`` counts them).
* ``TestUserDefinedModelReadinessFunction``: models whose ``is_ready()`` returns True,
  False, raises, returns a non-bool, is a coroutine, takes eight seconds (longer than
  python_backend's five-second limit: not ready, then the next check waits for the one in
  flight and gets its True), and a decoupled model checked while it streams; readiness
  checks beside inference requests. ``test_is_ready_takes_long_time`` runs its ten rounds
  of eight seconds with stub processes only; in-process runs the class without it.

The server runs on the ports the test hard-codes (8000-8002: skipped when they are taken).
``tests/test_upstream_qa.py`` checks the same models through the runtime's API.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from serve_support import children, needs_serve, serve_process, skip_unless_upstream_ports
from upstream_models import READINESS_MODELS, UPSTREAM

pytestmark = needs_serve

_QA = UPSTREAM / "server" / "qa"
_HERE = _QA / "L0_backend_python" / "model_readiness"
_TEST = _HERE / "test_model_readiness.py"
_IDENTITY = _QA / "python_models" / "identity_fp32"

_USER_CASES = [
    "test_multiple_concurrent_ready_and_infer_requests_decoupled",
    "test_is_ready_coroutine_returns_true",
    "test_is_ready_returns_true",
    "test_is_ready_returns_false",
    "test_is_ready_raises_exception",
    "test_is_ready_returns_non_boolean",
    "test_multiple_concurrent_ready_and_infer_requests",
]
_LONG_CASE = "test_is_ready_takes_long_time"


def _identity(models: Path) -> None:
    target = models / "identity_fp32"
    (target / "1").mkdir(parents=True)
    shutil.copy(_IDENTITY / "model.py", target / "1" / "model.py")
    shutil.copy(_IDENTITY / "config.pbtxt", target / "config.pbtxt")


def _readiness_model(models: Path, name: str, value: str, delay: str) -> None:
    """test.sh's ``setup_readiness_test_model``."""
    target = models / name
    (target / "1").mkdir(parents=True)
    source = ("readiness_coroutine_model.py" if name == "is_ready_fn_coroutine_returns_true"
              else "readiness_model.py")  # fmt: skip
    shutil.copy(_HERE / "test_models" / source, target / "1" / "model.py")
    text = (models / "identity_fp32" / "config.pbtxt").read_text()
    text = re.sub(r"(?m)^name:.*", f'name: "{name}"', text)  # sed "s/^name:.*/.../"
    text += (
        'parameters: {\n  key: "READINESS_FN_RETURN_VALUE"\n'
        f'  value: {{ string_value: "{value}" }}\n}}\n'
        'parameters: {\n  key: "READINESS_FN_DELAY_SECS"\n'
        f'  value: {{ string_value: "{delay}" }}\n}}\n'
    )
    (target / "config.pbtxt").write_text(text)


@contextmanager
def _server(work: Path, log: Path, mode: str, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    skip_unless_upstream_ports("test_model_readiness.py")
    args = [f"--model-repository={work / 'models'}", "--log-verbose=1", *extra]
    if mode == "in-process":
        args.append("--in-process")
    with serve_process(args, log) as server:
        yield server


def _unittest(work: Path, *names: str, timeout: float = 600) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "unittest", *(f"test_model_readiness.{n}" for n in names), "-v"],
        cwd=work, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    return report


def _stub_pids(server_pid: int) -> list[int]:
    """The server's stub processes (test.sh: ``pgrep -f triton_python_backend_stub``)."""
    found = []
    for pid in children(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pb_tensor.runtime._stub" in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the stub process in /proc")
@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGKILL], ids=["11", "9"])
def test_not_ready_after_the_stub_was_killed(tmp_path: Path, signum: int) -> None:
    _identity(tmp_path / "models")
    shutil.copy(_TEST, tmp_path / _TEST.name)
    log = tmp_path / "server.log"
    with _server(tmp_path, log, "stub processes") as server:
        _unittest(tmp_path, "TestModelReadiness.test_model_ready")
        (stub,) = _stub_pids(server.pid)
        os.kill(stub, signum)
        time.sleep(1)
        _unittest(tmp_path, "TestModelReadiness.test_model_not_ready")
    # test.sh: two lines of core's (the HTTP check's and the gRPC one's) in the verbose log
    expected = ("Model 'identity_fp32' version 1 is not ready: Stub process "
                "'identity_fp32_0_0' is not healthy.")  # fmt: skip
    lines = log.read_text(errors="replace").splitlines()
    assert sum(expected in line for line in lines) == 2, log.read_text()


@pytest.mark.parametrize("mode", ["stub processes", "in-process"])
def test_user_defined_readiness_function(tmp_path: Path, mode: str) -> None:
    models = tmp_path / "models"
    _identity(models)
    for name, (value, delay) in READINESS_MODELS.items():
        _readiness_model(models, name, value, delay)
    shutil.copytree(_HERE / "test_models" / "is_ready_fn_returns_true_decoupled",
                    models / "is_ready_fn_returns_true_decoupled")  # fmt: skip
    (models / "is_ready_fn_returns_true_decoupled" / "1").mkdir()
    shutil.move(str(models / "is_ready_fn_returns_true_decoupled" / "model.py"),
                str(models / "is_ready_fn_returns_true_decoupled" / "1" / "model.py"))  # fmt: skip
    shutil.copy(_TEST, tmp_path / _TEST.name)
    cases = _USER_CASES + ([_LONG_CASE] if mode == "stub processes" else [])
    with _server(tmp_path, tmp_path / "server.log", mode, "--strict-readiness=false"):
        report = _unittest(tmp_path, *(f"TestUserDefinedModelReadinessFunction.{c}"
                                       for c in cases))  # fmt: skip
    assert f"Ran {len(cases)} tests" in report, report
    assert re.search(r"^OK$", report, re.M), report
