"""Triton's gRPC inference messages without a server: ``ModelInferRequest`` parsing (inputs,
parameters, requested outputs, Triton's errors) and the ``ModelInferResponse`` bytes that
``ModelInfer`` writes directly, which must be the bytes protobuf writes for the message."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from serve_support import needs_serve

pytestmark = needs_serve


def _request(**fields: Any) -> Any:
    from pb_tensor.serve._protos import message

    return message("ModelInferRequest")(model_name="m", **fields)


def _parse(request: Any, writable: bool = True) -> Any:
    from pb_tensor.serve._grpc_messages import Request
    from pb_tensor.serve._shm import Regions

    return Request(request, stream=False, writable=writable, regions=Regions())


def _two_inputs(shape: list[int]) -> Any:
    request = _request(id="7")
    data = np.arange(int(np.prod(shape)), dtype=np.float32)
    for name in ("A", "B"):
        request.inputs.add(name=name, datatype="FP32", shape=shape)
        request.raw_input_contents.append(data.tobytes())
    return request


def test_raw_inputs_become_arrays_of_their_shape() -> None:
    parsed = _parse(_two_inputs([2, 3]))
    assert list(parsed.inputs) == ["A", "B"]
    for array in parsed.inputs.values():
        assert array.shape == (2, 3)
        assert array.dtype == np.float32
        assert array.flags.writeable
        np.testing.assert_array_equal(array.ravel(), np.arange(6, dtype=np.float32))
    assert (parsed.requested, parsed.shm, parsed.parameters) == ([], {}, {})
    assert (parsed.correlation_id, parsed.flags) == (0, 0)
    assert not _parse(_two_inputs([2]), writable=False).inputs["A"].flags.writeable


def test_parameters_and_requested_outputs() -> None:
    request = _two_inputs([2])
    request.parameters["sequence_id"].int64_param = 5
    request.parameters["sequence_start"].bool_param = True
    request.parameters["custom"].string_param = "x"
    request.parameters["ratio"].double_param = 0.25  # Triton's double parameters (24.02 on)
    request.outputs.add(name="OUT1")
    out = request.outputs.add(name="OUT0")
    out.parameters["shared_memory_region"].string_param = "r"
    out.parameters["shared_memory_byte_size"].int64_param = 8
    parsed = _parse(request)
    assert (parsed.correlation_id, parsed.flags) == (5, 1)
    assert parsed.parameters == {"custom": "x", "ratio": 0.25}
    assert parsed.requested == ["OUT1", "OUT0"]
    assert parsed.shm == {"OUT0": ("r", 0, 8)}


@pytest.mark.parametrize(("change", "message"), [
    ("contents", "contents field must not be specified when using raw_input_contents for 'B' "
                 "for model 'm'"),
    ("missing", "unable to find data for input tensor 'B' for model 'm' in request."),
    ("negative", "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as "
                 "unsigned-integer"),
    ("huge", "invalid shape for input 'A': shape [4294967296,4294967296] causes total element "
             "count to exceed maximum size of 9223372036854775807"),
    ("size", "[request id: 7] input byte size mismatch for input 'A' for model 'm'. Expected "
             "12, got 8"),
    ("reserved", "parameter keys starting with 'triton_' are reserved for Triton usage. Only "
                 "the following keys starting with 'triton_' are allowed: "
                 "triton_enable_empty_final_response"),
])  # fmt: skip
def test_malformed_requests_get_tritons_messages(change: str, message: str) -> None:
    from pb_tensor.serve._errors import ServeError

    request = _two_inputs([2])
    if change == "contents":
        request.inputs[1].contents.fp32_contents.extend([1.0, 2.0])
    elif change == "missing":
        del request.raw_input_contents[1]
    elif change == "negative":
        request.inputs[0].shape[0] = -1
    elif change == "huge":
        request.inputs[0].ClearField("shape")
        request.inputs[0].shape.extend([2**32, 2**32])
    elif change == "size":
        request.inputs[0].shape[0] = 3
    else:
        request.parameters["triton_x"].bool_param = True
    with pytest.raises(ServeError) as caught:
        _parse(request)
    assert caught.value.message == message


def test_typed_contents_without_raw_data() -> None:
    request = _request()
    request.inputs.add(name="A", datatype="INT32", shape=[3]).contents.int_contents.extend(
        [1, -2, 3])
    np.testing.assert_array_equal(_parse(request).inputs["A"], [1, -2, 3])


_OUTPUTS = {
    "fp32": np.arange(16, dtype=np.float32),
    "matrix": np.arange(12, dtype=np.int64).reshape(3, 4),
    "strided": np.arange(12, dtype=np.int64).reshape(3, 4).T,
    "scalar": np.float64(2.5).reshape(()),
    "empty": np.zeros((0, 3), np.float16),
    "large dims": np.zeros((1, 200, 1), np.uint8),
    "bool": np.array([True, False]),
    "bytes": np.array([b"ab", b"", b"c"], dtype=object),
    "str": np.array(["x", "yz"]),
    "big-endian": np.arange(3, dtype=">f4"),
}


@pytest.mark.parametrize("request_id", ["", "req-1"])
@pytest.mark.parametrize("kind", list(_OUTPUTS))
def test_response_bytes_are_protobufs(kind: str, request_id: str) -> None:
    from pb_tensor.runtime import Outputs
    from pb_tensor.serve._errors import ServeError
    from pb_tensor.serve._grpc_messages import infer_response_bytes, response_of
    from pb_tensor.serve._shm import Regions

    request = _two_inputs([2])
    request.id = request_id
    parsed = _parse(request)
    outputs = Outputs({"FIRST": np.arange(2, dtype=np.float32), kind: _OUTPUTS[kind]})
    regions = Regions()

    def outcome(make: Any) -> Any:
        try:
            return bytes(make())
        except ServeError as exc:
            return exc.message

    written = outcome(lambda: infer_response_bytes(request, 3, outputs, parsed, regions))
    expected = outcome(lambda: response_of(request, 3, outputs, parsed,
                                           regions).SerializeToString())
    assert written == expected
    if kind == "big-endian":  # Triton has no name for it: refused both ways
        assert written == "output has data type >f4 that Triton cannot send"
