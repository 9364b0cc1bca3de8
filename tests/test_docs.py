"""The documentation is executed: every ```python block of README.md and docs/*.md runs in a
fresh interpreter, and every ```bash block is a command that CI runs (.ci/run).

A block must define every name it uses. A block that imports an optional library (torch, JAX,
Ray, ...) is skipped where that library is missing, and only then. Shell commands that CI does
not run are written as ```console blocks, which are shown and never run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

DOCS_ROOT = Path(__file__).resolve().parent.parent
# Libraries a block may need that this suite does not install everywhere.
OPTIONAL = (
    "torch", "jax", "jaxlib", "ray", "cupy", "ml_dtypes", "tritonclient", "google", "uvicorn",
    "grpc",
)
SHELL = ("bash", "sh", "shell")
_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def _documents() -> list[Path]:
    docs = DOCS_ROOT / "docs"
    return [DOCS_ROOT / "README.md", *sorted(docs.glob("*.md"))] if docs.is_dir() else [
        DOCS_ROOT / "README.md"
    ]


def _blocks(language: tuple[str, ...]) -> list[tuple[str, str]]:
    found = []
    for doc in _documents():
        text = doc.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            if match.group(1) in language:
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{doc.relative_to(DOCS_ROOT)}:{line}", match.group(2)))
    return found


PYTHON_BLOCKS = _blocks(("python",))
SHELL_BLOCKS = _blocks(SHELL)


def test_the_docs_have_python_blocks() -> None:
    assert len(PYTHON_BLOCKS) >= 3, PYTHON_BLOCKS


@pytest.mark.parametrize(("where", "code"), PYTHON_BLOCKS, ids=[w for w, _ in PYTHON_BLOCKS])
def test_python_block_runs(where: str, code: str, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    env.pop("PYTHONWARNINGS", None)
    # Run as a script file, as a reader would: multiprocessing's spawn start method needs one.
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", str(script)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", proc.stderr)
        if missing and missing.group(1).split(".")[0] in OPTIONAL:
            pytest.skip(f"{where} needs {missing.group(1)}, which is not installed")
    assert proc.returncode == 0, f"{where} failed:\n{proc.stdout}\n{proc.stderr}"


def test_shell_blocks_are_run_by_ci() -> None:
    ci = (DOCS_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_lines = {line.strip() for line in ci.splitlines()}
    not_run = []
    for where, code in SHELL_BLOCKS:
        for line in code.splitlines():
            command = line.strip()
            if command and not command.startswith("#") and command not in ci_lines:
                not_run.append(f"{where}: {command}")
    assert not not_run, (
        "shell blocks CI does not run (run them in .ci/run, or mark the block ```console):\n"
        + "\n".join(not_run)
    )
