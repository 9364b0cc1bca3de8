"""pb_tensor.bytes_codec: BYTES wire format, byte-identical to upstream except the np.bytes_ fix."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pb_tensor import _bytes_join, _bytes_split, bytes_codec
from pb_tensor.bytes_codec import (
    deserialize,
    deserialize_bytes_tensor,
    serialize,
    serialize_byte_tensor,
)
from pb_tensor.errors import TritonModelException

INCOMPLETE = "Invalid bytes tensor data: incomplete length field"
BEYOND = "Invalid bytes tensor data: string extends beyond buffer"


# ------------------------------------------------------------------------------------------------
# Oracles: upstream's algorithms restated element by element.


def reference_serialize(array: np.ndarray[Any, Any], *, fix_np_bytes: bool = True) -> Any:
    """triton_python_backend_utils.serialize_byte_tensor, one element at a time.

    ``fix_np_bytes=False`` keeps upstream's quirk (``np.bytes_`` elements of an object array are
    turned into ``"b'...'"``); True applies pb_tensor's fix.
    """
    if array.size == 0:
        return ()
    is_object = array.dtype == np.object_
    if not is_object and array.dtype.type != np.bytes_:
        return None
    chunks: list[bytes] = []
    cell: Any
    for cell in np.nditer(array, flags=["refs_ok"], order="C"):
        value = cell.item()
        if not is_object or type(value) is bytes:
            data = value
        elif fix_np_bytes and isinstance(value, np.bytes_):
            data = bytes(value)
        else:
            data = str(value).encode("utf-8")
        chunks.append(struct.pack("<I", len(data)))
        chunks.append(data)
    return b"".join(chunks)


def reference_deserialize(data: bytes) -> list[bytes]:
    """The C++ deserializer's validation, then upstream's element list."""
    items: list[bytes] = []
    pos = 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise TritonModelException(INCOMPLETE)
        (length,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + length > len(data):
            raise TritonModelException(BEYOND)
        items.append(data[pos : pos + length])
        pos += length
    return items


def wire(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def objects(*items: Any, shape: tuple[int, ...] | None = None) -> np.ndarray[Any, Any]:
    out = np.empty(len(items), dtype=object)
    out[:] = list(items)
    return out if shape is None else out.reshape(shape)


def tritonclient_serialize(array: np.ndarray[Any, Any]) -> Any:
    """tritonclient.utils' result in upstream's types: a 0-d object array wraps the bytes."""
    tu = pytest.importorskip("tritonclient.utils")
    out = tu.serialize_byte_tensor(array)
    if out.size == 0:
        return ()
    return out.item()


def assert_bytes_array(result: np.ndarray[Any, Any], expected: list[bytes]) -> None:
    assert result.dtype == np.dtype(object)
    assert result.ndim == 1
    assert result.shape == (len(expected),)
    assert all(type(x) is bytes for x in result)
    assert result.tolist() == expected


class BytesSubclass(bytes):
    """A user-defined bytes subclass: upstream stringifies it, and so do we."""


# ------------------------------------------------------------------------------------------------
# Serialisation edge cases (upstream.md 3.2)

S = np.bytes_

EDGE_CASES: dict[str, np.ndarray[Any, Any]] = {
    "object-str": objects("abc", "de"),
    "object-bytes": objects(b"abc", b"de"),
    "object-bytes-trailing-nul": objects(b"d\x00", b"\x00", b"\x00\x00x\x00"),
    "object-bytes-embedded-nul": objects(b"abc\x00def", b"\x00a"),
    "object-empty-strings": objects(b"", "", b""),
    "object-utf8-emoji": objects("é😀", "日本語", "\U0001f600"),
    "object-np-str": objects(np.str_("ab"), np.str_("é")),
    "object-mixed-str": objects(1, 2.5, None, True, np.int64(7), np.float32(1.5), "x", b"y"),
    "object-mixed-containers": objects([1, 2], (3,), {"k": 1}, np.array([1, 2]), 1 + 2j),
    "object-bytearray-memoryview": objects(bytearray(b"ab"), b"cd"),
    "object-bytes-subclass": objects(BytesSubclass(b"sub"), b"plain"),
    "object-long-elements": objects(b"x" * 300, b"y" * 70000, b"z"),
    "object-long-then-coerced": objects(b"a", b"x" * 1024, "é", 3, b"y" * 1023),
    "object-1024-elements": objects(*(bytes([i % 256]) * (i % 3) for i in range(1024))),
    "object-1025-elements": objects(*(bytes([i % 256]) * (i % 3) for i in range(1025))),
    "object-1025-str": objects(*(str(i) for i in range(1025))),
    "S-128-elements": np.array([bytes([97 + i % 26]) * (i % 4) for i in range(128)], dtype="S3"),
    "S-129-elements": np.array([bytes([97 + i % 26]) * (i % 4) for i in range(129)], dtype="S3"),
    "S-1-trailing-nul": np.array([b"ab\x00"], dtype="S3"),
    "object-1-str": objects("é"),
    "object-large-mean": objects(*(bytes([i]) * (1000 + i) for i in range(8))),
    "object-many-large": objects(*(bytes([i]) * (600 + 7 * i) for i in range(80))),
    "object-many-small": objects(*(bytes([i]) * (i % 7) for i in range(80))),
    "object-2d": objects(b"a", b"bb", b"ccc", b"dddd", b"", b"f", shape=(2, 3)),
    "object-3d-fortran": np.asfortranarray(
        objects(*(bytes([97 + i]) * i for i in range(24)), shape=(2, 3, 4))
    ),
    "object-transposed": objects(*(str(i) for i in range(12)), shape=(3, 4)).T,
    "object-strided": objects(*(bytes([65 + i]) * (i % 5) for i in range(20)))[::3],
    "object-0d-bytes": np.array(b"xyz", dtype=object),
    "object-0d-str": np.array("é", dtype=object),
    "S-trailing-nuls": np.array([b"ab\x00\x00", b"c"], dtype="S4"),
    "S-embedded-nul": np.array([b"abc\x00def", b"\x00x", b"y\x00"], dtype="S8"),
    "S-all-full": np.array([b"abcde", b"fghij"], dtype="S5"),
    "S-all-empty": np.array([b"", b"", b""], dtype="S3"),
    "S-mixed-lengths-2d": np.array([[b"a", b"bb", b"ccc"], [b"", b"ddddd", b"e"]], dtype="S5"),
    "S-fortran": np.asfortranarray(np.array([[b"a", b"bb"], [b"ccc", b""]], dtype="S3")),
    "S-strided": np.array([b"a", b"b", b"cc", b"d", b"eee"], dtype="S3")[::2],
    "S-transposed": np.array([[b"a", b"bb", b"c"], [b"dd", b"e", b""]], dtype="S2").T,
    "S-0d": np.array(b"xyz", dtype="S3"),
    "S-0d-trailing-nul": np.array(b"xy\x00", dtype="S3"),
    "S-wide-uint16-index": np.array([b"a" * 260, b"b", b""], dtype="S300"),
    "S-very-wide-int64-index": np.array([b"c" * 65540, b"d", b""], dtype="S70000"),
    "S-utf8": np.array(["é😀".encode(), b"x"], dtype="S8"),
    "S-all-nul-bytes": np.array([b"\x00\x00", b"\x00a"], dtype="S2"),
}


@pytest.mark.parametrize("array", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_serialize_matches_reference(array: np.ndarray[Any, Any]) -> None:
    expected = reference_serialize(array)
    result = serialize(array)
    assert result.dtype == np.uint8
    assert result.ndim == 1
    assert result.tobytes() == expected
    public = serialize_byte_tensor(array)
    assert type(public) is bytes
    assert public == expected


@pytest.mark.parametrize("array", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_round_trip(array: np.ndarray[Any, Any]) -> None:
    encoded = serialize_byte_tensor(array)
    assert isinstance(encoded, bytes)
    assert_bytes_array(deserialize_bytes_tensor(encoded), reference_deserialize(encoded))
    assert_bytes_array(deserialize(serialize(array), array.size), reference_deserialize(encoded))


@pytest.mark.parametrize("array", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_serialize_matches_tritonclient(array: np.ndarray[Any, Any]) -> None:
    # tritonclient keeps upstream's np.bytes_ quirk; none of these cases hold np.bytes_.
    assert serialize_byte_tensor(array) == tritonclient_serialize(array)


def test_documented_examples() -> None:
    assert serialize_byte_tensor(objects("abc", "de")) == b"\x03\x00\x00\x00abc\x02\x00\x00\x00de"
    assert serialize_byte_tensor(objects(1, 2.5, None)) == wire(b"1", b"2.5", b"None")
    assert serialize_byte_tensor(objects(True, np.int64(7))) == wire(b"True", b"7")
    assert serialize_byte_tensor(objects("é😀")) == wire("é😀".encode())
    assert len("é😀".encode()) == 6
    assert serialize_byte_tensor(objects(b"d\x00")) == wire(b"d\x00")
    s_array = np.array([b"ab\x00\x00", b"c"], dtype="S4")
    assert serialize_byte_tensor(s_array) == wire(b"ab", b"c")
    assert serialize_byte_tensor(np.array([b"abc\x00def"], dtype="S7")) == wire(b"abc\x00def")
    assert serialize_byte_tensor(objects(bytearray(b"ab"))) == wire(b"bytearray(b'ab')")
    assert serialize_byte_tensor(objects(BytesSubclass(b"ab"))) == wire(b"b'ab'")


def test_np_bytes_in_object_array_serialises_as_its_bytes() -> None:
    """The deliberate fix: upstream (and tritonclient) write "b'ab'" for np.bytes_(b"ab")."""
    array = objects(np.bytes_(b"ab"), b"cd", np.bytes_(b"e\x00"), "f")
    assert serialize_byte_tensor(array) == wire(b"ab", b"cd", b"e\x00", b"f")
    assert serialize(array).tobytes() == wire(b"ab", b"cd", b"e\x00", b"f")
    # Upstream: str() of np.bytes_ is its repr, which also drops the trailing NUL.
    assert reference_serialize(array, fix_np_bytes=False) == wire(b"b'ab'", b"cd", b"b'e'", b"f")
    assert tritonclient_serialize(array) == reference_serialize(array, fix_np_bytes=False)


def test_only_np_bytes_elements() -> None:
    array = objects(np.bytes_(b"x"), np.bytes_(b""), np.bytes_(b"yz"))
    assert serialize_byte_tensor(array) == wire(b"x", b"", b"yz")


def test_unencodable_str_raises_like_upstream() -> None:
    array = objects("ok", "\ud800")
    with pytest.raises(UnicodeEncodeError):
        reference_serialize(array)
    with pytest.raises(UnicodeEncodeError):
        serialize_byte_tensor(array)
    with pytest.raises(UnicodeEncodeError):
        serialize(array)


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3, 4), (0, 0)])
@pytest.mark.parametrize("dtype", [object, "S5", np.float32, "U3"])
def test_empty_arrays(shape: tuple[int, ...], dtype: Any) -> None:
    array = np.empty(shape, dtype=dtype)
    assert serialize_byte_tensor(array) == ()
    assert reference_serialize(array) == ()
    if np.dtype(dtype) in (np.dtype(object), np.dtype("S5")):
        result = serialize(array)
        assert result.dtype == np.uint8
        assert result.shape == (0,)
        assert deserialize(result, 0).shape == (0,)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, "U3", "V4", np.uint8])
def test_other_dtypes(dtype: Any) -> None:
    array = np.zeros(3, dtype=dtype)
    assert serialize_byte_tensor(array) is None
    assert reference_serialize(array) is None
    with pytest.raises(TritonModelException, match="object or bytes"):
        serialize(array)


def test_serialize_header_bytes_for_every_width() -> None:
    """Length fields >= 2**8, 2**16 and 2**24 in the many-small-elements path."""
    big = b"\x01" * ((1 << 24) + 3)
    items = [b"ab"] * 40_000 + [big, b"", b"x" * 65_537, b"y" * 257]
    array = objects(*items)
    assert serialize(array).tobytes() == reference_serialize(array)
    assert_bytes_array(deserialize(serialize(array)), items)


class NarrowLengths(struct.Struct):
    """``<I`` whose ``pack`` refuses values over 10 as ``struct`` refuses values over 2**32 - 1."""

    def pack(self, *values: Any) -> bytes:
        if values[0] > 10:
            raise struct.error("'I' format requires 0 <= number <= 10")
        return super().pack(*values)


def test_length_field_range_is_structs() -> None:
    """The few-element path relies on ``struct`` refusing lengths that do not fit."""
    with pytest.raises(struct.error):
        _bytes_join.U32.pack(1 << 32)
    assert _bytes_join.U32.pack((1 << 32) - 1) == b"\xff\xff\xff\xff"


@pytest.mark.parametrize("count", [1, 3, 1024, 1025])
def test_element_too_long_for_the_length_field(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    # Stands in for a 4 GiB element: the checks are the same, the memory is not needed.
    monkeypatch.setattr(_bytes_join, "MAX_ELEMENT", 10)
    monkeypatch.setattr(_bytes_join, "U32", NarrowLengths("<I"))
    # The table of length fields is read in both modules (serialize_byte_tensor inlines a loop).
    for module in (_bytes_join, bytes_codec):
        monkeypatch.setattr(module, "HEADS", [])
        monkeypatch.setattr(module, "HEAD_CAP", 0)
    array = objects(*([b"x"] * (count - 1)), b"y" * 11)
    with pytest.raises(TritonModelException) as info:
        serialize(array)
    assert str(info.value) == "BYTES element of 11 bytes does not fit the 32-bit length field"
    with pytest.raises(TritonModelException) as info:
        serialize_byte_tensor(array)
    assert str(info.value) == "BYTES element of 11 bytes does not fit the 32-bit length field"


class StrRaises:
    """An element whose ``str()`` fails, as upstream's ``str(x)`` would propagate it."""

    def __init__(self, exc: type[Exception]) -> None:
        self.exc = exc

    def __str__(self) -> str:
        raise self.exc("no text")


