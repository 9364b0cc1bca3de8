"""Triton's gRPC inference messages: a ``ModelInferRequest`` parsed into inputs, requested
outputs and parameters (Triton's checks and texts), and the ``ModelInferResponse`` of outputs."""

from __future__ import annotations

from typing import Any

import numpy as np

from pb_tensor.serve import _protos
from pb_tensor.serve._errors import ServeError
from pb_tensor.serve._shm import Regions, shm_input, shm_output, shm_target
from pb_tensor.serve._tensors import DTYPES, check_shape, datatype_of, from_raw, raw_bytes

__all__ = ["Request", "param_value", "response_of", "set_param"]

_M = _protos.message


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
        self.correlation_id: int | str = 0
        self.flags = 0
        self.empty_final = False
        self.parameters: dict[str, Any] = {}
        for key, p in request.parameters.items():
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
            elif kind not in ("int64_param", "bool_param", "string_param"):
                raise ServeError(f"invalid value type for '{key}' parameter, expected "
                                 "int64_param, bool_param, or string_param.")
            else:
                self.parameters[key] = value
        self.requested = [o.name for o in request.outputs]
        self.shm: dict[str, tuple[str, int, int]] = {}
        for o in request.outputs:
            target = shm_target({k: param_value(v) for k, v in o.parameters.items()}, o.name)
            if target is not None:
                self.shm[o.name] = target
        self.inputs: dict[str, Any] = {}
        raw = request.raw_input_contents
        model = request.model_name
        index = 0
        for io in request.inputs:
            shape = check_shape(io.name, list(io.shape))
            if "shared_memory_region" in io.parameters:
                p = {k: param_value(v) for k, v in io.parameters.items()}
                data = shm_input(regions, io.name, p["shared_memory_region"],
                                 p.get("shared_memory_offset", 0),
                                 p.get("shared_memory_byte_size", 0))
                self.inputs[io.name] = from_raw(io.name, io.datatype, shape, data, model,
                                                request.id)
                continue
            has_contents = io.HasField("contents")
            if has_contents and len(raw):
                raise ServeError(
                    "contents field must not be specified when using raw_input_contents for "
                    f"'{io.name}' for model '{model}'"
                )
            if index < len(raw):
                # In-process models take the inputs without a copy: a buffer of their own,
                # writable as a stub's copy is (protobuf's bytes are read-only).
                data = bytearray(raw[index]) if writable else raw[index]
                index += 1
            elif has_contents:
                data = self._contents(io, model)
            else:
                raise ServeError(f"unable to find data for input tensor '{io.name}' for model "
                                 f"'{model}' in request.")
            self.inputs[io.name] = from_raw(io.name, io.datatype, shape, data, model,
                                            request.id)

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
