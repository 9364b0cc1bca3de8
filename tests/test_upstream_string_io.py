"""Upstream's ``qa/L0_string_io`` (``string_client_test.py``, unchanged) against ``pb-tensor
serve``, as its ``test.sh`` runs it, in both modes.

``test.sh`` serves ``qa/python_models/string_identity`` with its dims set to ``[ 8 ]`` (the
``onnx_zero_1_object`` model it also copies is another backend's and the test does not use
it). The test sends strings and raw bytes (UTF-8 or not) through every client: HTTP and gRPC,
binary data or JSON, and checks what comes back; a BYTES output that is not UTF-8 sent as
JSON makes the HTTP client fail, as Triton writes the bytes unchanged into the JSON. The
server runs on the ports the test hard-codes (8000-8002: skipped when they are taken).
"""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("mode", ["stub processes", "in-process"])
def test_string_io(tmp_path: Path, mode: str) -> None:
    qa_common(tmp_path)
    here = tmp_path / "L0_string_io"
    here.mkdir()
    shutil.copy(_QA / "L0_string_io" / "string_client_test.py", here)
    model = here / "models" / "string_identity"
    (model / "1").mkdir(parents=True)
    shutil.copy(_QA / "python_models" / "string_identity" / "model.py", model / "1")
    config = (_QA / "python_models" / "string_identity" / "config.pbtxt").read_text()
    (model / "config.pbtxt").write_text(re.sub(r"\[ 1 \]", "[ 8 ]", config, count=1))
    with upstream_server("string_client_test.py", mode, here / "inference_server.log",
                         f"--model-repository={here / 'models'}"):  # fmt: skip
        run_upstream_client(here, "string_client_test.py", "-v")
    # test.sh: check_test_results $TEST_RESULT_FILE $EXPECTED_NUM_TESTS (1)
    results = json.loads((here / "test_results.txt").read_text())
    assert results == {"total": 1, "errors": 0, "failures": 0}
