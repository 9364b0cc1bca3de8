"""The producer's fast paths give exactly what the general code gives.

``negotiate`` decides the common request (no stream, device or copy; ``max_version`` a tuple
or None) with one dict lookup; every other request is parsed. Both must agree on every input,
including the ones the fast path hands on (lists, numpy integers, read-only data).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import dlpack_ctypes as dl

CPU = (1, 0)
CUDA = (2, 1)


def _outcome(fn: Any) -> object:
    try:
        return fn()
    except Exception as exc:  # compared by type and text
        return (type(exc), str(exc))


@pytest.mark.parametrize(
    "max_version",
    [None, (1, 0), (1, 3), (1, 15), (0, 8), (2, 0), (2, 7), (3, 0), (1, 99),
     [1, 0], (np.int64(1), np.int64(2)), (True, 0), (1,), (1, 2, 3), ("1", "0"), "ab", 1],
)
@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("readonly", [False, True])
def test_common_request_matches_general_rules(
    max_version: object, device: tuple[int, int], readonly: bool
) -> None:
    fast = _outcome(lambda: dl.negotiate(device, max_version=max_version, readonly=readonly))
    # copy=False takes the general path and means the same as copy=None here (no copy needed).
    slow = _outcome(
        lambda: dl.negotiate(device, max_version=max_version, readonly=readonly, copy=False)
    )
    assert fast == slow


def test_common_request_results() -> None:
    assert dl.negotiate(CPU, max_version=(1, 0)) == (True, False, CPU)
    assert dl.negotiate(CUDA, max_version=None) == (False, False, CUDA)
    assert dl.negotiate(CPU, max_version=(0, 8)) == (False, False, CPU)
    with pytest.raises(TypeError, match="max_version must be a pair of integers"):
        dl.negotiate(CPU, max_version=(1,))


def test_numpy_export_tagged_on_every_call() -> None:
    # The first capsule is read through PyCapsule_GetPointer, the next ones from the capsule
    # object's fields: each must be tagged and point at the array.
    a = np.arange(6, dtype=np.float32)
    expected = (1, 3) if dl.NUMPY_EXPORTER_KEEPS_RULES else (1, 0)
    for _ in range(3):
        with dl.consume(dl.numpy_dlpack(a, max_version=(1, 0))) as t:
            assert t.version == expected
            assert t.data == a.ctypes.data
    with dl.consume(dl.numpy_dlpack(a), legacy_writable=True) as legacy:
        assert legacy.version is None
