"""The pickle format of :class:`pb_tensor.Tensor`: a checked metadata header plus one payload.

``Tensor.__reduce_ex__`` pickles as ``_rebuild_tensor(header, payload)``:

* ``header`` (``bytes``, little-endian): magic ``b"PBT"``, format version, flags, memory type,
  Triton dtype, ndim, memory type id, payload byte size, name length, the dims, the name (UTF-8)
  and a CRC-32 of everything before it. A flipped or missing byte in the metadata raises instead
  of loading a tensor with another name, dtype or shape.
* ``payload``: the host bytes (numeric data in C order, BF16 as its 16-bit words, BYTES as
  Triton's serialised wire bytes). Protocol 5 wraps them in a :class:`pickle.PickleBuffer`, so a
  ``buffer_callback`` takes them out of band without a copy; older protocols copy them into the
  stream as ``bytes``.

Loading views the received buffer (read-only when the buffer is), except that a payload that
came in band through protocol 0-4 from a writable tensor is copied once more so the loaded
tensor is writable again, as numpy's own pickles are, and a payload misaligned for its element
type is copied to aligned memory. Pinned (CPU_PINNED) tensors load as CPU tensors: the received
buffer is ordinary pageable memory, and DLPack's ``kDLCUDAHost`` promises page-locked memory.

This module knows buffers and metadata only; :mod:`pb_tensor.tensor` builds the ``Tensor``.
"""

from __future__ import annotations

import math
import struct
import zlib
from pickle import PickleBuffer
from typing import TYPE_CHECKING, Any, Final, cast

import numpy as np

import dlpack_ctypes as dl
from pb_tensor import bytes_codec
from pb_tensor.dtypes import MemoryType, TritonDtype, numpy_dtype_of, triton_to_dlpack
from pb_tensor.errors import TritonModelException

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["FORMAT_VERSION", "MAX_DIMS", "Decoded", "decode", "encode"]

FORMAT_VERSION: Final = 1
"""The header layout version this module writes and reads."""
MAX_DIMS: Final = 64
"""The most dimensions a pickled tensor may have (numpy's limit)."""

_MAGIC: Final = b"PBT" + bytes([FORMAT_VERSION])
# magic+version, flags, memory type, (pad), dtype, ndim, memory type id, byte size, name length
_FIXED: Final = struct.Struct("<4sBB2xiIqQI")
_CRC: Final = struct.Struct("<I")
_FLAG_COPY_ON_LOAD: Final = 1  # in band through protocol 0-4 from a writable tensor
_KNOWN_FLAGS: Final = _FLAG_COPY_ON_LOAD
_HOST_MEMORY: Final = (int(MemoryType.CPU), int(MemoryType.CPU_PINNED))
_KDL_CPU: Final = (int(dl.DLDeviceType.kDLCPU), 0)

_MIN_HEADER: Final = _FIXED.size + _CRC.size

_bodies: dict[tuple[int, int], struct.Struct] = {}
_BODY_CACHE_MAX: Final = 256
_DIMS: Final = [struct.Struct(f"<{n}q") for n in range(MAX_DIMS + 1)]

# TritonDtype value -> (TritonDtype, numpy storage dtype, bytes per element): BF16 is stored as
# uint16 words, BYTES as uint8 wire bytes with no fixed element size (0).
_DTYPES: Final[dict[int, tuple[TritonDtype, np.dtype[Any], int]]] = {}
for _td in TritonDtype:
    if _td == TritonDtype.TYPE_INVALID:
        continue
    if _td == TritonDtype.TYPE_BYTES:
        _DTYPES[int(_td)] = (_td, np.dtype(np.uint8), 0)
        continue
    _np = np.dtype(np.uint16) if _td == TritonDtype.TYPE_BF16 else numpy_dtype_of(_td)
    _DTYPES[int(_td)] = (_td, _np, _np.itemsize)
