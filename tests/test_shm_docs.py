"""Every ``python`` block of docs/shared-memory.md runs as written, as a script of its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

DOC = Path(REPO_ROOT) / "docs" / "shared-memory.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S)


def test_the_doc_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"block{index}.py"
    script.write_text(BLOCKS[index], encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"block {index} failed:\n{BLOCKS[index]}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