@pytest.mark.parametrize("exc", [IndexError, ValueError, struct.error])
@pytest.mark.parametrize("before", [[], [b"short"], [b"x" * 2000]], ids=["first", "after-short",
                                                                        "after-long"])
@pytest.mark.parametrize("count", [1, 3, 1100])
def test_element_str_errors_propagate(exc: type[Exception], before: list[bytes],
                                      count: int) -> None:
    array = objects(*before, StrRaises(exc), *([b"tail"] * count))
    for call in (serialize, serialize_byte_tensor, bytes_codec.serialize_with_lengths):
        with pytest.raises(exc, match="no text"):
            call(array)


def test_serialize_does_not_change_input() -> None:
    items = [b"a", "b", 3]
    array = objects(*items)
    serialize(array)
    assert array.tolist() == items


# ------------------------------------------------------------------------------------------------
# Deserialisation


def test_deserialize_empty() -> None:
    for empty in (b"", bytearray(), memoryview(b""), np.empty(0, np.uint8)):
        result = deserialize_bytes_tensor(empty)
        assert_bytes_array(result, [])
        assert_bytes_array(deserialize(empty, 0), [])


BUFFER_KINDS = {
    "bytes": bytes,
    "bytearray": bytearray,
    "memoryview": memoryview,
    "uint8-array": lambda b: np.frombuffer(b, dtype=np.uint8),
    "read-only-array": lambda b: np.frombuffer(bytes(b), dtype=np.uint8),
    "2d-array": lambda b: np.frombuffer(b, dtype=np.uint8).reshape(1, -1),
    "strided-array": lambda b: np.repeat(np.frombuffer(b, dtype=np.uint8), 2)[::2],
    "strided-memoryview": lambda b: memoryview(bytes(np.repeat(np.frombuffer(b, np.uint8), 2)))[
        ::2
    ],
}


