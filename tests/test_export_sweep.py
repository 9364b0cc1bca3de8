"""The export-time sweep of the pending queue: released entries go in batches of up to
``SWEEP_LIMIT``, while still-held capsules cost at most ``EXPORT_SWEEP_STEP`` checks per export."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import dlpack_ctypes as dl
from dlpack_ctypes import _blocks


@pytest.fixture
def no_gc() -> Iterator[None]:
    dl.flush()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_released_entries_leave_in_one_batch(no_gc: None) -> None:
    exporter = dl.BufferExporter.from_numpy(np.arange(6, dtype=np.float32))
    for _ in range(_blocks.SWEEP_LIMIT):
        view = np.from_dlpack(exporter)  # consumed by numpy, released when dropped
        del view
    assert _blocks.pending_count() == _blocks.SWEEP_LIMIT
    np.testing.assert_array_equal(np.from_dlpack(exporter), np.arange(6, dtype=np.float32))
    # One export past the limit removed every released entry, not EXPORT_SWEEP_STEP of them.
    assert _blocks.pending_count() <= 1
    assert dl.live_exports() == 0


def test_held_capsules_still_bound_the_checks(monkeypatch: pytest.MonkeyPatch,
                                              no_gc: None) -> None:
    a = np.zeros(3)
    held = [dl.to_dlpack(a) for _ in range(200)]
    examined = [0]
    real = _blocks._getrefcount

    def counting(obj: object) -> int:
        examined[0] += 1
        return int(real(obj)) + 1  # + 1: this wrapper's own argument

    monkeypatch.setattr(_blocks, "_getrefcount", counting)
    dropped: list[Any] = []
    for _ in range(50):
        examined[0] = 0
        dropped.append(dl.to_dlpack(a))
        assert examined[0] <= _blocks.EXPORT_SWEEP_STEP, examined[0]
    monkeypatch.undo()
    del dropped  # dropped unconsumed: the sweeps release them
    assert len(held) == 200
    del held
    assert dl.live_exports() == 0
    assert _blocks.pending_count() == 0


def test_dropped_unconsumed_capsules_are_released_by_exports(no_gc: None) -> None:
    a = np.zeros(2)
    for _ in range(3 * _blocks.SWEEP_LIMIT):
        dl.to_dlpack(a)  # dropped at once, never consumed
        assert _blocks.pending_count() <= _blocks.SWEEP_LIMIT + 1
    # Every one of them but the queue's tail was released by a sweep, not left to flush().
    assert len(_blocks.LIVE) <= _blocks.SWEEP_LIMIT + 1
    assert dl.live_exports() == 0
