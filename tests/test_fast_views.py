"""The fast paths of the consumer: ``DLPackTensor.numpy()`` without ``__array_interface__`` and
the memo sets of validated shapes and strides in the managed-tensor parser.

Each fast path must give the same values, the same errors and the same release (deleter once,
not before the last view is gone) as the general path it shortcuts.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import dlpack_ctypes as dl
from dlpack_ctypes import _tensor
from dlpack_ctypes._views import ViewOwner


def _learn(make_capsule: Any, a: np.ndarray[Any, Any]) -> None:
    """One view through the general path: numpy() learns the dtype's numpy type there."""
    capsule, _info = make_capsule(a)
    with dl.consume(capsule) as t:
        t.numpy()
    gc.collect()


def test_fast_view_values_writes_and_base(make_capsule: Any) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    _learn(make_capsule, a)
    capsule, info = make_capsule(a)
    t = dl.consume(capsule)
    view = t.numpy()
    assert type(view.base) is ViewOwner
    assert view.base.tensor is t
    assert view.dtype == np.float32
    assert view.shape == (3, 4)
    assert view.flags.writeable
    assert view.__array_interface__["data"][0] == a.ctypes.data
    np.testing.assert_array_equal(view, a)
    view[1, 2] = -1.0
    assert a[1, 2] == -1.0
    # A second call takes the same path and shares the memory.
    again = t.numpy()
    assert again.__array_interface__["data"][0] == a.ctypes.data
    assert t.__array_interface__ is None  # no interface was built
    del view, again, t
    gc.collect()
    assert info.calls == 1


def test_fast_view_keeps_tensor_alive_past_close(make_capsule: Any) -> None:
    a = np.arange(6, dtype=np.int64)
    _learn(make_capsule, a)
    capsule, info = make_capsule(a)
    t = dl.consume(capsule)
    view = t.numpy()
    t.close()
    assert info.calls == 0  # the view still uses the memory
    with pytest.raises(BufferError, match="the tensor was closed"):
        t.numpy()
    del t
    gc.collect()
    assert info.calls == 0
    assert view.sum() == 15
    sub = view[2:]  # numpy collapses the base chain to the owner, which keeps the tensor
    del view
    gc.collect()
    assert info.calls == 0
    assert sub.tolist() == [2, 3, 4, 5]
    del sub
    gc.collect()
    assert info.calls == 1


def test_closed_before_numpy_releases_at_once(make_capsule: Any) -> None:
    a = np.arange(6, dtype=np.float64)
    capsule, info = make_capsule(a)
    t = dl.consume(capsule)
    t.numpy()  # learns float64's numpy dtype; the view is dropped at once
    gc.collect()
    t2_capsule, info2 = make_capsule(a)
    t2 = dl.consume(t2_capsule)
    t2.close()
    assert info2.calls == 1
    with pytest.raises(BufferError, match="the tensor was closed"):
        t2.numpy()
    del t
    gc.collect()
    assert info.calls == 1
    assert info2.calls == 1


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"flags": 1}, "read-only"),
        ({"strides": (1, 3)}, "not C order"),
        ({"shape": (0, 3), "data": 0}, "empty with a NULL data pointer"),
    ],
)
def test_general_path_still_taken(make_capsule: Any, kwargs: dict[str, Any], why: str) -> None:
    a = np.arange(6, dtype=np.float32)
    _learn(make_capsule, a)
    if "shape" not in kwargs:
        kwargs = {**kwargs, "shape": (2, 3) if "strides" not in kwargs else (3, 2)}
    capsule, info = make_capsule(a, **kwargs)
    t = dl.consume(capsule)
    view = t.numpy()
    assert type(view.base) is not ViewOwner, why
    assert t.__array_interface__ is not None
    if why == "read-only":
        assert not view.flags.writeable
        np.testing.assert_array_equal(view, a.reshape(2, 3))
    elif why == "not C order":
        np.testing.assert_array_equal(view, a.reshape(2, 3).T)
    else:
        assert view.shape == (0, 3)
        assert view.__array_interface__["data"][0] != 0  # numpy gets a valid address
    del view, t
    gc.collect()
    assert info.calls == 1


def test_empty_tensor_with_data_may_take_the_fast_path(make_capsule: Any) -> None:
    a = np.arange(6, dtype=np.float32)
    _learn(make_capsule, a)
    dl.c_strides((0, 3))  # the C strides of the shape are known (as after any earlier use)
    capsule, info = make_capsule(a, shape=(0, 3))
    t = dl.consume(capsule)
    view = t.numpy()
    assert view.shape == (0, 3)
    assert view.dtype == np.float32
    assert view.size == 0
    del view, t
    gc.collect()
    assert info.calls == 1


def test_fast_view_for_every_native_dtype(make_capsule: Any) -> None:
    for char in "?bBhHiIlLqQefdFD":
        a = np.ones(5, dtype=char)
        capsule, info = make_capsule(a)
        t = dl.consume(capsule)
        first = t.numpy()
        second = t.numpy()  # the dtype is known after the first view
        assert first.dtype == second.dtype == a.dtype, char
        np.testing.assert_array_equal(second, a)
        del first, second, t
        gc.collect()
        assert info.calls == 1, char


def test_validated_shape_and_stride_memos_are_exact(make_capsule: Any) -> None:
    a = np.arange(6, dtype=np.float32)
    capsule, info = make_capsule(a, shape=(2, 3))
    dl.consume(capsule).close()
    assert (2, 3) in _tensor._POSITIVE_SHAPES
    assert (3, 1) in _tensor._SAFE_STRIDES
    # A shape seen valid does not excuse a NULL data pointer.
    capsule, info2 = make_capsule(shape=(2, 3), data=0)
    with pytest.raises(BufferError, match="NULL data pointer with shape=\\(2, 3\\)"):
        dl.consume(capsule)
    # Negative dimensions and huge strides are never remembered and keep their errors.
    capsule, info3 = make_capsule(a, shape=(2, -3), strides=(3, 1))
    with pytest.raises(BufferError, match="negative dimension"):
        dl.consume(capsule)
    assert (2, -3) not in _tensor._POSITIVE_SHAPES
    huge = (2**62, 1)
    capsule, info4 = make_capsule(a, shape=(2, 3), strides=huge, dtype=(2, 32, 1))
    with pytest.raises(BufferError, match="does not fit 64 bits"):
        dl.consume(capsule)
    assert huge not in _tensor._SAFE_STRIDES
    del capsule  # refused before it was consumed: dropping it releases it
    gc.collect()
    assert (info.calls, info2.calls, info3.calls, info4.calls) == (1, 1, 1, 1)


def test_view_owner_refuses_python_level_access(make_capsule: Any) -> None:
    a = np.arange(6, dtype=np.float32)
    _learn(make_capsule, a)
    capsule, info = make_capsule(a)
    t = dl.consume(capsule)
    view = t.numpy()
    owner = view.base
    assert type(owner) is ViewOwner
    message = "ViewOwner is the base of a numpy view of a DLPack tensor; use the view itself"
    with pytest.raises(TypeError, match=message):
        owner[0]
    with pytest.raises(TypeError, match=message):
        owner[0] = b"x"
    with pytest.raises(TypeError, match=message):
        len(owner)
    with pytest.raises(TypeError, match=message):
        owner.value  # noqa: B018
    with pytest.raises(TypeError, match=message):
        owner.raw  # noqa: B018
    np.testing.assert_array_equal(view, a)  # the view itself is unaffected
    del view, owner, t
    gc.collect()
    assert info.calls == 1
