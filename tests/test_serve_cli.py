"""``python -m pb_tensor serve`` as a process: tritonserver's status table and service lines,
SIGTERM draining and a clean exit (finalize ran, no shared memory, no stub left), and
python_backend's own example clients, unchanged, against it (they use ports 8000-8002)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from serve_support import REPO_ROOT, needs_serve, port_free, raw
from serve_support import children as serve_children
from upstream_models import EXAMPLES, repository

pytestmark = needs_serve

CLIENTS = {  # client script -> the models it calls (as the examples' READMEs name them)
    "add_sub/client.py": ["add_sub"],
    "auto_complete/client.py": ["nobatch_auto_complete", "batch_auto_complete"],
    "decoupled/repeat_client.py": ["repeat_int32"],
    "decoupled/square_client.py": ["square_int32"],
    "bls_decoupled/sync_client.py": ["bls_decoupled_sync", "square_int32"],
    "bls_decoupled/async_client.py": ["bls_decoupled_async", "square_int32"],
    "custom_metrics/client.py": ["custom_metrics"],
}
FILES = {
    "add_sub": ("add_sub/model.py", "add_sub/config.pbtxt"),
    "nobatch_auto_complete": ("auto_complete/nobatch_model.py", None),
    "batch_auto_complete": ("auto_complete/batch_model.py", None),
    "repeat_int32": ("decoupled/repeat_model.py", "decoupled/repeat_config.pbtxt"),
    "square_int32": ("decoupled/square_model.py", "decoupled/square_config.pbtxt"),
    "bls_decoupled_sync": ("bls_decoupled/sync_model.py", "bls_decoupled/sync_config.pbtxt"),
    "bls_decoupled_async": ("bls_decoupled/async_model.py",
                            "bls_decoupled/async_config.pbtxt"),
    "custom_metrics": ("custom_metrics/model.py", "custom_metrics/config.pbtxt"),
}


class _Serve:
    """``python -m pb_tensor serve`` in a subprocess, its output read until a line shows."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pb_tensor", "serve", *args], cwd=REPO_ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []

    def until(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        """The first output line matching ``pattern`` (bounded wait)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            match = re.search(pattern, line)
            if match is not None:
                return match
            assert time.monotonic() < deadline, f"no {pattern!r} in {self.lines}"
        pytest.fail(f"serve exited ({self.proc.wait(10)}) without {pattern!r}: {self.lines}")

    def stop(self) -> tuple[int, str]:
        """SIGTERM; the exit status and the rest of the output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest, _ = self.proc.communicate()
        return self.proc.returncode, rest


def test_start_serve_and_stop_on_sigterm() -> None:
    serve = _Serve("--model-repository", str(Path(REPO_ROOT) / "examples" / "model_repository"),
                   "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                   "--model-control-mode=explicit", "--load-model", "add_sub",
                   "--load-model", "decoupled_repeat")
    try:
        serve.until(r"^\+-+\+-+\+-+\+$")
        header = serve.until(r"^\| Model")
        assert header.string.split() == ["|", "Model", "|", "Version", "|", "Status", "|"]
        serve.until(r"\| add_sub +\| 1 +\| READY +\|")
        grpc_at = serve.until(r"Started GRPCInferenceService at (127\.0\.0\.1:\d+)").group(1)
        http_at = serve.until(r"Started HTTPService at (127\.0\.0\.1:\d+)").group(1)
        serve.until(r"Started Metrics Service at 127\.0\.0\.1:\d+")
        assert raw(http_at, "GET", "/v2/health/ready")[0] == 200
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(grpc_at) as client:
            assert client.is_model_ready("decoupled_repeat")
        children = serve_children(serve.proc.pid)
        assert len(children) == 2  # one stub per model
    finally:
        status, rest = serve.stop()
    assert status == 0, rest
    assert "add_sub: finalize" in rest  # the model's finalize logged on the way out
    assert not [n for n in os.listdir("/dev/shm") if f"_{serve.proc.pid}_" in n]
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]


