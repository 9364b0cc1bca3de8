"""Property tests: any host Tensor survives any pickle protocol, in band and out of band, with
its name, dtype, shape and bytes; any damage to its metadata header raises."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pb_tensor import Tensor, TritonModelException
from pb_tensor.tensor import _rebuild_tensor

DTYPES = st.sampled_from(
    [np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32,
     np.int64, np.float16, np.float32, np.float64]
).map(np.dtype)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
NAMES = st.text(min_size=1, max_size=40)


@st.composite
def tensors(draw: st.DrawFn) -> tuple[Tensor, np.ndarray[Any, Any]]:
    if draw(st.booleans()):
        array = draw(hnp.arrays(DTYPES, SHAPES))
    else:
        elements = st.one_of(st.binary(max_size=8), st.text(max_size=8))
        array = draw(hnp.arrays(np.dtype(object), SHAPES, elements=elements))
    return Tensor(draw(NAMES), array), array


def _payload_bytes(t: Tensor) -> bytes:
    out = t.as_numpy()
    if out.dtype == object:
        return repr([x if isinstance(x, bytes) else str(x).encode() for x in out.flat]).encode()
    return bytes(out.tobytes())


@settings(max_examples=300, deadline=None)
@given(tensors(), st.integers(0, pickle.HIGHEST_PROTOCOL), st.booleans())
def test_any_tensor_round_trips(
    case: tuple[Tensor, np.ndarray[Any, Any]], protocol: int, out_of_band: bool
) -> None:
    t, _array = case
    buffers: list[pickle.PickleBuffer] = []
    if out_of_band and protocol == 5:
        stream = pickle.dumps(t, protocol=5, buffer_callback=buffers.append)
        loaded = pickle.loads(stream, buffers=[bytes(b.raw()) for b in buffers])
    else:
        loaded = pickle.loads(pickle.dumps(t, protocol=protocol))
    assert loaded.name() == t.name()
    assert loaded.triton_dtype() is t.triton_dtype()
    assert loaded.shape() == t.shape()
    assert loaded.byte_size == t.byte_size
    assert _payload_bytes(loaded) == _payload_bytes(t)


@settings(max_examples=200, deadline=None)
@given(tensors(), st.data())
def test_any_header_damage_raises(case: tuple[Tensor, np.ndarray[Any, Any]], data: Any) -> None:
    t, _array = case
    _rebuild, (header, payload) = t.__reduce_ex__(5)
    damaged = bytearray(header)
    # Up to four bytes anywhere in the header, each changed (CRC-32 detects every burst of up
    # to 32 bits; wider damage is detected with probability 1 - 2**-32).
    start = data.draw(st.integers(0, len(header) - 1))
    for i in range(start, min(start + data.draw(st.integers(1, 4)), len(header))):
        damaged[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(TritonModelException, match=r"^Tensor pickle is corrupted or truncated: "):
        _rebuild_tensor(bytes(damaged), payload)