@pytest.mark.parametrize("kind", BUFFER_KINDS.values(), ids=BUFFER_KINDS.keys())
@pytest.mark.parametrize(
    "items",
    [
        [b"abc", b"", b"d\x00", b"\x00" * 5],
        [b"same", b"size", b"four"],  # uniform fast path
        [b"", b"", b""],  # uniform, length 0
        [b"a\x00", b"b\x00"],  # uniform with trailing NULs kept
        [b"x" * 3000, b"y" * 2000, b"z"],  # large mean: memoryview slicing
        [b"q" * 5000] * 3,  # large uniform
        [b"a" * 5000, b"b", b"c" * 6000, b"d" * 7000, b"", b"e" * 4096],  # long runs, long last
        [b"s", b"l" * 4095, b"L" * 4096, b"s"],  # either side of the compiled-format cap
        [bytes(range(256)) * 3],
    ],
)
def test_deserialize_buffer_kinds(kind: Any, items: list[bytes]) -> None:
    buf = kind(wire(*items))
    assert_bytes_array(deserialize(buf), items)
    assert_bytes_array(deserialize(buf, len(items)), items)
    assert_bytes_array(deserialize_bytes_tensor(buf), items)


@pytest.mark.parametrize("total", [380, 383, 384, 385, 388, 392, 4092, 4095, 4096, 4097, 4104])
def test_deserialize_either_side_of_the_plain_loop(total: int) -> None:
    """Wire sizes around the plain-loop bounds, uniform and not, valid and truncated."""
    assert (_bytes_split.SMALL_WIRE, _bytes_split._FEW_WIRE) == (384, 4096)
    for first in (0, 1, 7):
        items = [b"f" * first]
        left = total - 4 - first
        while left >= 4:
            size = min(left - 4, 9)
            items.append(bytes([len(items) % 251]) * size)
            left -= 4 + size
        data = wire(*items) + b"\x00" * left
        for buf in (data, np.frombuffer(data, dtype=np.uint8), bytearray(data)):
            try:
                expected: list[bytes] | str = reference_deserialize(data)
            except TritonModelException as exc:
                expected = str(exc)
            try:
                got: list[bytes] | str = deserialize(buf).tolist()
            except TritonModelException as exc:
                got = str(exc)
            assert got == expected
    uniform = wire(*[b"abcd"] * (total // 8))
    assert_bytes_array(deserialize(uniform), [b"abcd"] * (total // 8))


def test_compiled_formats_stay_bounded() -> None:
    deserialize(wire(b"a" * 5000, b"b" * 70_000, b"c"))
    assert len(_bytes_split._PAIRS) == _bytes_split._PAIR_CAP


def test_deserialize_non_byte_format_memoryview() -> None:
    encoded = wire(b"abcd", b"efgh")
    words = np.frombuffer(encoded, dtype=np.uint32)
    assert_bytes_array(deserialize(words.data), [b"abcd", b"efgh"])
    assert_bytes_array(deserialize(words), [b"abcd", b"efgh"])


def test_deserialize_copies_out_of_the_buffer() -> None:
    for items in ([b"abc", b"de"], [b"same", b"size"], [b"l" * 4000, b"m" * 3000]):
        buf = bytearray(wire(*items))
        result = deserialize(np.frombuffer(buf, dtype=np.uint8), len(items))
        buf[:] = b"\xff" * len(buf)
        assert result.tolist() == items


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01", INCOMPLETE),
        (b"\x01\x00", INCOMPLETE),
        (b"\x01\x00\x00", INCOMPLETE),
        (wire(b"ab") + b"\x00", INCOMPLETE),
        (wire(b"ab") + b"\x00\x00\x00", INCOMPLETE),
        (wire(b"ab", b"") + b"\x01\x00", INCOMPLETE),
        (b"\x01\x00\x00\x00", BEYOND),
        (b"\x05\x00\x00\x00abc", BEYOND),
        (wire(b"ab") + b"\x03\x00\x00\x00ab", BEYOND),
        (b"\xff\xff\xff\xffabc", BEYOND),
        (wire(b"x" * 2000) + b"\xd0\x07\x00\x00" + b"y" * 1999, BEYOND),
        (wire(b"x" * 2000) + b"\xd0\x07", INCOMPLETE),
        (wire(b"s", b"l" * 5000) + b"\x00\x20\x00\x00" + b"L" * 8191, BEYOND),
        (wire(b"s", b"l" * 5000, b"m" * 6000) + b"\x01", INCOMPLETE),
        (wire(b"l" * 5000)[:-1], BEYOND),
        (wire(b"l" * 5000, b"s") + b"\x00\x00", INCOMPLETE),
    ],
)
@pytest.mark.parametrize("kind", BUFFER_KINDS.values(), ids=BUFFER_KINDS.keys())
def test_deserialize_errors(data: bytes, message: str, kind: Any) -> None:
    with pytest.raises(TritonModelException) as info:
        reference_deserialize(data)
    assert str(info.value) == message
    for call in (deserialize, deserialize_bytes_tensor):
        with pytest.raises(TritonModelException) as info:
            call(kind(data))
        assert str(info.value) == message
    with pytest.raises(TritonModelException) as info:
        deserialize(kind(data), 1)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("items", "count"),
    [
        ([b"abc", b"de"], 3),
        ([b"abc", b"de"], 1),
        ([b"same", b"size"], 3),  # uniform fast path
        ([b"same", b"size"], 1),
        ([b"", b""], 0),
        ([b"x" * 3000, b"y"], 5),
    ],
)
def test_deserialize_count_mismatch(items: list[bytes], count: int) -> None:
    for buf in (wire(*items), np.frombuffer(wire(*items), dtype=np.uint8)):
        with pytest.raises(TritonModelException) as info:
            deserialize(buf, count)
        assert str(info.value) == (
            f"Invalid bytes tensor data: expected {count} elements, found {len(items)}"
        )


def test_deserialize_empty_buffer_count_mismatch() -> None:
    with pytest.raises(TritonModelException) as info:
        deserialize(b"", 2)
    assert str(info.value) == "Invalid bytes tensor data: expected 2 elements, found 0"


def test_deserialize_not_a_buffer() -> None:
    with pytest.raises(TypeError):
        deserialize("abc")  # type: ignore[arg-type]


def test_deserialize_matches_tritonclient() -> None:
    tu = pytest.importorskip("tritonclient.utils")
    encoded = wire(b"abc", b"", b"\x00\x01", "é".encode())
    expected = tu.deserialize_bytes_tensor(encoded)
    result = deserialize_bytes_tensor(encoded)
    assert result.dtype == expected.dtype
    assert result.shape == expected.shape
    assert result.tolist() == expected.tolist()


def test_public_names() -> None:
    assert sorted(bytes_codec.__all__) == [
        "INDEX_MIN_ELEMENTS",
        "deserialize",
        "deserialize_bytes_tensor",
        "length_index",
        "serialize",
        "serialize_byte_tensor",
        "serialize_with_lengths",
    ]


# ------------------------------------------------------------------------------------------------
# Property tests

ELEMENT = st.one_of(
    st.binary(max_size=12),
    st.binary(max_size=300),
    st.sampled_from([b"", b"\x00", b"\x00\x00", b"a\x00", b"\x00a", b"\xff" * 4]),
    st.binary(min_size=4094, max_size=4098),  # around the compiled-format cap
)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data(), shape=SHAPES, fortran=st.booleans())
def test_object_arrays_property(data: st.DataObject, shape: tuple[int, ...], fortran: bool) -> None:
    size = int(np.prod(shape))
    items = data.draw(st.lists(ELEMENT, min_size=size, max_size=size))
    array = objects(*items).reshape(shape)
    if fortran:
        array = np.asfortranarray(array)
    expected = reference_serialize(array)
    assert serialize_byte_tensor(array) == expected
    if size == 0:
        assert serialize(array).size == 0
        return
    assert serialize(array).tobytes() == expected
    flat_c = np.ascontiguousarray(array).reshape(-1).tolist()
    assert_bytes_array(deserialize_bytes_tensor(expected), flat_c)
    assert_bytes_array(deserialize(np.frombuffer(expected, dtype=np.uint8), size), flat_c)


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data(), shape=SHAPES, width=st.integers(1, 9), step=st.integers(1, 3))
def test_fixed_width_arrays_property(
    data: st.DataObject, shape: tuple[int, ...], width: int, step: int
) -> None:
    size = int(np.prod(shape))
    items = data.draw(
        st.lists(st.binary(max_size=width), min_size=size * step, max_size=size * step)
    )
    array = np.array(items, dtype=f"S{width}")[::step].reshape(shape)
    expected = reference_serialize(array)
    assert serialize_byte_tensor(array) == expected
    if size:
        assert serialize(array).tobytes() == expected
        # numpy's S semantics: trailing NULs are gone, inner ones stay.
        stripped = [item.rstrip(b"\x00") for item in items[::step]]
        assert_bytes_array(deserialize(expected, size), stripped)


