"""Every ``python`` block of docs/runtime.md runs as written, from any working directory (each
in a fresh namespace, all in one fresh interpreter started in a temporary directory)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pb_tensor

DOC = Path(__file__).resolve().parent.parent / "docs" / "runtime.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
REPO_ROOT = Path(pb_tensor.__file__).resolve().parent.parent


def test_doc_has_blocks() -> None:
    assert len(BLOCK.findall(DOC.read_text(encoding="utf-8"))) >= 6


def test_doc_blocks_run(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import re, sys
        text = open(sys.argv[1], encoding="utf-8").read()
        blocks = re.findall(r"^```python\\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
        for i, block in enumerate(blocks):
            exec(compile(block, f"runtime.md block {i}", "exec"), {"__name__": "__doc__"})
        print(len(blocks))
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("PYTHONWARNINGS", None)
    result = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c", code, str(DOC)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(BLOCK.findall(DOC.read_text(encoding="utf-8")))
