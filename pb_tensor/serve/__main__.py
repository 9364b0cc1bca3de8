"""``python -m pb_tensor.serve ...``: the same as ``pb-tensor serve ...``."""

from __future__ import annotations

import sys

from pb_tensor.serve._cli import run

if __name__ == "__main__":
    sys.exit(run())
