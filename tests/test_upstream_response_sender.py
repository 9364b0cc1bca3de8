"""Upstream's ``qa/L0_backend_python/response_sender`` (``response_sender_test.py`` and
``response_sender_complete_final_test.py``, unchanged) against ``pb-tensor serve``, as its
``test.sh`` runs them, in both modes.

``test.sh`` lays out eight variants of ``qa/python_models/response_sender`` (decoupled or
not, ``async def execute`` or not, with a dynamic batcher or not) and runs
``response_sender_test.py`` against them: every way a model may answer through its sender
and its return value, the errors Triton gives for the wrong ones, and the responses a client
gets over gRPC streams; then ``response_sender_complete_final`` with its own test. Two cases
are skipped by upstream itself (a model unload that hangs in Triton). The servers run on the
ports the tests hard-code (8000-8002: skipped when they are taken).
``tests/test_upstream_flows.py`` checks the same models through the runtime's API.
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
_MODELS = _QA / "python_models"
_HERE = _QA / "L0_backend_python" / "response_sender"

_DECOUPLED = "model_transaction_policy { decoupled: True }\n"
_BATCHING = "dynamic_batching { max_queue_delay_microseconds: 500000 }\n"
# test.sh's eight copies of response_sender: (name, model file, lines appended to the config)
_VARIANTS = [
    ("response_sender", "model.py", ""),
    ("response_sender_decoupled", "model.py", _DECOUPLED),
    ("response_sender_async", "model_async.py", ""),
    ("response_sender_decoupled_async", "model_async.py", _DECOUPLED),
    ("response_sender_batching", "model.py", _BATCHING),
    ("response_sender_decoupled_batching", "model.py", _DECOUPLED + _BATCHING),
    ("response_sender_async_batching", "model_async.py", _BATCHING),
    ("response_sender_decoupled_async_batching", "model_async.py", _DECOUPLED + _BATCHING),
]


def _layout(work: Path) -> Path:
    qa_common(work)
    here = work / "L0_backend_python" / "response_sender"
    here.mkdir(parents=True)
    for name in ("response_sender_test.py", "response_sender_complete_final_test.py"):
        shutil.copy(_HERE / name, here / name)
    source = _MODELS / "response_sender"
    for name, model, extra in _VARIANTS:
        target = here / "models" / name
        (target / "1").mkdir(parents=True)
        shutil.copy(source / "model_common.py", target / "1" / "model_common.py")
        shutil.copy(source / model, target / "1" / "model.py")
        (target / "config.pbtxt").write_text((source / "config.pbtxt").read_text() + extra)
    final = here / "models_complete_final" / "response_sender_complete_final"
    (final / "1").mkdir(parents=True)
    shutil.copy(_MODELS / "response_sender_complete_final" / "model.py", final / "1")
    shutil.copy(_MODELS / "response_sender_complete_final" / "config.pbtxt", final)
    return here


@pytest.mark.parametrize("mode", ["stub processes", "in-process"])
def test_response_sender(tmp_path: Path, mode: str) -> None:
    here = _layout(tmp_path)
    for models, test, expected in (
        ("models", "response_sender_test.py", "19 passed, 2 skipped"),
        ("models_complete_final", "response_sender_complete_final_test.py", "1 passed"),
    ):
        log = here / f"{test}.server.log"
        with upstream_server("response_sender_test.py", mode, log,
                             f"--model-repository={here / models}", "--log-verbose=1"):
            report = run_upstream_client(here, "-m", "pytest", "-p", "no:cacheprovider",
                                         "-q", test, env={"SERVER_LOG": str(log)})  # fmt: skip
        assert expected in report, report
