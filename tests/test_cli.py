"""``python -m pb_tensor demo|doctor|bench`` in a subprocess: exit status and expected rows,
with the optional frameworks installed and with them hidden."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

import pb_tensor

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pb_tensor.__file__)))
TIMEOUT = 240

# Runs ``python -m pb_tensor`` with the listed modules made unimportable, as if not installed.
_HIDDEN = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
sys.argv = ["pb_tensor", *sys.argv[2:]]
runpy.run_module("pb_tensor", run_name="__main__", alter_sys=True)
"""


def _run(*args: str, hide: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    env.pop("PYTHONWARNINGS", None)
    if hide:
        cmd = [sys.executable, "-W", "error", "-c", textwrap.dedent(_HIDDEN), ",".join(hide),
               *args]
    else:
        cmd = [sys.executable, "-m", "pb_tensor", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env,
                          cwd=REPO_ROOT, check=False)


def _rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The demo table as ``{step: (result, what happened)}``."""
    rows: dict[str, tuple[str, str]] = {}
    for line in stdout.splitlines():
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=2)
        if len(parts) == 3 and parts[1] in ("ok", "FAILED", "skipped"):
            rows[parts[0]] = (parts[1], parts[2])
    return rows


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


CORE_ROWS = ["numpy -> Tensor", "Tensor -> np.from_dlpack", "non-contiguous numpy",
             "BYTES round trip", "faithful error", "strided DLPack refused", "no leaks"]


def test_demo() -> None:
    proc = _run("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    for step in CORE_ROWS:
        assert rows[step][0] == "ok", (step, rows.get(step))
    if _have("torch"):
        for step in ("Tensor -> torch", "torch -> Tensor", "BF16 through torch"):
            assert rows[step][0] == "ok", (step, rows.get(step))
    if _have("jax"):
        for step in ("Tensor -> JAX", "JAX -> Tensor"):
            assert rows[step][0] == "ok", (step, rows.get(step))
    assert rows["CUDA"][0] in ("ok", "skipped")
    assert "FAILED" not in proc.stdout


def test_default_command_is_demo() -> None:
    proc = _run(hide=("torch", "jax", "jaxlib"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("pb-tensor demo")


def test_demo_without_torch_and_jax() -> None:
    proc = _run("demo", hide=("torch", "jax", "jaxlib", "ml_dtypes"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    for step in CORE_ROWS:
        assert rows[step][0] == "ok", (step, rows.get(step))
    assert rows["torch"][0] == "skipped"
    assert "pip install torch" in rows["torch"][1]
    assert rows["JAX"][0] == "skipped"
    assert "pip install jax" in rows["JAX"][1]
    assert "Tensor -> torch" not in rows
    assert "FAILED" not in proc.stdout


def test_doctor() -> None:
    proc = _run("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line.strip())
    assert lines["python"].startswith(".".join(map(str, sys.version_info[:2])))
    import numpy as np

    assert lines["numpy"] == np.__version__
    for name in ("torch", "jax", "ml_dtypes"):
        assert name in lines
        if _have(name):
            assert lines[name] != "not installed"
    fast = [line.split(None, 2)[2] for line in proc.stdout.splitlines()
            if line.startswith("fast path")]
    assert any(line.startswith("numpy data pointer: ") for line in fast), fast
    import dlpack_ctypes

    assert len(fast) == len(dlpack_ctypes.fast_paths())
    assert lines["pb-tensor"] == pb_tensor.__version__
    assert "CUDA" in lines


def test_doctor_without_torch_and_jax() -> None:
    # doctor reads installed metadata: make torch's and JAX's distributions unknown.
    code = """
import importlib.metadata as md, sys
real = md.version
def version(name):
    if name in ("torch", "jax", "jaxlib", "ml_dtypes", "ml-dtypes"):
        raise md.PackageNotFoundError(name)
    return real(name)
md.version = version
from pb_tensor.cli import main
sys.exit(main(["doctor"]))
"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, cwd=REPO_ROOT, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line.strip())
    for name in ("torch", "jax", "jaxlib", "ml_dtypes"):
        assert lines[name] == "not installed", (name, lines[name])


@pytest.mark.parametrize("hide", [(), ("torch", "jax", "jaxlib")], ids=["full", "no-frameworks"])
def test_bench(hide: tuple[str, ...]) -> None:
    proc = _run("bench", hide=hide)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in ("Tensor('x', a)", "np.from_dlpack(tensor)", "Tensor.from_dlpack('x', a)"):
        match = re.search(rf"^{re.escape(label)}\s+([0-9.]+)\s*$", proc.stdout, re.MULTILINE)
        assert match, (label, proc.stdout)
        assert float(match.group(1)) > 0


def test_bad_command() -> None:
    proc = _run("frobnicate")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
    assert proc.stderr.startswith("usage: pb-tensor")


def test_version() -> None:
    proc = _run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"pb-tensor {pb_tensor.__version__}"


def test_help_is_plain_text() -> None:
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "bench", "doctor"):
        assert command in proc.stdout
    for markup in ("``", ":func:", ":class:", ":mod:"):
        assert markup not in proc.stdout


def test_doctor_imports_no_framework() -> None:
    code = (
        "import sys; from pb_tensor.cli import main; main(['doctor']); "
        "heavy = [m for m in ('torch', 'jax', 'jaxlib', 'cupy', 'ml_dtypes') if m in sys.modules]; "
        "print('heavy:', heavy)"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, cwd=REPO_ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "heavy: []"


def test_demo_table_rules_span_every_row() -> None:
    proc = _run("demo", hide=("torch", "jax", "jaxlib"))
    lines = proc.stdout.splitlines()
    rules = [line for line in lines[1:] if set(line) == {"-"}]
    assert len(rules) == 3
    widest = max(len(line) for line in lines[1:])
    assert {len(rule) for rule in rules} == {widest}


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["bogus"]])
def test_dlpack_ctypes_cli(args: list[str]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "dlpack_ctypes", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, env=env, cwd=REPO_ROOT, check=False)
    if args == ["bogus"]:
        assert proc.returncode == 2
        assert proc.stderr.startswith("usage: python -m dlpack_ctypes")
        assert proc.stdout == ""  # the demo did not run
    elif args == ["--version"]:
        import dlpack_ctypes

        assert proc.returncode == 0
        assert proc.stdout.strip() == f"dlpack_ctypes {dlpack_ctypes.__version__}"
    else:
        assert proc.returncode == 0
        assert "usage: python -m dlpack_ctypes" in proc.stdout
        assert "``" not in proc.stdout


def test_serve_without_its_extra_says_what_to_install() -> None:
    proc = _run("serve", "--model-repository", "examples/model_repository",
                hide=("uvicorn", "grpc", "google"))
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        'error: pb-tensor serve needs the serve extra (missing: uvicorn, grpc, google.protobuf): '
        'pip install '
        '-e ".[serve]" in a clone')