@settings(max_examples=300, deadline=None, database=None)
@given(
    items=st.lists(ELEMENT, max_size=20),
    cut=st.integers(0, 10_000),
    patch=st.none() | st.tuples(st.integers(0, 10_000), st.binary(min_size=1, max_size=4)),
)
def test_damaged_data_property(
    items: list[bytes], cut: int, patch: tuple[int, bytes] | None
) -> None:
    """Truncated or overwritten data: same elements or the same error as the C++ validator."""
    data = bytearray(wire(*items))
    if patch is not None and data:
        at, junk = patch
        at %= len(data)
        data[at : at + len(junk)] = junk
    data = data[: cut % (len(data) + 1)]
    try:
        expected: list[bytes] | str = reference_deserialize(bytes(data))
    except TritonModelException as exc:
        expected = str(exc)
    for buf in (bytes(data), np.frombuffer(bytes(data), dtype=np.uint8)):
        try:
            got: list[bytes] | str = deserialize(buf).tolist()
        except TritonModelException as exc:
            got = str(exc)
        assert got == expected


# ------------------------------------------------------------------------------------------------
# Stored element lengths (length index)

STORED = "Invalid bytes tensor data: stored element lengths"


def index_of(items: list[bytes]) -> bytes:
    """The documented layout, restated."""
    head = struct.pack("<8sQQ", b"pbtLENS1", len(items), len(wire(*items)))
    return head + b"".join(struct.pack("<I", len(item)) for item in items)