_BF16: Final = int(TritonDtype.TYPE_BF16)
_BF16_DL: Final = dl.DataType(*triton_to_dlpack(TritonDtype.TYPE_BF16))


Decoded = tuple[
    str,
    TritonDtype,
    tuple[int, ...],
    "np.ndarray[Any, Any] | None",
    "dl.DLPackTensor | None",
    "np.ndarray[Any, Any] | None",
]
"""A loaded tensor's fields (a plain tuple: this is the unpickling hot path): name, dtype, dims,
``array`` (numeric data, or BYTES elements as an object array), ``imported`` (BF16 data) and
``serialized`` (BYTES wire bytes). The memory type is CPU, id 0."""


def _body_struct(ndim: int, name_len: int) -> struct.Struct:
    key = (ndim, name_len)
    s = _bodies.get(key)
    if s is None:
        s = struct.Struct(f"<4sBB2xiIqQI{ndim}q{name_len}s")
        if len(_bodies) >= _BODY_CACHE_MAX:
            _bodies.clear()
        _bodies[key] = s
    return s


def encode(
    name: str,
    dtype: TritonDtype,
    dims: tuple[int, ...],
    memory_type: MemoryType,
    memory_type_id: int,
    payload: np.ndarray[Any, Any],
    protocol: int,
) -> tuple[bytes, object]:
    """The ``(header, payload)`` arguments of ``_rebuild_tensor`` for a host tensor.

    ``payload`` is the tensor's C-contiguous host data (BYTES: the serialised wire bytes; BF16:
    a ``uint16`` view). Protocol 5 and above give a :class:`pickle.PickleBuffer` over it (out of
    band with a ``buffer_callback``, else in band as ``bytes``/``bytearray``); lower protocols a
    ``bytes`` copy.

    Raises:
        TritonModelException: ``memory_type`` is not host memory, or the payload is not
            C-contiguous.
    """
    if int(memory_type) not in _HOST_MEMORY:
        raise TritonModelException(
            f"Tensor {name!r} pickling: memory_type={memory_type!r} is not host memory"
        )
    if not payload.flags.c_contiguous:
        raise TritonModelException(
            f"Tensor {name!r} pickling: the payload is not C-contiguous (strides "
            f"{payload.strides}, shape {payload.shape})"
        )
    raw_name = name.encode("utf-8", "surrogatepass")
    flags = 0
    data: object
    if protocol >= 5:
        data = PickleBuffer(cast("Buffer", payload))
    else:
        data = payload.tobytes()
        if payload.flags.writeable:
            flags = _FLAG_COPY_ON_LOAD
    body = _body_struct(len(dims), len(raw_name)).pack(
        _MAGIC, flags, int(memory_type), int(dtype), len(dims), memory_type_id,
        payload.nbytes, len(raw_name), *dims, raw_name,
    )  # fmt: skip
    return body + _CRC.pack(zlib.crc32(body)), data


def _corrupt(rule: str) -> TritonModelException:
    return TritonModelException(f"Tensor pickle is corrupted or truncated: {rule}")


