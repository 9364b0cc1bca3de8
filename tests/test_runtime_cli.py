"""``python -m pb_tensor run`` / ``check`` and the pytest plugin, each in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import pb_tensor
from pb_tensor.cli import main as cli_main

REPO_ROOT = Path(pb_tensor.__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples" / "model_repository"
TIMEOUT = 180


def _run(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-W", "error", *args], capture_output=True, text=True,
        timeout=TIMEOUT, env=env, cwd=cwd, check=False,
    )  # fmt: skip


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``python -m pb_tensor ARGS`` in this process (the entry point itself is tested once in
    a subprocess below); exit status, stdout, stderr."""
    status = cli_main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err



NEEDS_PROTOBUF = pytest.mark.skipif(
    importlib.util.find_spec("google") is None
    or importlib.util.find_spec("google.protobuf") is None,
    reason="protobuf is not installed (the [runtime] extra): models cannot be loaded",
)

@NEEDS_PROTOBUF
def test_run_prints_outputs() -> None:
    r = _run("-m", "pb_tensor", "run", str(EXAMPLES), "add_sub",
             "-i", "INPUT0=[1, 2, 3]", "-i", "INPUT1=[0.5, 0.5, 0.5]")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "OUTPUT0  FP32  [3]  [1.5, 2.5, 3.5]",
        "OUTPUT1  FP32  [3]  [0.5, 1.5, 2.5]",
    ]


@NEEDS_PROTOBUF
def test_run_json_npy_and_in_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "a.npy", np.arange(3, dtype=np.float32))
    status, out, err = _cli(
        capsys, "run", str(EXAMPLES), "add_sub", "--in-process", "--json",
        "-i", f"INPUT0={tmp_path / 'a.npy'}", "-i", "INPUT1=[1, 1, 1]", "-o", "OUTPUT1",
    )  # fmt: skip
    assert status == 0, err
    assert json.loads(out) == {
        "model_name": "add_sub",
        "outputs": {"OUTPUT1": {"datatype": "FP32", "shape": [3], "data": [-1.0, 0.0, 1.0]}},
    }


@NEEDS_PROTOBUF
def test_run_streams_decoupled_and_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _cli(capsys, "run", str(EXAMPLES), "decoupled_repeat", "-i", "N=[2]")
    assert status == 0, err
    assert out.splitlines() == [
        "response 0", "OUT  INT32  [1]  [0]", "response 1", "OUT  INT32  [1]  [1]",
    ]
    status, out, err = _cli(capsys, "run", str(EXAMPLES), "string_identity", "--json",
                            "-i", 'INPUT0=["hi", "there"]')
    assert status == 0, err
    assert json.loads(out)["outputs"]["OUTPUT0"]["data"] == ["hi", "there"]


@NEEDS_PROTOBUF
def test_run_errors(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = _cli(capsys, "run", str(EXAMPLES), "add_sub", "--in-process",
                          "-i", "INPUT0=[1]")
    assert status == 1
    assert "error: [request id: <id_unknown>] expected 2 inputs but got 1 inputs" in err
    status, _, err = _cli(capsys, "run", str(EXAMPLES), "nope")
    assert status == 1
    assert "error: failed to load model 'nope'" in err
    status, _, err = _cli(capsys, "run", str(EXAMPLES), "add_sub", "-i", "INPUT0")
    assert status == 2
    assert "expected NAME=FILE.npy or NAME=JSON" in err


@NEEDS_PROTOBUF
def test_check_reports_each_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _cli(capsys, "check", str(EXAMPLES), "--in-process")
    if importlib.util.find_spec("torch") is None:
        # The torch example cannot load without torch, and check says so.
        assert status == 1, out + err
        assert "torch_dlpack      FAILED" in out
        assert "ModuleNotFoundError: No module named 'torch'" in out
        assert "6 model(s), 1 with problems" in out
    else:
        assert status == 0, out + err
        assert "6 model(s), 0 with problems" in out
    repo = tmp_path / "repo"
    (repo / "good" / "1").mkdir(parents=True)
    (repo / "good" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    )
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n        1 / 0\n"
    )
    (repo / "badcfg" / "1").mkdir(parents=True)
    (repo / "badcfg" / "config.pbtxt").write_text("max_batch_size: -1\n")
    (repo / "badcfg" / "1" / "model.py").write_text((repo / "good" / "1" / "model.py").read_text())
    status, out, _ = _cli(capsys, "check", str(repo))
    assert status == 1
    # Rows are "[i/n] name  status  (seconds) detail": times vary, so they are removed.
    lines = re.sub(r"\(\d+\.\d s\) ", "", out).splitlines()
    assert lines[0].startswith("[1/3] badcfg  FAILED  failed to load model 'badcfg' version 1")
    assert lines[0].endswith("'max_batch_size' must be non-negative value for badcfg")
    assert lines[1].startswith("[2/3] broken  FAILED  failed to load model 'broken' version 1")
    assert "ZeroDivisionError: division by zero" in out
    assert any(line.startswith("[3/3] good    ok      version 1") for line in lines)
    assert lines[-1] == "3 model(s), 2 with problems"


def test_without_protobuf() -> None:
    """The command line and the stubs do not need protobuf; reading a configuration does,
    and says so."""
    code = f"""
import sys
sys.modules["google"] = None  # as if protobuf were not installed
import argparse
from pb_tensor.runtime import _cli, _stub, LoadedModel  # no protobuf needed
parser = argparse.ArgumentParser()
_cli.add_subcommands(parser.add_subparsers(dest="command"))
status = _cli.run_command(parser.parse_args(["run", {str(EXAMPLES)!r}, "add_sub"]))
print("status", status)
"""
    r = _run("-c", textwrap.dedent(code))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "status 1\n"
    from pb_tensor._hints import install_hint  # the clone's extra, or protobuf by name

    assert r.stderr.startswith(
        "error: reading Triton model configurations needs protobuf: "
        f"{install_hint('runtime', 'protobuf')} ("
    )


@NEEDS_PROTOBUF
def test_check_empty_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _cli(capsys, "check", str(tmp_path))
    assert status == 1
    assert out == f"no models in {tmp_path}\n"


@NEEDS_PROTOBUF
def test_pytest_plugin_fixture(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(f"""
        import os

        def test_add_sub(triton_repository):
            model = triton_repository({str(EXAMPLES)!r}).load("add_sub")
            assert model.infer({{"INPUT0": [1.0], "INPUT1": [2.0]}})["OUTPUT0"].tolist() == [3.0]
            with open("pid.txt", "w") as f:
                f.write(str(model.pid))
    """))
    installed = any(
        ep.value == "pb_tensor.runtime.pytest_plugin"
        for ep in metadata.entry_points(group="pytest11")
    )
    plugin = [] if installed else ["-p", "pb_tensor.runtime.pytest_plugin"]
    r = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, "test_user.py",
             cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout
    pid = int((tmp_path / "pid.txt").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the fixture's teardown stopped the stub
