"""Upstream's qa client tests that need only their models and a server, unchanged, against
``pb-tensor serve``, each as its ``test.sh`` lays out its repository and runs it, in both
modes:

* ``L0_backend_python/parameters/response_parameters_test.py``: response parameters from
  plain, decoupled and BLS models, and the errors for parameters a response may not carry;
* ``L0_backend_python/bls/bls_parameters_test.py`` (``bls/test.sh``'s "BLS parameters" part):
  a model with four instances calling itself through BLS with request parameters;
* ``L0_backend_python/ensemble/ensemble_test.py``: an ensemble of two Python models (its GPU
  case needs a GPU and a libtorch model);
* ``L0_backend_python/async_execute/concurrency_test.py``: ``async def execute`` of decoupled
  models running requests of one instance concurrently, BLS included, and what the server's
  log says of it.

Each server runs on the ports the tests hard-code (8000-8002: skipped when they are taken).
``tests/test_upstream_qa.py``, ``test_upstream_flows.py``, ``test_upstream_async_execute.py``
and ``test_runtime_instances.py`` check the same models through the runtime's API.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Client:
    """One qa client test: its folder under ``L0_backend_python``, the ``qa/python_models``
    its ``test.sh`` copies into ``repository``, how it runs, and what a pass prints."""

    folder: str
    test: str
    models: tuple[str | tuple[str, str], ...]  # a model, or (its name here, the model copied)
    command: tuple[str, ...]
    passed: str
    repository: str = "models"


_CLIENTS = {
    "response_parameters": _Client(
        "parameters", "response_parameters_test.py",
        ("response_parameters", "response_parameters_decoupled", "response_parameters_bls"),
        ("-m", "pytest", "-p", "no:cacheprovider", "response_parameters_test.py"),
        "11 passed",
    ),
    "bls_parameters": _Client(
        "bls", "bls_parameters_test.py", ("bls_parameters",),
        ("bls_parameters_test.py",), "\nOK", repository="params_models",
    ),
    # test.sh's ensemble of two add_sub copies; its ensemble_gpu half needs a GPU and a
    # libtorch model (test_ensemble_gpu is deselected).
    "ensemble": _Client(
        "ensemble", "ensemble_test.py",
        ("ensemble", ("add_sub_1", "add_sub"), ("add_sub_2", "add_sub")),
        ("-m", "pytest", "-p", "no:cacheprovider", "ensemble_test.py", "-k", "not gpu"),
        "1 passed",
    ),
    "async_execute": _Client(
        "async_execute", "concurrency_test.py",
        ("async_execute_decouple", "async_execute_decouple_bls"),
        ("-m", "pytest", "-p", "no:cacheprovider", "concurrency_test.py"),
        "6 passed",
    ),
}  # fmt: skip


@pytest.mark.parametrize("mode", ["stub processes", "in-process"])
@pytest.mark.parametrize("name", list(_CLIENTS))
def test_upstream_client(tmp_path: Path, name: str, mode: str) -> None:
    client = _CLIENTS[name]
    qa_common(tmp_path)
    here = tmp_path / "L0_backend_python" / client.folder
    here.mkdir(parents=True)
    shutil.copy(_QA / "L0_backend_python" / client.folder / client.test, here)
    for entry in client.models:
        name, model = (entry, entry) if isinstance(entry, str) else entry
        target = here / client.repository / name
        (target / "1").mkdir(parents=True)
        source = _QA / "python_models" / model
        if (source / "model.py").is_file():  # (an ensemble has none)
            shutil.copy(source / "model.py", target / "1" / "model.py")
        shutil.copy(source / "config.pbtxt", target / "config.pbtxt")
    log = here / f"{name}.server.log"
    with upstream_server(client.test, mode, log,
                         f"--model-repository={here / client.repository}", "--log-verbose=1"):
        report = run_upstream_client(here, *client.command, env={"SERVER_LOG": str(log)})
    assert client.passed in report, report