def decode(header: object, payload: object) -> Decoded:
    """Check ``header`` and ``payload`` (any buffer: ``bytes``, ``bytearray``, ``memoryview``,
    :class:`pickle.PickleBuffer`, an object store's buffer ...) and view the payload as the
    tensor's data.

    Raises:
        TritonModelException: a header that is not ours, of another format version, truncated,
            failing its CRC or describing an impossible tensor; a payload that is not a buffer,
            not C-contiguous, or whose size does not match the header; BYTES wire bytes that do
            not hold the header's element count. The message names the rule broken.
    """
    if type(header) is not bytes:
        raise _corrupt(f"the header is a {type(header).__name__}, expected bytes")
    size = len(header)
    if size < _MIN_HEADER:
        raise _corrupt(f"header of {size} bytes, shorter than {_MIN_HEADER}")
    magic, flags, memory_type, dtype, ndim, _memory_id, byte_size, name_len = (
        _FIXED.unpack_from(header)
    )
    if magic != _MAGIC:
        if magic[:3] == _MAGIC[:3]:
            raise _corrupt(
                f"format version {magic[3]} (this pb_tensor reads version {FORMAT_VERSION})"
            )
        raise _corrupt(f"header magic={magic!r}, expected {_MAGIC!r}")
    if ndim > MAX_DIMS:
        raise _corrupt(f"ndim={ndim} exceeds {MAX_DIMS}")
    name_at = _FIXED.size + 8 * ndim
    if size != name_at + name_len + _CRC.size:
        raise _corrupt(f"header of {size} bytes, expected {name_at + name_len + _CRC.size}")
    if zlib.crc32(header[:-4]) != _CRC.unpack_from(header, size - 4)[0]:
        raise _corrupt("the header's CRC-32 does not match its contents")
    # The CRC passed: what follows catches headers written wrongly, not damaged ones.
    found = _DTYPES.get(dtype)
    if found is None:
        raise _corrupt(f"dtype={dtype} is not a Triton data type")
    triton_dtype, storage, itemsize = found
    if flags & ~_KNOWN_FLAGS:
        raise _corrupt(f"unknown flags={flags:#x}")
    if memory_type not in _HOST_MEMORY:
        raise _corrupt(f"memory_type={memory_type} is not host memory")
    dims: tuple[int, ...] = _DIMS[ndim].unpack_from(header, _FIXED.size)
    if ndim and min(dims) < 0:
        raise _corrupt(f"negative dimension in dims={list(dims)}")
    try:
        name = header[name_at : size - 4].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise _corrupt(f"name={header[name_at : size - 4]!r} is not UTF-8") from None
    if not name:
        raise _corrupt("empty name")
    count = math.prod(dims)
    if itemsize and byte_size != count * itemsize:
        raise _corrupt(f"byte_size={byte_size} for dims={list(dims)} of {itemsize}-byte elements")
    data = _view(payload, storage, byte_size, name)
    if flags or not data.flags.aligned:
        data = data.copy()  # _FLAG_COPY_ON_LOAD, or alignment for every consumer
    if itemsize == 0:  # BYTES
        elements = bytes_codec.deserialize(data, count).reshape(dims)
        return name, triton_dtype, dims, elements, None, data
    data = data.reshape(dims)
    if dtype == _BF16:
        exporter = dl.BufferExporter(
            data, dl.data_pointer(data), dims, None, _BF16_DL, _KDL_CPU,
            readonly=not data.flags.writeable,
        )
        return name, triton_dtype, dims, None, dl.from_dlpack(exporter), None
    return name, triton_dtype, dims, data, None, None


def _view(payload: object, dtype: np.dtype[Any], byte_size: int, name: str) -> Any:
    """``payload`` as a flat array of ``dtype``, without a copy, holding ``byte_size`` bytes."""
    try:
        # payload comes from an untrusted stream, so it is typed `object`; np.frombuffer is
        # the check that it is a buffer (TypeError otherwise).
        data = np.frombuffer(payload, dtype=dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError, BufferError) as exc:
        try:
            nbytes = memoryview(payload).nbytes  # type: ignore[arg-type]  # same: may raise
        except TypeError:
            nbytes = byte_size
        if nbytes != byte_size:
            raise _size_mismatch(name, nbytes, byte_size) from None
        raise _corrupt(
            f"the payload of tensor {name!r} ({type(payload).__name__}) is not a contiguous "
            f"buffer: {exc}"
        ) from None
    if data.nbytes != byte_size:
        raise _size_mismatch(name, data.nbytes, byte_size)
    return data


def _size_mismatch(name: str, nbytes: int, byte_size: int) -> TritonModelException:
    return _corrupt(
        f"the payload of tensor {name!r} holds {nbytes} bytes, the header says {byte_size}"
    )
