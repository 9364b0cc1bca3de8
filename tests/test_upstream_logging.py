"""Upstream's logging tests against ``pb-tensor serve``, as their ``test.sh`` scripts run them:

* ``qa/L0_logging/logging_endpoint_test.py`` (unchanged): the logging extension over HTTP and
  gRPC, its settings read and changed one by one, ``log_file`` refused; ``test.sh``'s
  ``check_test_results`` (four tests, none failed).
* ``qa/L0_backend_python/logging`` (``logging_test.py`` unchanged, ``identity_fp32_logging``
  from ``qa/python_models``): a model logging each level in ``initialize``, ``execute`` (twice)
  and ``finalize``; ``test.sh`` counts the lines of each in the server's log after three
  runs: default settings (four of each, no verbose one), the verbose level raised through
  ``/v2/logging`` (three verbose ones: ``initialize``'s was before), info, warning and error
  switched off (only ``initialize``'s lines).
* ``qa/L0_logging/test.sh``'s output streams: info records on standard output only,
  warnings and errors on standard error only, in tritonserver's line format (its regular
  expression).

``logging_test.py`` uses ``qa/common/shm_util.py``, whose leak probe reads Triton's own
shared-memory regions through a compiled module; it runs with ``TEST_JETSON=1``, upstream's
switch that skips that probe (pb-tensor's pool is no such region; its own leak checks are in
the runtime's tests). The servers run on the ports the tests hard-code (8000-8002: skipped
when they are taken).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from serve_support import (
    needs_serve,
    qa_common,
    raw,
    run_upstream_client,
    serve_process,
    skip_unless_upstream_ports,
)
from upstream_models import UPSTREAM

pytestmark = needs_serve

_QA = UPSTREAM / "server" / "qa"
_MODEL = _QA / "python_models" / "identity_fp32_logging"


def _layout(work: Path) -> Path:
    """Upstream's qa tree as the tests find their ``../common`` (``../../common``)."""
    qa = work / "qa"
    qa_common(qa)
    (qa / "L0_logging").mkdir()
    shutil.copy(_QA / "L0_logging" / "logging_endpoint_test.py", qa / "L0_logging")
    (qa / "L0_backend_python" / "logging").mkdir(parents=True)
    shutil.copy(_QA / "L0_backend_python" / "logging" / "logging_test.py",
                qa / "L0_backend_python" / "logging")  # fmt: skip
    models = work / "models" / "identity_fp32_logging"
    (models / "1").mkdir(parents=True)
    shutil.copy(_MODEL / "config.pbtxt", models / "config.pbtxt")
    shutil.copy(_MODEL / "model.py", models / "1" / "model.py")
    return qa


@contextmanager
def _server(work: Path, log: Path, mode: str, *extra: str,
            err: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """``run_server`` / ``kill_server``: the server's output in ``log`` (its standard error
    in ``err`` when given)."""
    skip_unless_upstream_ports("upstream's logging tests")
    args = [f"--model-repository={work / 'models'}", *extra]
    if mode == "in-process":
        args.append("--in-process")
    with serve_process(args, log, err=err) as server:
        yield server


def test_logging_endpoint(tmp_path: Path) -> None:
    qa = _layout(tmp_path)
    with _server(tmp_path, tmp_path / "server.log", "stub processes"):
        report = run_upstream_client(qa / "L0_logging", "logging_endpoint_test.py")
    # test.sh: check_test_results $TEST_RESULT_FILE $EXPECTED_NUM_TESTS (4)
    results = json.loads((qa / "L0_logging" / "test_results.txt").read_text())
    assert results == {"total": 4, "errors": 0, "failures": 0}, report


def _counts(log: Path) -> tuple[int, int, int, int, int]:
    """test.sh's ``verify_log_counts``: the lines with each message (grep -c)."""
    lines = log.read_text(errors="replace").splitlines()
    return tuple(  # type: ignore[return-value]
        sum(text in line for line in lines)
        for text in ("Specific Msg!", "Info Msg!", "Warning Msg!", "Error Msg!", "Verbose Msg!")
    )


@pytest.mark.parametrize("mode", ["stub processes", "in-process"])
def test_python_model_logging(tmp_path: Path, mode: str) -> None:
    qa = _layout(tmp_path)
    here = qa / "L0_backend_python" / "logging"
    test = ("-m", "pytest", "-p", "no:cacheprovider", "logging_test.py")

    log = tmp_path / "default.log"
    with _server(tmp_path, log, mode):
        run_upstream_client(here, *test)
    assert _counts(log) == (4, 4, 4, 4, 0), log.read_text()

    log = tmp_path / "verbose.log"
    with _server(tmp_path, log, mode):
        status, _, body = raw("localhost:8000", "POST", "/v2/logging",
                              b'{"log_verbose_level":1}')  # fmt: skip
        assert status == 200, body
        run_upstream_client(here, *test)
    assert _counts(log) == (4, 4, 4, 4, 3), log.read_text()

    log = tmp_path / "disabled.log"
    with _server(tmp_path, log, mode):
        for name in ("log_info", "log_warning", "log_error"):
            status, _, body = raw("localhost:8000", "POST", "/v2/logging",
                                  json.dumps({name: False}).encode())  # fmt: skip
            assert status == 200, body
        run_upstream_client(here, *test)
    assert _counts(log) == (1, 1, 1, 1, 0), log.read_text()


# qa/L0_logging/test.sh's LOG_REGEX, after the level letter
_LOG_REGEX = (r"(?P<month>\d{2})(?P<day>\d{2}) (?P<timestamp>\d{2}:\d{2}:\d{2}\.\d{6}) "
              r"(?P<pid>\d+) (?P<file>[\w\.]+):(?P<line>\d+)] (?P<message>.*)")  # fmt: skip


def test_info_on_standard_output_warnings_and_errors_on_standard_error(tmp_path: Path) -> None:
    # test.sh's "Log Output Stream" check, with a model that logs every level
    _layout(tmp_path)
    out, err = tmp_path / "server.log", tmp_path / "server_error.log"
    with _server(tmp_path, out, "stub processes", "--log-verbose=1", err=err):
        run_upstream_client(tmp_path / "qa" / "L0_backend_python" / "logging", "-m", "pytest",
             "-p", "no:cacheprovider", "logging_test.py")  # fmt: skip
    stdout, stderr = out.read_text(), err.read_text()
    assert re.search(f"^I{_LOG_REGEX}", stdout, re.M), stdout
    assert not re.search(f"^(W|E){_LOG_REGEX}", stdout, re.M), stdout
    assert re.search(f"^(W|E){_LOG_REGEX}", stderr, re.M), stderr
    assert not re.search(f"^I{_LOG_REGEX}", stderr, re.M), stderr
    # the records' own places: the model's file and line, its message escaped as JSON
    assert re.search(r'^E\d{4} [\d:.]+ \d+ model\.py:\d+\] "Execute-Error Msg!"$', stderr, re.M)
