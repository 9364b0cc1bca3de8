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


# ------------------------------------------------------------------------------------------------
# BufferExporter's prepared block: later exports copy the first one's packed bytes


def prepared(exporter: dl.BufferExporter) -> object:
    """The exporter's prepared block (None until its first plain versioned export)."""
    return exporter._prepared


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(24, dtype=np.int16).reshape(2, 3, 4)[:, ::2],  # strided
        np.array(7.5),  # 0-d: no shape or strides pointers
        np.arange(5, dtype=np.uint8)[::-1],  # negative stride
    ],
)
def test_prepared_exports_describe_the_same_tensor(array: np.ndarray[Any, Any]) -> None:
    exporter = dl.BufferExporter.from_numpy(array)
    seen = []
    for _ in range(4):  # the 1st export packs, the 2nd prepares the block, the others copy it
        capsule = exporter.__dlpack__(max_version=(1, 3))
        with dl.consume(capsule) as t:
            seen.append((t.data, t.shape, t.strides, t.dtype, t.device, t.version, t.flags))
            np.testing.assert_array_equal(t.numpy(), array)
    assert isinstance(prepared(exporter), tuple)
    assert seen[0] == seen[1] == seen[2] == seen[3]
    generic = dl.export_buffer(array, seen[0][0], array.shape, seen[0][2], seen[0][3])
    with dl.consume(generic) as t:
        assert (t.data, t.shape, t.strides, t.dtype) == seen[0][:4]
    assert dl.live_exports() == 0


def test_one_off_exporter_packs_its_own_block() -> None:
    array = np.arange(3, dtype=np.int8)
    exporter = dl.BufferExporter.from_numpy(array)
    np.testing.assert_array_equal(np.from_dlpack(exporter), array)
    assert prepared(exporter) is False  # one export: nothing prepared
    np.testing.assert_array_equal(np.from_dlpack(exporter), array)
    assert isinstance(prepared(exporter), tuple)
    gc.collect()
    assert dl.live_exports() == 0


def test_prepared_export_keeps_read_only_and_numpy_interop() -> None:
    array = np.arange(6, dtype=np.float64)
    array.flags.writeable = False
    exporter = dl.BufferExporter.from_numpy(array)
    for _ in range(3):
        view = np.from_dlpack(exporter)
        assert not view.flags.writeable
        np.testing.assert_array_equal(view, array)
        with dl.consume(exporter.__dlpack__(max_version=(1, 0))) as t:
            assert t.readonly
    del view
    gc.collect()
    assert dl.live_exports() == 0


def test_relabelled_or_legacy_requests_take_the_general_export() -> None:
    array = np.arange(4, dtype=np.int32)
    exporter = dl.BufferExporter(array, array.ctypes.data, (4,), None, dl.DataType(0, 32, 1),
                                 (3, 0))  # kDLCUDAHost: host memory, relabelled on request
    with dl.consume(exporter.__dlpack__(max_version=(1, 3), dl_device=(1, 0))) as t:
        assert t.device == (dl.DLDeviceType.kDLCPU, 0)
    assert prepared(exporter) is None
    with dl.consume(exporter.__dlpack__()) as t:  # legacy capsule
        assert t.version is None
        assert t.device == (dl.DLDeviceType.kDLCUDAHost, 0)
    assert prepared(exporter) is None
    for _ in range(2):
        with dl.consume(exporter.__dlpack__(max_version=(1, 3))) as t:
            assert t.device == (dl.DLDeviceType.kDLCUDAHost, 0)
            np.testing.assert_array_equal(t.numpy(), array)
    assert isinstance(prepared(exporter), tuple)
    del t  # its view was made: the release waited for the tensor object
    assert dl.live_exports() == 0
