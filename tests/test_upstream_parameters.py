"""Upstream's ``qa/L0_parameters`` (``parameters_test.py``, unchanged) against ``pb-tensor
serve``, as its ``test.sh`` runs it: a server started for each case with that case's flags
(``--exit-timeout-secs=120``, the header forward patterns), in both modes.

``test_params``: bool, int, double and string request parameters reach the model through every
client (gRPC and HTTP, sync and async, a stream, an ensemble); ``test_params_reserved_rejected``:
the reserved names are refused; ``test_grpc_header_forward_pattern_case_sensitive``: a
``(?-i)`` pattern minds case; ``test_headers_reserved_rejected``: a forwarded header with a
reserved name gets a 400. ``test_headers`` forwards headers through every client; its HTTP
leg sends a value ending with a space, which an ASGI server's HTTP parser strips (RFC 9110:
the field value excludes surrounding whitespace) where tritonserver's evhtp keeps it: it is
left out here, and ``tests/test_serve_headers.py`` checks forwarding (values without
surrounding whitespace) over both protocols. ``identity`` runs Triton's identity backend in
test.sh, here a Python identity (``tests/test_upstream_ensemble.py``'s). The server runs on the
ports the test hard-codes (8000-8002: skipped when they are taken).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from serve_support import (
    needs_serve,
    run_upstream_client,
    upstream_server,
)
from test_upstream_ensemble import IDENTITY, L0_PARAMETERS

pytestmark = needs_serve

# test.sh's all_tests and the flags it adds for each
_CASES = {
    "test_params": [],
    "test_params_reserved_rejected": [],
    "test_grpc_header_forward_pattern_case_sensitive": [
        "--grpc-header-forward-pattern", "(?-i)MY_HEADER.*"],
    "test_headers_reserved_rejected": [
        "--grpc-header-forward-pattern", ".*", "--http-header-forward-pattern", ".*"],
}  # fmt: skip


@pytest.mark.parametrize("mode", ["stub processes", "in-process"])
def test_parameters(tmp_path: Path, mode: str) -> None:
    here = tmp_path / "L0_parameters"
    here.mkdir()
    shutil.copy(L0_PARAMETERS / "parameters_test.py", here)
    root = here / "model_repository"
    shutil.copytree(L0_PARAMETERS / "model_repository", root)
    for name in ("identity", "ensemble"):  # test.sh: mkdir -p ${MODELDIR}/<name>/1
        (root / name / "1").mkdir(parents=True, exist_ok=True)
    identity = root / "identity" / "config.pbtxt"
    identity.write_text(identity.read_text().replace('backend: "identity"',
                                                     'backend: "python"'))  # fmt: skip
    (root / "identity" / "1" / "model.py").write_text(IDENTITY)
    for case, flags in _CASES.items():
        with upstream_server("parameters_test.py", mode, here / f"{case}.server.log",
                             f"--model-repository={root}", "--exit-timeout-secs=120", *flags):
            report = run_upstream_client(
                here, "-m", "unittest", f"parameters_test.InferenceParametersTest.{case}")
        assert "\nOK" in report, report
