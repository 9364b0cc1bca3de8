"""Facts about the installed numpy that need none of this package's ctypes machinery.

Kept apart from :mod:`dlpack_ctypes.exporters` (which re-exports them) so that code deciding
*whether* to use numpy's exporter can ask without importing the producer.
"""

from __future__ import annotations

from typing import Final

import numpy as np

__all__ = ["NUMPY_EXPORTER_KEEPS_RULES"]


def _numpy_keeps_1_3() -> bool:
    # numpy >= 2.4 always emits strides and takes the DLPack 1.0 keywords: the rules of 1.3.
    try:
        major, minor = (int(p) for p in np.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 4)


#: numpy's own exporter keeps every export rule of this package (numpy >= 2.4): its versioned
#: capsules are tagged 1.3 by :func:`dlpack_ctypes.numpy_dlpack`, and callers may prefer it for
#: host memory.
NUMPY_EXPORTER_KEEPS_RULES: Final = _numpy_keeps_1_3()
