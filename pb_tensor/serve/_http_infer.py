"""Triton's HTTP inference request and response: the JSON header, the binary-data extension
(``Inference-Header-Content-Length``, ``binary_data_size``, ``binary_data_output``, per-output
``binary_data``) and the checks Triton's ``http_server.cc`` makes, with its messages."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from pb_tensor.serve._errors import UNSUPPORTED, ServeError
from pb_tensor.serve._shm import Regions, shm_input, shm_output, shm_target
from pb_tensor.serve._tensors import (
    check_shape,
    datatype_of,
    from_json,
    from_raw,
    json_bytes,
    raw_bytes,
    to_json,
)

__all__ = ["InferCall", "json_error_text", "parse_infer", "parse_json", "render_infer"]

_INT32_MAX = 2**31 - 1

# rapidjson's texts (GetParseError_En) for what Python's json reports.
_JSON_TEXTS = (
    ("Expecting value", "Invalid value."),
    ("Expecting property name", "Missing a name for object member."),
    ("Expecting ':'", "Missing a colon after a name of object member."),
    ("Expecting ','", "Missing a comma or '}' after an object member."),
    ("Extra data", "The document root must not be followed by other values."),
    ("Unterminated string", "Missing a closing quotation mark in string."),
    ("Invalid control character", "Invalid encoding in string."),
    ("Invalid \\escape", "Invalid escape character in string."),
)


def json_error_text(exc: ValueError, data: bytes | bytearray | memoryview) -> str:
    """Triton's message for a request body that is not JSON."""
    if not len(data) or not bytes(data).strip():
        return "failed to parse the request JSON buffer: The document is empty. at 0"
    if isinstance(exc, UnicodeDecodeError):
        return ("failed to parse the request JSON buffer: Invalid encoding in string. at "
                f"{exc.start}")
    msg = getattr(exc, "msg", str(exc))
    pos = getattr(exc, "pos", 0)
    text = next((t for prefix, t in _JSON_TEXTS if msg.startswith(prefix)), msg)
    return f"failed to parse the request JSON buffer: {text} at {pos}"


def parse_json(data: bytes | bytearray | memoryview) -> Any:
    """A JSON document.

    Raises:
        ServeError: not JSON (Triton's message).
    """
    # rapidjson (Triton's parser) does not validate UTF-8: bytes that are not UTF-8 pass
    # through strings unchanged, as they do here (surrogate escapes, undone for BYTES data).
    try:
        return json.loads(bytes(data).decode("utf-8", "surrogateescape"))
    except ValueError as exc:
        raise ServeError(json_error_text(exc, data)) from None


@dataclasses.dataclass
class InferCall:
    """One parsed inference request."""

    request_id: str
    inputs: dict[str, Any]
    requested: list[str]
    binary: dict[str, bool]
    binary_default: bool
    parameters: dict[str, Any]
    correlation_id: int | str = 0
    flags: int = 0
    has_id: bool = False
    shm: dict[str, tuple[str, int, int]] = dataclasses.field(default_factory=dict)


def header_length(value: str | None, content_length: int) -> int | None:
    """The ``Inference-Header-Content-Length`` value, checked as Triton checks it.

    Raises:
        ServeError: not an int32, or outside the body.
    """
    if value is None:
        return None
    name = "Inference-Header-Content-Length"
    try:
        parsed = int(value.strip())
    except ValueError:
        raise ServeError(f"Unable to parse {name}, got: {value}") from None
    if not -(2**31) <= parsed <= _INT32_MAX:
        raise ServeError(
            f"Unable to parse {name}, value is out of range [ -2147483648, 2147483647 ], got: "
            f"{value}"
        )
    if parsed < 0 or parsed > content_length:
        raise ServeError(
            f"inference header size should be in range (0, {content_length}), got: {value}"
        )
    return parsed


def _member(obj: dict[str, Any], key: str, kind: type, text: str, what: str) -> Any:
    if key not in obj:
        raise ServeError(f"Unable to parse '{what}': attempt to access non-existing object "
                         f"member '{key}'")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ServeError(f"Unable to parse '{what}': attempt to access JSON non-{text} as "
                         f"{text}")
    return value


