"""Triton's gRPC inference messages: a ``ModelInferRequest`` parsed into inputs, requested
outputs and parameters (Triton's checks and texts), and the ``ModelInferResponse`` of outputs."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pb_tensor.serve import _protos
from pb_tensor.serve._errors import ServeError
from pb_tensor.serve._shm import Regions, shm_input, shm_output, shm_target
from pb_tensor.serve._tensors import DTYPES, check_shape, datatype_of, from_raw, raw_bytes

__all__ = ["Request", "infer_response_bytes", "param_value", "response_of", "set_param"]

_M = _protos.message
_INT64_MAX = 2**63 - 1


_CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}  # fmt: skip


def param_value(p: Any) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def set_param(p: Any, value: Any) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


class Request:
    """A parsed ``ModelInferRequest``."""

    __slots__ = ("correlation_id", "empty_final", "flags", "inputs", "parameters", "requested",
                 "shm")

    def __init__(self, request: Any, stream: bool, writable: bool, regions: Regions) -> None:
        # Every access to a field of the upb message builds a Python object: each is read
        # once, and empty maps and lists (the usual request has no parameters, no requested
        # outputs) are skipped at the cost of a length check.
        self.correlation_id: int | str = 0
        self.flags = 0
        self.empty_final = False
        self.parameters: dict[str, Any] = {}
        params = request.parameters
        if params:
            self._parameters(params, stream)
        self.requested: list[str] = []
        self.shm: dict[str, tuple[str, int, int]] = {}
        outputs = request.outputs
        if outputs:
            for o in outputs:
                name = o.name
                self.requested.append(name)
                out_params = o.parameters
                if out_params:
                    target = shm_target({k: param_value(v) for k, v in out_params.items()},
                                        name)
                    if target is not None:
                        self.shm[name] = target
        self.inputs: dict[str, Any] = {}
        raw = request.raw_input_contents
        raw_count = len(raw)
        model = request.model_name
        request_id = request.id
        index = 0
        for io in request.inputs:
            name = io.name
            shape = list(io.shape)
            # int64 dimensions: non-negative with an element count within int64 is what
            # check_shape accepts; it gives Triton's message for the others.
            if (shape and min(shape) < 0) or math.prod(shape) > _INT64_MAX:
                check_shape(name, shape)
            in_params = io.parameters
            if in_params and "shared_memory_region" in in_params:
                p = {k: param_value(v) for k, v in in_params.items()}
                data = shm_input(regions, name, p["shared_memory_region"],
                                 p.get("shared_memory_offset", 0),
                                 p.get("shared_memory_byte_size", 0))
                self.inputs[name] = from_raw(name, io.datatype, shape, data, model,
                                             request_id)
                continue
            if raw_count:
                if io.HasField("contents"):
                    raise ServeError(
                        "contents field must not be specified when using raw_input_contents "
                        f"for '{name}' for model '{model}'"
                    )
                if index >= raw_count:
                    raise ServeError(f"unable to find data for input tensor '{name}' for "
                                     f"model '{model}' in request.")
                # In-process models take the inputs without a copy: a buffer of their own,
                # writable as a stub's copy is (protobuf's bytes are read-only).
                data = bytearray(raw[index]) if writable else raw[index]
                index += 1
            elif io.HasField("contents"):
                data = self._contents(io, model)
            else:
                raise ServeError(f"unable to find data for input tensor '{name}' for model "
                                 f"'{model}' in request.")
            self.inputs[name] = from_raw(name, io.datatype, shape, data, model, request_id)

    def _parameters(self, params: Any, stream: bool) -> None:
        for key, p in params.items():
            kind = p.WhichOneof("parameter_choice")
            value = param_value(p)
            if key == "sequence_id":
                if kind not in ("int64_param", "string_param"):
                    raise ServeError("invalid value type for 'sequence_id' parameter, expected "
                                     "int64_param or string_param.")
                self.correlation_id = value
            elif key in ("sequence_start", "sequence_end"):
                if kind != "bool_param":
                    raise ServeError(f"invalid value type for '{key}' parameter, expected "
                                     "bool_param.")
                if value:
                    self.flags |= 1 if key == "sequence_start" else 2
            elif key in ("priority", "timeout"):
                continue
            elif key == "triton_enable_empty_final_response" and stream:
                if kind != "bool_param":
                    raise ServeError(f"invalid value type for '{key}' parameter, expected "
                                     "bool_param.")
                self.empty_final = bool(value)
            elif key.startswith("triton_"):
                raise ServeError(
                    "parameter keys starting with 'triton_' are reserved for Triton usage. "
                    "Only the following keys starting with 'triton_' are allowed: "
                    "triton_enable_empty_final_response"
                )
            elif kind not in ("int64_param", "bool_param", "string_param", "double_param"):
                raise ServeError(f"invalid value type for '{key}' parameter, expected "
                                 "int64_param, bool_param, or string_param.")
            else:
                self.parameters[key] = value

    @staticmethod
    def _contents(io: Any, model: str) -> bytearray:
        field = _CONTENTS.get(io.datatype)
        if field is None:
            raise ServeError(f"invalid datatype for input {io.name}")
        for other in set(_CONTENTS.values()) - {field}:
            if len(getattr(io.contents, other)):
                raise ServeError(
                    f"unexpected explicit tensor data for input tensor '{io.name}' for model "
                    f"'{model}' of type '{other.split('_')[0].upper()}', expected datatype "
                    f"'{io.datatype}'"
                )
        values = list(getattr(io.contents, field))
        if io.datatype == "BYTES":
            from pb_tensor.serve._tensors import bytes_wire

            array = np.empty(len(values), dtype=object)
            array[:] = values
            return bytearray(bytes_wire(array))
        try:
            return bytearray(np.array(values, dtype=DTYPES[io.datatype]).tobytes())
        except OverflowError:
            raise ServeError(f"a value of input '{io.name}' does not fit {io.datatype}") from None


def response_of(request: Any, version: int, outputs: Any, parsed: Request,
              regions: Regions) -> Any:
    response = _M("ModelInferResponse")(
        model_name=request.model_name, model_version=str(version), id=request.id
    )
    for key, value in getattr(outputs, "parameters", {}).items():
        set_param(response.parameters[key], value)
    for name, array in outputs.items():
        tensor = response.outputs.add(name=name, datatype=datatype_of(array),
                                      shape=list(array.shape))
        blob = raw_bytes(array)
        target = parsed.shm.get(name)
        if target is not None:  # written into the region; an empty entry keeps the order
            for key, value in shm_output(regions, name, target, blob).items():
                set_param(tensor.parameters[key], value)
            response.raw_output_contents.append(b"")
            continue
        response.raw_output_contents.append(blob if isinstance(blob, bytes) else bytes(blob))
    return response


# ModelInferResponse on the wire, written directly where its fields are the usual ones (no
# response or output parameters, no output to shared memory): tags of the length-delimited
# fields (field number << 3 | 2), of the response and of its InferOutputTensor.
_MODEL_NAME, _MODEL_VERSION, _ID, _OUTPUTS, _RAW = b"\x0a", b"\x12", b"\x1a", b"\x2a", b"\x32"
_T_NAME, _T_DATATYPE, _T_SHAPE = b"\x0a", b"\x12", b"\x1a"
_HEADS: dict[tuple[str, str, tuple[int, ...]], bytes] = {}
_HEADS_MAX = 1024
# Triton's names of the fixed-size numpy dtypes (native byte order; not BYTES).
_NUMERIC = {dtype: name for name, dtype in DTYPES.items() if name != "BYTES"}


def _varint(n: int) -> bytes:
    # n >= 0 (lengths, dimensions of numpy arrays).
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _tensor_head(name: str, datatype: str, shape: tuple[int, ...]) -> bytes:
    """The serialised ``outputs`` entry of one output (``name``, ``datatype``, packed
    ``shape``), memoised: a model answers with the same few of them."""
    key = (name, datatype, shape)
    head = _HEADS.get(key)
    if head is None:
        body = _field(_T_NAME, name.encode()) + _field(_T_DATATYPE, datatype.encode())
        if shape:
            body += _field(_T_SHAPE, b"".join(_varint(d) for d in shape))
        head = _field(_OUTPUTS, body)
        if len(_HEADS) >= _HEADS_MAX:
            _HEADS.clear()
        _HEADS[key] = head
    return head


def infer_response_bytes(request: Any, version: int, outputs: Any, parsed: Request,
                         regions: Regions) -> bytes:
    """The serialised ``ModelInferResponse`` of ``outputs``: the bytes protobuf writes for
    :func:`response_of`'s message (fields in number order, empty strings left out),
    written here without building the message where nothing but names, datatypes, shapes
    and raw contents are in it (25-35% less CPU than building the message and serialising
    it, alone in a loop); else through the message.

    Raises:
        ServeError: an output Triton cannot send, or an output region that does not take it.
    """
    if parsed.shm or getattr(outputs, "parameters", None):
        return bytes(response_of(request, version, outputs, parsed,
                                 regions).SerializeToString())
    parts = [_field(_MODEL_NAME, request.model_name.encode()),
             _field(_MODEL_VERSION, str(version).encode())]
    request_id = request.id
    if request_id:
        parts.append(_field(_ID, request_id.encode()))
    blobs: list[tuple[int, bytes | memoryview]] = []
    for name, array in outputs.items():
        datatype = _NUMERIC.get(array.dtype)  # native byte order only
        if datatype is not None and array.flags.c_contiguous:
            # The array's own memory: the join below is the one copy.
            blobs.append((array.nbytes, array.data))
        else:
            datatype = datatype_of(array)
            blob = raw_bytes(array)
            blobs.append((blob.nbytes if isinstance(blob, memoryview) else len(blob), blob))
        parts.append(_tensor_head(name, datatype, array.shape))
    for size, blob in blobs:
        parts.append(_RAW)
        parts.append(_varint(size))
        parts.append(blob)  # type: ignore[arg-type]  # bytes.join takes memoryviews too
    return b"".join(parts)
