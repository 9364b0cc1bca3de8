"""``python -m dlpack_ctypes``: exchange a tensor with numpy both ways and say what happened."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

import dlpack_ctypes as dl


def main(argv: Sequence[str] | None = None) -> int:
    """Run the exchange; returns the process exit code (0 when every check holds).

    argparse exits with status 2 on bad arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m dlpack_ctypes",
        description="Exchange a tensor with numpy in both directions through the pure-Python "
        "DLPack producer and consumer, and report each check.",
    )
    parser.add_argument("--version", action="version", version=f"dlpack_ctypes {dl.__version__}")
    parser.parse_args(argv)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    checks: list[tuple[str, bool]] = []

    b = np.from_dlpack(dl.BufferExporter.from_numpy(a))
    checks.append(("numpy imports our capsule without a copy", bool(np.shares_memory(a, b))))

    t = dl.from_dlpack(a)
    view = t.numpy()
    checks.append(("we import numpy's capsule without a copy", bool(np.shares_memory(a, view))))
    sys.stdout.write(f"imported: {t!r}\n")
    view[0, 0] = 42.0
    checks.append(("a write through our view is visible in numpy", a[0, 0] == 42.0))

    del b, t, view
    checks.append(("every export released (deleter ran once)", dl.live_exports() == 0))

    width = max(len(text) for text, _ in checks)
    for text, ok in checks:
        sys.stdout.write(f"{text:<{width}}  {'ok' if ok else 'FAILED'}\n")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