def parse_infer(body: bytearray, header_len: int | None, model: str, max_input: int,
                regions: Regions) -> InferCall:
    """The inputs, requested outputs and parameters of an HTTP inference request.

    Raises:
        ServeError: malformed JSON, binary data past the body or left over, shapes and sizes
            that do not match, unknown datatypes, reserved parameters (Triton's messages).
    """
    view = memoryview(body)
    end = len(body) if header_len is None else header_len
    request = parse_json(view[:end])
    if not isinstance(request, dict):
        raise ServeError("Unable to parse 'inputs': attempt to access JSON non-object as object")
    has_id = "id" in request
    request_id = request.get("id", "")
    if not isinstance(request_id, str):
        raise ServeError("Unable to parse 'id': attempt to access JSON non-string as string")
    inputs_json = _member(request, "inputs", list, "array", "inputs")
    offset = end
    inputs: dict[str, Any] = {}
    for item in inputs_json:
        if not isinstance(item, dict):
            raise ServeError("attempt to access JSON non-object as object")
        name = _member(item, "name", str, "string", "name")
        datatype = _member(item, "datatype", str, "string", "datatype")
        if "shape" not in item:
            raise ServeError("Unable to parse 'shape': attempt to access non-existing object "
                             "member 'shape'")
        shape = check_shape(name, item["shape"])
        params = item.get("parameters") or {}
        if not isinstance(params, dict):
            raise ServeError("Unable to parse 'parameters': attempt to access JSON non-object "
                             "as object")
        if "shared_memory_region" in params:
            data = shm_input(regions, name, params["shared_memory_region"],
                             params.get("shared_memory_offset", 0),
                             params.get("shared_memory_byte_size", 0))
            inputs[name] = from_raw(name, datatype, shape, data, model, request_id)
            continue
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if type(size) is not int or size < 0:
                raise ServeError("Unable to parse 'binary_data_size': attempt to access JSON "
                                 "non-unsigned-integer as unsigned-integer")
            if header_len is None:
                raise ServeError(
                    "must specify valid 'Infer-Header-Content-Length' in request header and "
                    "'binary_data_size' when passing inputs in binary data format"
                )
            if size > len(body) - offset:
                raise ServeError(
                    f"unexpected size for input '{name}', expecting "
                    f"{size - (len(body) - offset)} additional bytes for model '{model}'"
                )
            inputs[name] = from_raw(name, datatype, shape, view[offset:offset + size], model,
                                    request_id)
            offset += size
            continue
        if "data" not in item:
            raise ServeError("Unable to parse 'data': attempt to access non-existing object "
                             "member 'data'")
        _check_json_size(name, datatype, shape, max_input)
        inputs[name] = from_json(name, datatype, shape, item["data"])
    if offset != len(body):
        raise ServeError(f"unexpected additional input data for model '{model}'")
    call = InferCall(request_id, inputs, [], {}, False, {}, has_id=has_id)
    _parse_parameters(request, call)
    outputs = request.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise ServeError("Unable to parse 'outputs': attempt to access JSON non-array as "
                             "array")
        for item in outputs:
            if not isinstance(item, dict):
                raise ServeError("attempt to access JSON non-object as object")
            name = _member(item, "name", str, "string", "name")
            params = item.get("parameters") or {}
            if not isinstance(params, dict):
                raise ServeError("Unable to parse 'parameters': attempt to access JSON "
                                 "non-object as object")
            if "classification" in params:
                raise ServeError("classification outputs are not supported by pb-tensor serve",
                                 UNSUPPORTED)
            call.requested.append(name)
            target = shm_target(params, name)
            if target is not None:
                if params.get("binary_data") is True:
                    raise ServeError("Output can't set both 'shared_memory_region' and "
                                     "'binary_data'")
                call.shm[name] = target
            binary = params.get("binary_data")
            if binary is not None:
                if not isinstance(binary, bool):
                    raise ServeError("Unable to parse 'binary_data': attempt to access JSON "
                                     "non-boolean as boolean")
                call.binary[name] = binary
    return call


def _check_json_size(name: str, datatype: str, shape: list[int], max_input: int) -> None:
    from pb_tensor.serve._tensors import DTYPES

    dtype = DTYPES.get(datatype)
    if dtype is None or datatype == "BYTES":
        return
    count = 1
    for d in shape:
        count *= d
    size = count * dtype.itemsize
    if size > max_input:
        raise ServeError(
            f"JSON input '{name}' has a byte_size ({size} bytes) that exceeds the maximum "
            f"allowed value of {max_input} bytes. Use --http-max-input-size to increase the "
            "limit."
        )


def _parse_parameters(request: dict[str, Any], call: InferCall) -> None:
    params = request.get("parameters")
    if params is None:
        return
    if not isinstance(params, dict):
        raise ServeError("failed to get request params.: attempt to access JSON non-object as "
                         "object")
    for key, value in params.items():
        if key == "sequence_id":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ServeError("Unable to parse 'sequence_id': attempt to access JSON "
                                 "non-string as string")
            call.correlation_id = value
        elif key in ("sequence_start", "sequence_end"):
            if not isinstance(value, bool):
                raise ServeError(f"Unable to parse '{key}': attempt to access JSON non-boolean "
                                 "as boolean")
            if value:
                call.flags |= 1 if key == "sequence_start" else 2
        elif key in ("priority", "timeout"):
            if type(value) is not int or value < 0:
                raise ServeError(f"Unable to parse '{key}': attempt to access JSON "
                                 "non-unsigned-integer as unsigned-integer")
        elif key == "binary_data_output":
            if not isinstance(value, bool):
                raise ServeError("Unable to parse 'binary_data_output': attempt to access JSON "
                                 "non-boolean as boolean")
            call.binary_default = value
        elif key.startswith("triton_"):
            raise ServeError("parameter keys starting with 'triton_' are reserved for Triton "
                             "usage and should not be specified.")
        else:
            # A number that is not an integer is a double parameter (Triton 24.02 on).
            if not isinstance(value, (bool, int, float, str)):
                raise ServeError(f"parameter '{key}' has invalid type. It should be either "
                                 "'int', 'bool', or 'string'.")
            call.parameters[key] = value


def render_infer(
    model: str, version: int, call: InferCall, outputs: dict[str, np.ndarray[Any, Any]],
    parameters: dict[str, Any], regions: Regions,
) -> tuple[list[bytes | memoryview], int | None]:
    """The response body parts and the JSON header's length (None when every output is in
    the JSON).

    Raises:
        ServeError: an FP16 output asked for as JSON; a shared-memory region too small.
    """
    out_json: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview] = []
    for name, array in outputs.items():
        entry: dict[str, Any] = {
            "name": name, "datatype": datatype_of(array), "shape": list(array.shape),
        }
        target = call.shm.get(name)
        if target is not None:
            entry["parameters"] = shm_output(regions, name, target, raw_bytes(array))
        elif call.binary.get(name, call.binary_default):
            blob = raw_bytes(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = to_json(array, name)
        out_json.append(entry)
    response: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if call.has_id:
        response["id"] = call.request_id
    if parameters:
        response["parameters"] = parameters
    response["outputs"] = out_json
    head = json_bytes(response)
    if not blobs:
        return [head], None
    return [head, *blobs], len(head)