def test_start_errors() -> None:
    repo = str(Path(REPO_ROOT) / "examples" / "model_repository")
    poll = subprocess.run(
        [sys.executable, "-m", "pb_tensor", "serve", "--model-repository", repo,
         "--model-control-mode=poll"], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert poll.returncode == 1
    assert poll.stderr.strip().endswith(
        "error: creating server: --model-control-mode=poll is not supported by pb-tensor "
        "serve (use none or explicit)")
    failing = subprocess.run(
        [sys.executable, "-m", "pb_tensor", "serve", "--model-repository", repo,
         "--model-control-mode=explicit", "--load-model", "no_such_model",
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert failing.returncode == 1
    assert "error: creating server: failed to load all models" in failing.stderr


def test_log_file(tmp_path: Path) -> None:
    """``--log-file``: every record there (a model's finalize line, in tritonserver's
    format), none on the console; a file that cannot be opened stops the start."""
    log = tmp_path / "server.log"
    serve = _Serve("--model-repository", str(Path(REPO_ROOT) / "examples" / "model_repository"),
                   "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                   "--model-control-mode=explicit", "--load-model", "add_sub",
                   f"--log-file={log}", "--log-format=ISO8601")
    try:
        serve.until(r"Started Metrics Service at")
    finally:
        status, rest = serve.stop()
    assert status == 0, rest
    assert "finalize" not in "\n".join(serve.lines) + rest
    assert re.search(r'^\d{4}-\d\d-\d\dT[\d:]+Z I \d+ model\.py:\d+\] "add_sub: finalize"$',
                     log.read_text(), re.M), log.read_text()  # fmt: skip
    nowhere = subprocess.run(
        [sys.executable, "-m", "pb_tensor", "serve", "--model-repository", str(tmp_path),
         f"--log-file={tmp_path / 'no' / 'such' / 'dir.log'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert nowhere.returncode == 1
    assert nowhere.stderr.startswith("error: creating server: cannot open --log-file "), (
        nowhere.stderr)


def test_python_backend_example_clients(tmp_path: Any) -> None:
    """python_backend's examples/*/client.py, unchanged, against ``serve`` on 8000-8002."""
    taken = [p for p in (8000, 8001, 8002) if not port_free(p)]
    if taken:
        pytest.skip(f"the example clients use ports 8000-8002; taken here: {taken}")
    files = {name: (EXAMPLES / py, EXAMPLES / cfg if cfg else None)
             for name, (py, cfg) in FILES.items()}
    repo = repository(tmp_path / "models", {}, files=files)
    serve = _Serve("--model-repository", str(repo))
    try:
        serve.until(r"Started Metrics Service at")
        for client, _ in CLIENTS.items():
            if client.startswith("custom_metrics") and importlib.util.find_spec(
                    "requests") is None:
                continue  # that client reads the metrics with requests
            done = subprocess.run([sys.executable, str(EXAMPLES / client)], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, (client, done.stdout, done.stderr)
            assert "PASS" in done.stdout, (client, done.stdout)
    finally:
        status, rest = serve.stop()
    assert status == 0, rest


_SLEEPS = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(1.0)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
'''
_SLEEPS_CONFIG = """
name: "sleeps"
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""


def test_sigterm_drains_requests_in_flight(tmp_path: Any) -> None:
    import json
    import threading

    (tmp_path / "sleeps" / "1").mkdir(parents=True)
    (tmp_path / "sleeps" / "config.pbtxt").write_text(_SLEEPS_CONFIG)
    (tmp_path / "sleeps" / "1" / "model.py").write_text(_SLEEPS)
    serve = _Serve("--model-repository", str(tmp_path), "--http-port", "0", "--grpc-port", "0",
                   "--metrics-port", "0")
    answers: list[tuple[int, dict[str, Any]]] = []
    try:
        http_at = serve.until(r"Started HTTPService at (127\.0\.0\.1:\d+)").group(1)
        body = json.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [2],
                                       "data": [7, 8]}]}).encode()

        def call() -> None:
            status, _, data = raw(http_at, "POST", "/v2/models/sleeps/infer", body)
            answers.append((status, json.loads(data)))

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.4)  # the request is in the model now
    finally:
        status, rest = serve.stop()
    caller.join(30)
    assert status == 0, rest
    assert [(s, a["outputs"][0]["data"]) for s, a in answers] == [(200, [7, 8])]


def test_flags_take_tritonservers_spellings() -> None:
    from pb_tensor.cli import _parser
    from pb_tensor.serve._cli import options_from_args

    args = _parser().parse_args([
        "serve", "--model-repository=a", "--model-store", "b", "--allow-http=false",
        "--allow-metrics", "0", "--exit-on-error=false", "--strict-model-config",
        "--model-control-mode=explicit", "--load-model", "m1", "--load-model=*",
        "--http-port", "9000", "--grpc-address", "0.0.0.0", "--log-verbose", "1",
        "--http-max-input-size", "1024", "--in-process", "--strict-readiness=false",
    ])  # fmt: skip
    options = options_from_args(args)
    assert options.model_repositories == ["a", "b"]
    assert (options.allow_http, options.allow_grpc, options.allow_metrics) == (
        False, True, False)
    assert (options.exit_on_error, options.strict_model_config) == (False, True)
    assert options.strict_readiness is False  # (tritonserver's default: true)
    assert (options.model_control_mode, options.load_models) == ("explicit", ["m1", "*"])
    assert (options.http_port, options.grpc_port, options.metrics_port) == (9000, 8001, 8002)
    assert (options.http_address, options.grpc_address) == ("127.0.0.1", "0.0.0.0")
    assert (options.log_verbose, options.max_input_size, options.in_process) == (1, 1024, True)
