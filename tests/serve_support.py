"""Helpers of the serve tests: skip without the serve extra, a server for a module, raw HTTP."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO_ROOT, "examples", "model_repository")

_MISSING = [m for m in ("uvicorn", "grpc", "tritonclient", "google.protobuf")
            if importlib.util.find_spec(m.split(".")[0]) is None]
needs_serve = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"pb-tensor serve needs the serve extra and tritonclient[http,grpc] (missing: "
           f"{', '.join(_MISSING)})",
)  # fmt: skip


def port_free(port: int) -> bool:
    """Whether this machine's loopback port ``port`` can be bound now (upstream's clients
    hard-code 8000-8002: their tests skip when one is taken)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def raw(url: str, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request without a client library: status, headers (lower-case), body."""
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    finally:
        conn.close()


def error_of(url: str, path: str, body: bytes, headers: dict[str, str] | None = None
             ) -> tuple[int, str]:
    """Status and the ``error`` text of a POST that fails."""
    status, _, data = raw(url, "POST", path, body, headers)
    parsed: dict[str, Any] = json.loads(data)
    return status, parsed["error"]


def add_sub_json(values: list[float] | None = None) -> dict[str, Any]:
    """An add_sub request with JSON data."""
    data = values if values is not None else [1.0, 2.0, 3.0, 4.0]
    return {"inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [len(data)], "data": data},
        {"name": "INPUT1", "datatype": "FP32", "shape": [len(data)], "data": data},
    ]}  # fmt: skip


def wait_for_text(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Wait until a server started as ``proc`` wrote ``text`` into its ``log`` file (bounded:
    fails the test when it exits or takes longer than ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            pytest.fail(f"serve exited ({proc.returncode}): {log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"serve did not print {text!r} within {timeout} s: {log.read_text()}")
        time.sleep(0.1)


def skip_unless_upstream_ports(what: str) -> None:
    """Skip the test when one of the ports upstream's clients hard-code (8000-8002) is
    taken here (``what``: the upstream test, for the reason)."""
    taken = [p for p in (8000, 8001, 8002) if not port_free(p)]
    if taken:
        pytest.skip(f"{what} uses ports 8000-8002; taken here: {taken}")


@contextmanager
def serve_process(args: Sequence[str], log: Path, *, env: Mapping[str, str] | None = None,
                  err: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """``python -m pb_tensor serve <args>`` (from the repository root), its output in ``log``
    (its standard error in ``err`` when given), once it printed its start lines (bounded);
    stopped afterwards as upstream's ``kill_server`` stops tritonserver: SIGTERM, and a wait
    (SIGKILL after 60 s)."""
    command = [sys.executable, "-m", "pb_tensor", "serve", *args]
    with open(log, "wb") as out, open(err or log, "ab") as errors:
        server = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out,
                                  stderr=errors if err else subprocess.STDOUT,
                                  env=dict(env) if env is not None else None)  # fmt: skip
    try:
        wait_for_text(log, "Started Metrics Service", server)
        yield server
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


@contextmanager
def upstream_server(what: str, mode: str, log: Path, *args: str
                    ) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """:func:`serve_process` for upstream's test ``what`` (skipped when 8000-8002 are
    taken), in ``mode`` ("stub processes" or "in-process")."""
    skip_unless_upstream_ports(what)
    extra = ["--in-process"] if mode == "in-process" else []
    with serve_process([*args, *extra], log) as server:
        yield server


def qa_common(qa: Path) -> None:
    """Upstream's ``qa/common`` helpers the qa client tests import (``../../common``) under
    the test tree ``qa``."""
    common = qa / "common"
    common.mkdir(parents=True, exist_ok=True)
    for name in ("shm_util.py", "test_util.py"):
        (common / name).write_bytes((_UPSTREAM_QA / "common" / name).read_bytes())


def run_upstream_client(cwd: Path, *args: str, timeout: float = 600,
                        env: Mapping[str, str] | None = None) -> str:  # fmt: skip
    """``python <args>`` in ``cwd`` as upstream's ``test.sh`` runs a qa client test, with
    ``TEST_JETSON=1`` (upstream's switch that skips ``shm_util``'s leak probe, which reads
    Triton's own regions through a compiled module) and ``env``; its output, asserting it
    passed."""
    env = dict(os.environ, TEST_JETSON="1", **(env or {}))
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    return report


_UPSTREAM_QA = Path(REPO_ROOT) / "tests" / "upstream" / "server" / "qa"


_PARAMS_ECHO = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", np.array([r.parameters().encode()], dtype=object))]) for r in requests]
"""


def params_echo(root: Path) -> None:
    """Model ``echo`` under ``root``: OUT is the request's ``parameters()`` (its JSON text),
    whatever INT32 ``IN`` (one element) holds."""
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "1" / "model.py").write_text(_PARAMS_ECHO)
    (root / "echo" / "config.pbtxt").write_text(
        'backend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]\n')