def test_length_index_layout() -> None:
    items = [b"ab", b"", b"cde\x00"]
    lengths = np.array([2, 0, 4], dtype=np.int64)
    assert bytes_codec.length_index(lengths) == index_of(items)
    assert bytes_codec.length_index(np.array([], dtype=np.int64)) == index_of([])
    assert index_of(items)[:24] == (
        b"pbtLENS1" + b"\x03" + b"\x00" * 7 + b"\x12" + b"\x00" * 7
    )


@pytest.mark.parametrize(
    "array",
    [
        objects(*(bytes([i % 256]) * (i % 9) for i in range(1025))),
        objects(*(str(i) for i in range(1100))),
        objects(*(b"x" * 600 for _ in range(1030))),  # large mean: joined with pack
        np.array([b"a\x00", b"bcd"] * 520, dtype="S4"),
        np.array([b"abcd"] * 1040, dtype="S4").reshape(20, 52),  # no trailing NULs anywhere
    ],
)
def test_serialize_with_lengths(array: np.ndarray[Any, Any]) -> None:
    out, lengths = bytes_codec.serialize_with_lengths(array)
    assert out.tobytes() == reference_serialize(array)
    assert lengths is not None
    assert lengths.dtype == np.uint32
    assert lengths.tolist() == [len(item) for item in reference_deserialize(out.tobytes())]


