"""The exchange import's one-read path (``dlpack_ctypes._adopt``) against the general parser.

An owning ``DLManagedTensorVersioned*`` from an exchange table is read with one struct read
when it is the common tensor (valid dtype and device, a shape seen before, C strides, data set)
and by :func:`dlpack_ctypes._tensor.fill` otherwise. Both must describe every tensor exactly as
consuming the same struct from a capsule does, call the deleter exactly once, raise the same
errors, and call the consumer's check on either path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import CapsuleFactory

import dlpack_ctypes as dl
from dlpack_ctypes import _adopt
from dlpack_ctypes.abi import DLPACK_FLAG_BITMASK_READ_ONLY


def _owned(make_capsule: CapsuleFactory, array: np.ndarray[Any, Any], **kwargs: Any) -> int:
    """The managed struct of a hand-built capsule, taken over as an exchange call hands it."""
    capsule, _info = make_capsule(array, destructor=False, **kwargs)
    pointer = make_capsule.pointer(capsule, b"dltensor_versioned")
    make_capsule.rename(capsule, b"used_dltensor_versioned")
    return pointer


def _fields(t: dl.DLPackTensor) -> tuple[Any, ...]:
    return (t.data, t.byte_offset, t.device, t.dtype, t.shape, t.strides, t.readonly, t.version,
            t.flags)  # fmt: skip


def _one_read_taken(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the general parser's calls from the adopt functions."""
    calls: list[int] = []
    real = _adopt.fill

    def spy(*args: Any) -> int:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_adopt, "fill", spy)
    return calls


CASES: dict[str, dict[str, Any]] = {
    "C strides": {},
    "NULL strides": {"strides": None},
    "byte offset": {"byte_offset": 8},
    "read-only flag": {"flags": DLPACK_FLAG_BITMASK_READ_ONLY},
    "version 1.0": {"version": (1, 0)},
    "NULL deleter": {"deleter": False},
    "Fortran strides": {"strides": (1, 3)},
    "0-d": {"shape": ()},
    "empty": {"shape": (0, 4)},
    "unknown device type": {"device": (99, 0)},
    "NULL data": {"data": 0},
    "bad bits": {"dtype": (2, 12, 1)},
    "major version 2": {"version": (2, 0)},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_tensor_as_consuming_a_capsule(make_capsule: CapsuleFactory, case: str) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    kwargs = CASES[case]
    consumed = _error_or_fields(lambda: dl.consume(make_capsule(a, **kwargs)[0]))
    # Twice: the first sees the shape for the first time (general parser), the second may take
    # the one-read path; both must agree with the capsule.
    for _ in range(2):
        adopted = _error_or_fields(lambda: _adopt.adopt(_owned(make_capsule, a, **kwargs)))
        assert adopted == consumed
    # make_capsule: every struct, adopted or refused, released exactly once.


def _error_or_fields(fn: Any) -> Any:
    try:
        t = fn()
    except BufferError as exc:
        return (type(exc), str(exc))
    fields = _fields(t)
    view = t.numpy() if t.data else None
    t.close()
    del t, view
    return fields


def test_common_tensor_takes_one_read(
    make_capsule: CapsuleFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    dl.consume(make_capsule(a)[0]).close()  # the shape is now known all positive
    calls = _one_read_taken(monkeypatch)
    t = _adopt.adopt(_owned(make_capsule, a))
    assert calls == []
    np.testing.assert_array_equal(t.numpy(), a)
    # Strides that are not C order, a new shape: the general parser.
    _adopt.adopt(_owned(make_capsule, a, strides=(1, 2))).close()
    _adopt.adopt(_owned(make_capsule, np.zeros((7, 5), np.float32))).close()
    assert calls == [1, 1]


def test_adopt_calls_check_on_both_paths(make_capsule: CapsuleFactory) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    seen: list[tuple[int, ...]] = []
    for _ in range(2):
        _adopt.adopt(_owned(make_capsule, a), check=lambda t: seen.append(t.shape)).close()
    assert seen == [(2, 3), (2, 3)]


def test_accepted_tensors_skip_the_check(make_capsule: CapsuleFactory) -> None:
    # accepts: what the check passes in every C-contiguous tensor (Triton's tables).
    accepts = ({(2, 32, 1)}, {1})
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    seen: list[str] = []

    def check(t: dl.DLPackTensor) -> None:
        seen.append(f"{t.dtype.code}/{t.dtype.bits} {t.strides}")
        if t.dtype.bits != 32:
            raise TypeError("refused")

    dl.consume(make_capsule(a)[0]).close()  # the shape is now known all positive
    t = _adopt.adopt(_owned(make_capsule, a), check=check, accepts=accepts)
    assert seen == []  # one-read path, listed dtype and device: no call
    np.testing.assert_array_equal(t.numpy(), a)
    # Not C order, or a dtype not listed: the check decides, with its own error.
    _adopt.adopt(_owned(make_capsule, a, strides=(1, 2)), check=check, accepts=accepts).close()
    with pytest.raises(TypeError, match=r"^refused$"):
        _adopt.adopt(_owned(make_capsule, a.astype(np.float64)), check=check, accepts=accepts)
    assert seen == ["2/32 (1, 2)", "2/64 (3, 1)"]
