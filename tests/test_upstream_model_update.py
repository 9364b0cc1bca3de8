"""Upstream's ``qa/L0_model_update`` (``instance_update_test.py``, unchanged) against
``pb-tensor serve``: a loaded model whose configuration changed only in ``instance_group``
has its instances updated in place (added, removed, kept) rather than reloaded, as Triton's
core does (``TritonModel::UpdateInstanceGroup``).

The repository is laid out as upstream's ``test.sh`` lays it out (``model_init_del`` with its
``util.py`` next to the configuration, ``model.py`` moved into ``1/``), the server runs on
the ports the test hard-codes (8000-8002: skipped when they are taken), with
``PYTHONDONTWRITEBYTECODE`` set as ``test.sh`` sets it (bytecode written into the model
directory would count as a change of the model's files) and ``RATE_LIMIT_MODE=off`` (the
first of ``test.sh``'s three passes; the runtime has no rate limiter, and the other two
passes differ only in the rate limiter's cases).

Left out, as they need a GPU (each asks for a ``KIND_GPU`` group, which a server without
GPUs refuses): ``test_gpu_instance_update``, ``test_gpu_cpu_instance_update``,
``test_instance_name_update``, ``test_instance_signature`` and the two
``*_with_ongoing_sequences`` cases. ``tests/test_runtime_instance_update.py`` checks what they
check with CPU groups of other signatures. The rate limiter's three cases skip themselves
(``RATE_LIMIT_MODE=off``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from serve_support import needs_serve, serve_process, skip_unless_upstream_ports
from upstream_models import UPSTREAM

pytestmark = needs_serve

_MODEL = UPSTREAM / "server" / "qa" / "python_models" / "model_init_del"
_TEST = UPSTREAM / "server" / "qa" / "L0_model_update" / "instance_update_test.py"

_CASES = [
    "test_add_rm_add_instance_no_batching",
    "test_add_rm_add_instance_with_batching",
    "test_rm_add_rm_instance_no_batching",
    "test_rm_add_rm_instance_with_batching",
    "test_rm_instance_to_zero",
    "test_cpu_instance_update",
    "test_invalid_config",
    "test_model_file_update",
    "test_non_instance_config_update",
    "test_load_api_with_config",
    "test_update_while_inferencing",
    "test_infer_while_updating",
    "test_direct_scheduler_update_no_ongoing_sequences",
    "test_oldest_scheduler_update_no_ongoing_sequences",
    # (each skips itself with RATE_LIMIT_MODE=off, as in test.sh's first pass)
    "test_instance_resource_increase",
    "test_instance_resource_increase_above_explicit",
    "test_instance_resource_decrease",
]


def _layout(work: Path) -> None:
    """``test.sh``'s ``setup_models``."""
    models = work / "models"
    shutil.copytree(_MODEL, models / "model_init_del")
    (models / "model_init_del" / "1").mkdir()
    shutil.move(str(models / "model_init_del" / "model.py"),
                str(models / "model_init_del" / "1" / "model.py"))  # fmt: skip
    shutil.copy(_TEST, work / _TEST.name)


@pytest.mark.parametrize("mode", ["stub processes", "in-process"])
def test_instance_update(tmp_path: Path, mode: str) -> None:
    skip_unless_upstream_ports("instance_update_test.py")
    _layout(tmp_path)
    env = dict(os.environ, MODEL_LOG_DIR=str(tmp_path), RATE_LIMIT_MODE="off",
               PYTHONDONTWRITEBYTECODE="True")  # fmt: skip
    log = tmp_path / "server.log"
    args = [f"--model-repository={tmp_path / 'models'}", "--model-control-mode=explicit"]
    if mode == "in-process":
        args.append("--in-process")
    with serve_process(args, log, env=env):
        done = subprocess.run(
            [sys.executable, _TEST.name, *(f"TestInstanceUpdate.{c}" for c in _CASES)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert f"Ran {len(_CASES)} tests" in report, report
    assert "OK (skipped=3)" in report, report
    # test.sh's own check of the server's log
    assert "Should not print this" not in log.read_text(errors="replace")