@pytest.mark.parametrize("count", [0, 1, 6, 64, 200, 1024])
@pytest.mark.parametrize("dtype", [object, "S2"])
def test_few_elements_have_no_lengths(count: int, dtype: Any) -> None:
    assert bytes_codec.INDEX_MIN_ELEMENTS == 1024
    array = np.array([b"ab"] * count, dtype=dtype)
    out, lengths = bytes_codec.serialize_with_lengths(array)
    assert out.tobytes() == (reference_serialize(array) if count else b"")
    assert lengths is None


INDEXED_CASES = {
    "short-mixed": [bytes([i % 256]) * (i % 33) for i in range(200)],
    "uniform": [b"abcd"] * 100,
    "uniform-empty": [b""] * 100,
    "uniform-trailing-nul": [b"a\x00"] * 100,
    "around-token-cap": [b"s" * 4095, b"", b"t" * 4094] * 30,
    "long-elements": [b"l" * 5000, b"s", b"m" * 4096] * 30,
    "more-than-a-chunk": [bytes([i % 7]) * (i % 5) for i in range(20_000)],
    "single": [b"only"],
}


@pytest.mark.parametrize("items", INDEXED_CASES.values(), ids=INDEXED_CASES.keys())
@pytest.mark.parametrize("kind", ["bytes", "uint8-array", "read-only-array"])
def test_deserialize_with_index(items: list[bytes], kind: str) -> None:
    data = wire(*items)
    buf: Any = {
        "bytes": data,
        "uint8-array": np.frombuffer(bytearray(data), dtype=np.uint8),
        "read-only-array": np.frombuffer(data, dtype=np.uint8),
    }[kind]
    index = index_of(items)
    assert_bytes_array(deserialize(buf, len(items), index=index), items)
    assert_bytes_array(deserialize(buf, index=index), items)
    assert_bytes_array(deserialize(buf, index=memoryview(index)), items)
    # An index followed by unrelated bytes (the slack of an allocation) reads the same.
    assert_bytes_array(deserialize(buf, index=index + b"\xff" * 13), items)


