"""Every ``python`` block of docs/runtime.md runs as written (each in a fresh namespace, all in
one fresh interpreter started in the project root, where the example repository is)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "runtime.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def test_doc_has_blocks() -> None:
    assert len(BLOCK.findall(DOC.read_text(encoding="utf-8"))) >= 6


def test_doc_blocks_run(run_python: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    result = run_python(
        """
        import re, sys
        text = open(sys.argv[1], encoding="utf-8").read()
        blocks = re.findall(r"^```python\\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
        for i, block in enumerate(blocks):
            exec(compile(block, f"runtime.md block {i}", "exec"), {"__name__": "__doc__"})
        print(len(blocks))
        """,
        str(DOC),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(BLOCK.findall(DOC.read_text(encoding="utf-8")))
