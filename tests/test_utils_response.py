"""pb_tensor.utils: InferenceResponse, InferenceResponseSender (upstream's state checks) and
TritonError."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from pb_tensor import utils as pb_utils
from pb_tensor.utils import _context

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _t(name: str) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.ones(2, dtype=np.int32))


# -- TritonError ---------------------------------------------------------------------------------


def test_triton_error_codes_are_tritonservers() -> None:
    expected = {
        "UNKNOWN": 0, "INTERNAL": 1, "NOT_FOUND": 2, "INVALID_ARG": 3,
        "UNAVAILABLE": 4, "UNSUPPORTED": 5, "ALREADY_EXISTS": 6, "CANCELLED": 7,
    }
    for name, value in expected.items():
        assert int(getattr(pb_utils.TritonError, name)) == value
        assert getattr(pb_utils.TritonError, name) is pb_utils.TritonErrorCode[name]


def test_triton_error() -> None:
    e = pb_utils.TritonError("boom")
    assert e.message() == "boom"
    assert e.code() is pb_utils.TritonError.INTERNAL
    e2 = pb_utils.TritonError(message="gone", code=pb_utils.TritonError.NOT_FOUND)
    assert e2.code() == 2
    assert str(e2) == "gone"
    assert repr(e2) == "TritonError('gone', code=TritonError.NOT_FOUND)"
    assert pb_utils.TritonError("x", 7).code() is pb_utils.TritonError.CANCELLED
    assert e == pb_utils.TritonError("boom", pb_utils.TritonError.INTERNAL)
    assert not isinstance(e, BaseException)  # a value, as upstream's PbError


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((None,), "TritonError(): message must be a str, got NoneType"),
        (("m", None), "TritonError(): code must be a TritonError code, got NoneType"),
        (("m", "x"), "TritonError(): code must be a TritonError code, got str"),
        (("m", True), "TritonError(): code must be a TritonError code, got bool"),
        (("m", 8), "TritonError(): code=8 is not a TritonError code (0 to 7)"),
    ],
)
def test_triton_error_type_errors(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(TypeError) as e:
        pb_utils.TritonError(*args)
    assert str(e.value) == message


def test_triton_model_exception_is_pb_tensors() -> None:
    import pb_tensor

    assert pb_utils.TritonModelException is pb_tensor.TritonModelException
    assert issubclass(pb_utils.TritonModelException, Exception)


# -- InferenceResponse ----------------------------------------------------------------------------


def test_response_defaults() -> None:
    r = pb_utils.InferenceResponse()
    assert r.output_tensors() == []
    assert r.has_error() is False
    assert r.error() is None
    assert r.parameters() == "{}"


def test_response_with_error_and_parameters() -> None:
    err = pb_utils.TritonError("bad input", pb_utils.TritonError.INVALID_ARG)
    r = pb_utils.InferenceResponse(output_tensors=[], error=err, parameters={"n": 3})
    assert r.has_error() is True
    assert r.error() is err
    assert r.parameters() == '{"n": 3}'


def test_response_outputs_list_is_a_copy_of_same_tensors() -> None:
    a, b = _t("A"), _t("B")
    r = pb_utils.InferenceResponse((a, b))
    got = r.output_tensors()
    assert got == [a, b]
    assert got[0] is a
    got.clear()
    assert len(r.output_tensors()) == 2


def test_response_none_output() -> None:
    with pytest.raises(pb_utils.TritonModelException) as e:
        pb_utils.InferenceResponse([_t("A"), None])  # type: ignore[list-item]
    assert str(e.value) == "Output tensor for inference response should not be empty."


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"output_tensors": None},
         "InferenceResponse(): output_tensors must be a list of Tensor, got NoneType"),
        ({"output_tensors": [np.zeros(1)]},
         "InferenceResponse(): output_tensors must be a list of Tensor, found ndarray"),
        ({"error": "boom"}, "InferenceResponse(): error must be a TritonError or None, got str"),
        ({"error": pb_utils.TritonModelException("x")},
         "InferenceResponse(): error must be a TritonError or None, got TritonModelException"),
    ],
)
def test_response_type_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError) as e:
        pb_utils.InferenceResponse(**kwargs)
    assert str(e.value) == message


def test_response_parameters_errors() -> None:
    with pytest.raises(pb_utils.TritonModelException) as e:
        pb_utils.InferenceResponse(parameters={"x": [1]})  # type: ignore[dict-item]
    assert str(e.value) == (
        "Expect parameters values to have type bool/int/str, found type <class 'list'>"
    )


def test_get_output_tensor_by_name() -> None:
    a = _t("A")
    r = pb_utils.InferenceResponse([a])
    assert pb_utils.get_output_tensor_by_name(r, "A") is a
    assert pb_utils.get_output_tensor_by_name(r, "Z") is None


def test_get_input_tensor_by_name() -> None:
    a = _t("A")
    req = pb_utils.InferenceRequest(model_name="m", inputs=[a], requested_output_names=[])
    assert pb_utils.get_input_tensor_by_name(req, "A") is a
    assert pb_utils.get_input_tensor_by_name(req, "B") is None


# -- InferenceResponseSender ----------------------------------------------------------------------


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[pb_utils.InferenceResponse | None, int]] = []
        self.cancelled = False

    def send(self, response: pb_utils.InferenceResponse | None, flags: int) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return self.cancelled


def _sender(decoupled: bool | None, **kw: Any) -> tuple[pb_utils.InferenceResponseSender, Sink]:
    sink = Sink()
    return pb_utils.InferenceResponseSender(
        sink.send, sink.is_cancelled, decoupled=decoupled, **kw
    ), sink


def test_decoupled_stream() -> None:
    s, sink = _sender(True)
    for _ in range(3):
        s.send(pb_utils.InferenceResponse([_t("OUT")]))
    s.send(flags=FINAL)
    assert [f for _, f in sink.sent] == [0, 0, 0, FINAL]
    assert sink.sent[-1][0] is None
    assert _context.sender_is_closed(s)
    assert _context.responses_sent(s) == 4


def test_send_after_final() -> None:
    s, sink = _sender(True)
    s.send(pb_utils.InferenceResponse(), FINAL)
    with pytest.raises(pb_utils.TritonModelException) as e:
        s.send(pb_utils.InferenceResponse())
    assert str(e.value) == "Unable to send response. Response sender has been closed."
    with pytest.raises(pb_utils.TritonModelException) as e:
        s.send(flags=FINAL)
    assert str(e.value) == "Unable to send response. Response sender has been closed."
    assert len(sink.sent) == 1


def test_send_after_close() -> None:
    s, sink = _sender(False)
    _context.close_sender(s)
    with pytest.raises(pb_utils.TritonModelException) as e:
        s.send(pb_utils.InferenceResponse(), FINAL)
    assert str(e.value) == "Unable to send response. Response sender has been closed."
    assert sink.sent == []


def test_unsupported_flag() -> None:
    s, _ = _sender(True)
    with pytest.raises(pb_utils.TritonModelException) as e:
        s.send(pb_utils.InferenceResponse(), flags=2)
    assert str(e.value) == "Unable to send response. Unsupported flag provided."


def test_no_response_without_final_flag() -> None:
    s, _ = _sender(True)
    with pytest.raises(pb_utils.TritonModelException) as e:
        s.send()
    assert str(e.value) == (
        "Inference Response object must be provided when the response flags is set to zero."
    )


def test_non_decoupled_one_response() -> None:
    s, sink = _sender(False)
    s.send(pb_utils.InferenceResponse([_t("OUT")]))
    with pytest.raises(pb_utils.TritonModelException) as e:
        s.send(pb_utils.InferenceResponse())
    assert str(e.value) == (
        "Unable to send response. Non-decoupled model cannot send more than one response."
    )
    s.send(flags=FINAL)  # the final flag alone after the one response is fine
    assert [f for _, f in sink.sent] == [0, FINAL]


def test_non_decoupled_final_before_response() -> None:
    s, _ = _sender(False)
    with pytest.raises(pb_utils.TritonModelException) as e:
        s.send(flags=FINAL)
    assert str(e.value) == (
        "Unable to send response. Non-decoupled model cannot send complete final before "
        "sending a response."
    )


def test_non_decoupled_response_with_final() -> None:
    s, sink = _sender(False)
    s.send(pb_utils.InferenceResponse(), flags=FINAL)
    assert len(sink.sent) == 1
    assert _context.sender_is_closed(s)


def test_send_type_errors() -> None:
    s, _ = _sender(True)
    with pytest.raises(TypeError) as e:
        s.send("r")  # type: ignore[arg-type]
    assert str(e.value) == "send(): response must be an InferenceResponse or None, got str"
    with pytest.raises(TypeError) as e:
        s.send(flags=None)  # type: ignore[arg-type]
    assert str(e.value) == "send(): flags must be an int, got NoneType"


def test_sender_prunes_unrequested_outputs() -> None:
    s, sink = _sender(True, requested_output_names={"A"})
    s.send(pb_utils.InferenceResponse([_t("A"), _t("B")]))
    response = sink.sent[0][0]
    assert response is not None
    assert [t.name() for t in response.output_tensors()] == ["A"]


def test_sender_is_cancelled() -> None:
    s, sink = _sender(True)
    assert s.is_cancelled() is False
    sink.cancelled = True
    assert s.is_cancelled() is True


def test_runtime_send_failure_propagates() -> None:
    def fail(response: pb_utils.InferenceResponse | None, flags: int) -> None:
        raise pb_utils.TritonModelException("An error occurred while sending a response.")

    s = pb_utils.InferenceResponseSender(fail, lambda: False, decoupled=True)
    with pytest.raises(pb_utils.TritonModelException) as e:
        s.send(pb_utils.InferenceResponse())
    assert str(e.value) == "An error occurred while sending a response."


def test_concurrent_sends_count_once_each() -> None:
    s, sink = _sender(True)
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        for _ in range(50):
            s.send(pb_utils.InferenceResponse())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _context.responses_sent(s) == 400
    assert len(sink.sent) == 400


def test_prune_output_tensors() -> None:
    r = pb_utils.InferenceResponse([_t("A"), _t("B"), _t("C")])
    _context.prune_output_tensors(r, ["C", "A"])
    assert [t.name() for t in r.output_tensors()] == ["A", "C"]


def test_error_code_enum_reachable_under_upstream_name() -> None:
    assert getattr(pb_utils.TritonError, "__ErrorCode") is pb_utils.TritonErrorCode