@pytest.mark.parametrize(
    "index",
    [b"", b"pbtLENS", b"x" * 24, b"pbtLENS2" + bytes(16), b"\x00" * 64],
    ids=["empty", "short-head", "other-magic", "other-version", "zeros"],
)
def test_not_an_index_is_ignored(index: bytes) -> None:
    items = [b"abc", b"", b"de"]
    assert_bytes_array(deserialize(wire(*items), 3, index=index), items)
    with pytest.raises(TritonModelException) as info:
        deserialize(wire(*items)[:-1], 3, index=index)
    assert str(info.value) == BEYOND


def patched(data: bytes, *patches: tuple[int, bytes]) -> bytes:
    out = bytearray(data)
    for at, value in patches:
        out[at : at + len(value)] = value
    return bytes(out)


ITEMS = [b"abc", b"", b"de", b"fghi"]  # 25 wire bytes; the index: 24-byte head + 4 lengths
INDEX = index_of(ITEMS)


@pytest.mark.parametrize(
    ("index", "count", "message"),
    [
        (INDEX, 5, "are for 4 elements, the tensor has 5"),
        (patched(INDEX, (8, b"\x05")), 4, "are for 5 elements, the tensor has 4"),
        (patched(INDEX, (8, b"\x05")), None, "are truncated: 40 bytes, 44 needed"),
        (patched(INDEX, (16, b"\x1a")), 4, "are for 26 bytes of data, found 25"),
        (INDEX[:-1], None, "are truncated: 39 bytes, 40 needed"),
        (patched(INDEX, (28, b"\x01")), 4, "add up to 26 bytes, the data has 25"),
        (
            patched(INDEX, (24, b"\x02"), (28, b"\x01")),
            None,
            "do not match the data: element 0 is stored as 2 bytes, its length field says 3",
        ),
        (
            patched(INDEX, (32, b"\x01"), (36, b"\x05")),
            4,
            "do not match the data: element 2 is stored as 1 bytes, its length field says 2",
        ),
    ],
)
def test_corrupted_index_raises(index: bytes, count: int | None, message: str) -> None:
    data = wire(*ITEMS)
    for buf in (data, np.frombuffer(data, dtype=np.uint8)):
        with pytest.raises(TritonModelException) as info:
            deserialize(buf, count, index=index)
        assert str(info.value) == f"{STORED} {message}"


