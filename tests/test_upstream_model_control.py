"""Upstream's ``qa/L0_backend_python/model_control`` (``model_control_test.py``, unchanged)
against ``pb-tensor serve``, as its ``test.sh`` runs it, in both modes.

``test.sh`` starts the server in explicit model control mode over ``identity_fp32`` and
``simple_identity_fp32`` (an ensemble on it), runs the file (``test_model_reload``: five load,
infer and unload cycles of the ensemble and its composing model), then
``ModelIDValidationTest`` again: models loaded through the repository extension with a
configuration and a ``file:/1/model.py`` override, where a name holding one of
python_backend's forbidden characters is refused (``Invalid stub name: contains invalid
characters``) and plain names load and serve. That class sends its requests with ``curl`` and
skips itself without it. The server runs on the ports the test hard-codes (8000-8002: skipped
when they are taken).
"""

from __future__ import annotations

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


@pytest.mark.parametrize("mode", ["stub processes", "in-process"])
def test_model_control(tmp_path: Path, mode: str) -> None:
    qa_common(tmp_path)
    here = tmp_path / "L0_backend_python" / "model_control"
    here.mkdir(parents=True)
    shutil.copy(_QA / "L0_backend_python" / "model_control" / "model_control_test.py", here)
    models = here / "models"
    (models / "identity_fp32" / "1").mkdir(parents=True)
    (models / "simple_identity_fp32" / "1").mkdir(parents=True)
    identity = _QA / "python_models" / "identity_fp32"
    shutil.copy(identity / "model.py", models / "identity_fp32" / "1" / "model.py")
    shutil.copy(identity / "config.pbtxt", models / "identity_fp32" / "config.pbtxt")
    shutil.copy(_QA / "python_models" / "simple_identity_fp32" / "config.pbtxt",
                models / "simple_identity_fp32" / "config.pbtxt")  # fmt: skip
    with upstream_server("model_control_test.py", mode, here / "model_control_server.log",
                         f"--model-repository={models}", "--model-control-mode=explicit",
                         "--log-verbose=1"):  # fmt: skip
        whole = run_upstream_client(here, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
                                    "model_control_test.py")  # fmt: skip
        again = run_upstream_client(here, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
                                    "model_control_test.py::ModelIDValidationTest")  # fmt: skip
    assert "3 passed" in whole, whole
    if shutil.which("curl") is not None:  # else ModelIDValidationTest skipped itself
        assert "2 passed" in again, again
