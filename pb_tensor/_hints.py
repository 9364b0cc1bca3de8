"""What to install for an optional feature, said for how pb-tensor itself was installed."""

from __future__ import annotations

import os

__all__ = ["install_hint", "source_checkout"]


def source_checkout() -> str | None:
    """The project folder when pb-tensor runs from a clone (an editable install or the
    checkout on ``sys.path``), else None (an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            ours = 'name = "pb-tensor"' in f.read()
    except OSError:
        return None
    return root if ours else None


def install_hint(extra: str, *packages: str) -> str:
    """``pip install -e ".[EXTRA]" (in ROOT)`` in a clone, ``pip install PACKAGES`` otherwise
    (pb-tensor is not published on a package index: its extras cannot be named there)."""
    root = source_checkout()
    if root is not None:
        return f'pip install -e ".[{extra}]" (in {root})'
    return "pip install " + " ".join(packages)