def test_index_for_no_elements_over_data_raises() -> None:
    # Found by hypothesis: an index saying 0 elements (its size field patched to match) over the
    # 4 bytes of one empty element must not decode to an empty array.
    index = patched(index_of([]), (16, b"\x04"))
    with pytest.raises(TritonModelException) as info:
        deserialize(wire(b""), None, index=index)
    assert str(info.value) == f"{STORED} are for 0 elements, the data has 4 bytes"


def test_index_of_empty_data() -> None:
    assert_bytes_array(deserialize(b"", 0, index=index_of([])), [])
    with pytest.raises(TritonModelException) as info:
        deserialize(b"", 1, index=index_of([]))
    assert str(info.value) == f"{STORED} are for 0 elements, the tensor has 1"


@settings(max_examples=300, deadline=None, database=None)
@given(
    items=st.lists(ELEMENT, min_size=1, max_size=90),
    patch=st.lists(st.tuples(st.integers(0, 10_000), st.binary(min_size=1, max_size=4)),
                   max_size=3),
    damage_data=st.booleans(),
)
def test_index_never_gives_wrong_data(
    items: list[bytes], patch: list[tuple[int, bytes]], damage_data: bool
) -> None:
    """Any damage to the index (or the data): the walk's exact result, or an exception."""
    data = bytearray(wire(*items))
    index = bytearray(index_of(items))
    target = data if damage_data else index
    for offset, junk in patch:
        at = offset % len(target)
        target[at : at + len(junk)] = junk
    try:
        expected: list[bytes] | None = reference_deserialize(bytes(data))
    except TritonModelException:
        expected = None
    message = ""
    try:
        got: list[bytes] | None = deserialize(bytes(data), index=bytes(index)).tolist()
    except TritonModelException as exc:
        message = str(exc)
        got = None
    if got is None:
        assert message.startswith("Invalid bytes tensor data: ")
    if got is not None:
        assert got == expected
    if not patch:
        assert got == items


@settings(max_examples=300, deadline=None, database=None)
@given(items=st.lists(ELEMENT, max_size=120))
def test_length_index_round_trip(items: list[bytes]) -> None:
    index = bytes_codec.length_index(np.array([len(item) for item in items], dtype=np.int64))
    assert index == index_of(items)
    data = wire(*items)
    assert_bytes_array(deserialize(data, len(items), index=index), items)
    assert_bytes_array(deserialize(np.frombuffer(data, np.uint8), index=index), items)


@settings(max_examples=25, deadline=None, database=None)
@given(
    items=st.lists(st.binary(max_size=40), min_size=1025, max_size=1100),
    fixed=st.booleans(),
)
def test_serialise_index_deserialise_round_trip(items: list[bytes], fixed: bool) -> None:
    array = np.array(items, dtype="S40") if fixed else objects(*items)
    expected = [item.rstrip(b"\x00") for item in items] if fixed else items
    out, lengths = bytes_codec.serialize_with_lengths(array)
    assert lengths is not None
    assert out.tobytes() == reference_serialize(array)
    index = bytes_codec.length_index(lengths)
    assert index == index_of(expected)
    assert_bytes_array(deserialize(out, len(items), index=index), expected)
