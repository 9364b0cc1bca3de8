"""Upstream's ``qa/L0_backend_python/lifecycle`` (``lifecycle_test.py``, unchanged) against
``pb-tensor serve``, as its ``test.sh`` runs it.

``test.sh`` lays out seven of ``qa/python_models`` (``execute_error`` and
``execute_grpc_error`` with a dynamic batcher, ``wrong_model`` with ``TYPE_UINT32``), starts
the server with ``--log-verbose=1`` and its log in ``lifecycle_server.log`` (the test reads it),
and runs the file: Triton's error codes over gRPC, a request cancelled while it runs, one
failed request of a batch that does not fail the others, the failure metric with reason
``BACKEND``, and streams opened with the ``triton_grpc_error: true`` header, which end with
the first error a request meets (a decoupled model's error response without the final flag,
and one followed by a late final flag, included) and stay open without it.

``lifecycle_test.py`` uses ``qa/common/shm_util.py``, whose leak probe reads Triton's own
shared-memory regions through a compiled module; it runs with ``TEST_JETSON=1``, upstream's
switch that skips that probe (pb-tensor's pool is no such region). The server runs on the
ports the test hard-codes (8000-8002: skipped when they are taken).
``tests/test_upstream_qa.py`` checks the same models through the runtime's API.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from serve_support import (
    needs_serve,
    qa_common,
    run_upstream_client,
    upstream_server,
)
from upstream_models import UPSTREAM

pytestmark = needs_serve

_QA = UPSTREAM / "server" / "qa"
_MODELS = _QA / "python_models"
_TEST = _QA / "L0_backend_python" / "lifecycle" / "lifecycle_test.py"
_CASES = 9  # the test methods of lifecycle_test.py


def _model(models: Path, name: str, *edits: tuple[str, str], extra: str = "") -> None:
    """test.sh's ``mkdir -p models/<name>/1/; cp ...`` and its ``sed -i`` edits."""
    (models / name / "1").mkdir(parents=True)
    shutil.copy(_MODELS / name / "model.py", models / name / "1" / "model.py")
    text = (_MODELS / name / "config.pbtxt").read_text()
    for pattern, replacement in edits:
        text = re.sub(pattern, replacement, text, flags=re.M)
    (models / name / "config.pbtxt").write_text(text + extra)


def _layout(work: Path) -> Path:
    """The test's directory, as upstream's tree has it (``../../common`` beside it)."""
    qa_common(work)
    here = work / "L0_backend_python" / "lifecycle"
    here.mkdir(parents=True)
    shutil.copy(_TEST, here / _TEST.name)
    models = here / "models"
    _model(models, "error_code")
    _model(models, "execute_cancel")
    _model(models, "execute_error", (r"^name:.*", 'name: "execute_error"'),
           (r"^max_batch_size:.*", "max_batch_size: 8"),
           extra="dynamic_batching { preferred_batch_size: [8], "
                 "max_queue_delay_microseconds: 12000000 }\n")  # fmt: skip
    _model(models, "execute_grpc_error", (r"^name:.*", 'name: "execute_grpc_error"'),
           (r"^max_batch_size:.*", "max_batch_size: 8"),
           extra="dynamic_batching { preferred_batch_size: [8], "
                 "max_queue_delay_microseconds: 1200000 }\n")  # fmt: skip
    _model(models, "decoupled_grpc_error")
    _model(models, "execute_return_error")
    _model(models, "wrong_model", (r"^name:.*", 'name: "wrong_model"'),
           ("TYPE_FP32", "TYPE_UINT32"))  # fmt: skip
    return here


@pytest.mark.parametrize("mode", ["stub processes", "in-process"])
def test_lifecycle(tmp_path: Path, mode: str) -> None:
    pytest.importorskip("requests", reason="lifecycle_test.py reads the metrics with requests")
    here = _layout(tmp_path)
    with upstream_server("lifecycle_test.py", mode, here / "lifecycle_server.log",
                         f"--model-repository={here / 'models'}", "--log-verbose=1"):
        report = run_upstream_client(here, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                                     _TEST.name)  # fmt: skip
    assert f"{_CASES} passed" in report, report
