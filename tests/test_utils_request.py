"""pb_tensor.utils: InferenceRequest, PreferredMemory, InferenceTrace and the BLS path through
the backend seam."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pb_tensor import utils as pb_utils
from pb_tensor.utils import _context


def _t(name: str = "IN") -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.arange(4, dtype=np.float32))


def _req(**kwargs: Any) -> pb_utils.InferenceRequest:
    base: dict[str, Any] = {
        "model_name": "m",
        "inputs": [_t()],
        "requested_output_names": ["OUT"],
    }
    base.update(kwargs)
    return pb_utils.InferenceRequest(**base)


class FakeBackend:
    """A ModelBackend recording BLS calls."""

    def __init__(self, name: str = "caller") -> None:
        self.name = name
        self.calls: list[tuple[pb_utils.InferenceRequest, bool, int | None]] = []
        self.cancelled = 0
        self.loaded: list[tuple[str, str, dict[str, bytes] | None]] = []
        self.unloaded: list[tuple[str, bool]] = []

    def exec_request(
        self, request: pb_utils.InferenceRequest, *, decoupled: bool, timeout_us: int | None
    ) -> pb_utils.InferenceResponse | Iterator[pb_utils.InferenceResponse]:
        self.calls.append((request, decoupled, timeout_us))
        x = request.inputs()[0].as_numpy()
        if not decoupled:
            return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)])
        backend = self

        class Stream:
            def __init__(self) -> None:
                self._items = [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + i)])
                               for i in range(3)] + [pb_utils.InferenceResponse()]

            def __iter__(self) -> Stream:
                return self

            def __next__(self) -> pb_utils.InferenceResponse:
                if not self._items:
                    raise StopIteration
                return self._items.pop(0)

            def cancel(self) -> None:
                backend.cancelled += 1

        return Stream()

    def is_model_decoupled(self) -> bool:
        return False

    def model_name(self) -> str:
        return self.name

    def model_dir(self) -> str:
        return "/models/" + self.name

    def load_model(self, model_name: str, config: str, files: dict[str, bytes] | None) -> None:
        self.loaded.append((model_name, config, files))

    def unload_model(self, model_name: str, unload_dependents: bool) -> None:
        self.unloaded.append((model_name, unload_dependents))

    def is_model_ready(self, model_name: str, model_version: str) -> bool:
        return model_name == "ready" and model_version in ("", "1")


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    b = FakeBackend()
    previous = _context.set_backend(b)
    try:
        yield b
    finally:
        _context.set_backend(previous)


# -- construction and accessors ---------------------------------------------------------------


def test_defaults_match_upstream() -> None:
    r = _req()
    assert r.request_id() == ""
    assert r.correlation_id() == 0
    assert r.flags() == 0
    assert r.timeout() == 0
    assert r.parameters() == "{}"
    assert r.model_name() == "m"
    assert r.model_version() == -1
    assert r.requested_output_names() == {"OUT"}
    assert r.is_cancelled() is False
    assert r.trace().get_context() is None
    assert r.preferred_memory().preferred_memory_type is None
    assert [t.name() for t in r.inputs()] == ["IN"]
    assert _context.release_flags(r) == pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL


def test_inputs_are_the_same_objects_and_zero_copy() -> None:
    t = _t()
    r = _req(inputs=[t])
    assert r.inputs()[0] is t
    # A new list each call, as upstream's vector conversion gives: callers cannot edit the
    # request through it.
    r.inputs().clear()
    assert r.inputs() == [t]
    r.requested_output_names().clear()
    assert r.requested_output_names() == {"OUT"}


def test_all_keywords_round_trip() -> None:
    r = pb_utils.InferenceRequest(
        model_name="target",
        inputs=[_t("A"), _t("B")],
        requested_output_names=["X", "Y", "X"],
        request_id="rid",
        correlation_id="seq-7",
        model_version=3,
        flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
        timeout=1500,
        preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
        trace=pb_utils.InferenceTrace("ctx"),
        parameters={"a": 1, "b": True, "c": "s"},
    )
    assert r.requested_output_names() == {"X", "Y"}
    assert r.request_id() == "rid"
    assert r.correlation_id() == "seq-7"
    assert r.model_version() == 3
    assert r.flags() == 1
    assert r.timeout() == 1500
    assert json.loads(r.parameters()) == {"a": 1, "b": True, "c": "s"}
    assert r.trace().get_context() == "ctx"
    pm = r.preferred_memory()
    assert pm.preferred_memory_type is pb_utils.TRITONSERVER_MEMORY_CPU
    assert pm.preferred_device_id == 0


def test_correlation_id_int_and_bool() -> None:
    assert _req(correlation_id=2**64 - 1).correlation_id() == 2**64 - 1
    cid = _req(correlation_id=True).correlation_id()
    assert cid == 1
    assert type(cid) is int


def test_correlation_id_wrong_type() -> None:
    with pytest.raises(pb_utils.TritonModelException) as e:
        _req(correlation_id=1.5)
    assert str(e.value) == "Correlation ID must be integer or string"


def test_correlation_id_negative() -> None:
    with pytest.raises(TypeError) as e:
        _req(correlation_id=-1)
    assert str(e.value) == (
        "InferenceRequest(): correlation_id=-1 is out of range [0, 18446744073709551615]"
    )


def test_none_input_message() -> None:
    with pytest.raises(pb_utils.TritonModelException) as e:
        _req(inputs=[None], request_id="r1", model_name="add")
    assert str(e.value) == (
        "Input tensor for request with id 'r1' and model name 'add' should not be empty."
    )


def test_empty_requested_output_name_message() -> None:
    with pytest.raises(pb_utils.TritonModelException) as e:
        _req(requested_output_names=["OUT", ""], request_id="r2", model_name="add")
    assert str(e.value) == (
        "Requested output name for request with id 'r2' and model name 'add' should not be "
        "empty."
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inputs": "IN"}, "InferenceRequest(): inputs must be a list of Tensor, got str"),
        ({"inputs": [np.zeros(2)]},
         "InferenceRequest(): inputs must be a list of Tensor, found ndarray"),
        ({"inputs": None}, "InferenceRequest(): inputs must be a list of Tensor, got NoneType"),
        ({"requested_output_names": "OUT"},
         "InferenceRequest(): requested_output_names must be a list of str, got str"),
        ({"requested_output_names": [1]},
         "InferenceRequest(): requested_output_names must be a list of str, found int"),
        (
            {"model_name": None},
            "InferenceRequest(): model_name must be a str or bytes, got NoneType",
        ),
        (
            {"model_name": b"\xff"},
            "InferenceRequest(): model_name b'\\xff' is not UTF-8 (invalid start byte)",
        ),
        ({"request_id": 5}, "InferenceRequest(): request_id must be a str, got int"),
        ({"flags": -1}, "InferenceRequest(): flags=-1 is out of range [0, 4294967295]"),
        ({"flags": 1.0}, "InferenceRequest(): flags must be an int, got float"),
        ({"timeout": None}, "InferenceRequest(): timeout must be an int, got NoneType"),
        ({"model_version": "1"}, "InferenceRequest(): model_version must be an int, got str"),
        ({"preferred_memory": 1},
         "InferenceRequest(): preferred_memory must be a PreferredMemory, got int"),
        ({"trace": "t"}, "InferenceRequest(): trace must be an InferenceTrace, got str"),
    ],
)
def test_constructor_type_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError) as e:
        _req(**kwargs)
    assert str(e.value) == message


def test_model_name_as_bytes(backend: FakeBackend) -> None:
    # python_backend's examples/bls/sync_model.py passes the name from a BYTES input.
    request = _req(model_name=b"add_sub")
    assert request.model_name() == "add_sub"
    request.exec()
    assert backend.calls[0][0].model_name() == "add_sub"


def test_missing_required_keyword() -> None:
    with pytest.raises(TypeError, match="requested_output_names"):
        pb_utils.InferenceRequest(model_name="m", inputs=[])  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ([1], "Expect dict, got <class 'list'>"),
        ({1: "a"}, "Expect parameters keys to have type str, found type <class 'int'>"),
        ({"a": 1.5},
         "Expect parameters values to have type bool/int/str, found type <class 'float'>"),
        ({"a": None},
         "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>"),
    ],
)
def test_parameters_errors(parameters: Any, message: str) -> None:
    with pytest.raises(pb_utils.TritonModelException) as e:
        _req(parameters=parameters)
    assert str(e.value) == message


def test_parameters_json_text() -> None:
    assert _req(parameters={"k": False}).parameters() == '{"k": false}'
    assert _req(parameters={}).parameters() == "{}"


def test_set_flags_and_release_flags() -> None:
    r = _req()
    r.set_flags(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
    assert r.flags() == 2
    r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    assert _context.release_flags(r) == 2
    with pytest.raises(TypeError) as e:
        r.set_flags(-3)
    assert str(e.value) == "set_flags(): flags=-3 is out of range [0, 4294967295]"
    with pytest.raises(TypeError) as e:
        r.set_release_flags("1")  # type: ignore[arg-type]
    assert str(e.value) == "set_release_flags(): flags must be an int, got str"


def test_cancel_request() -> None:
    r = _req()
    assert not r.is_cancelled()
    assert not r.get_response_sender().is_cancelled()
    _context.cancel_request(r)
    assert r.is_cancelled()
    assert r.get_response_sender().is_cancelled()


def test_own_request_sender_refuses_to_send() -> None:
    sender = _req().get_response_sender()
    with pytest.raises(pb_utils.TritonModelException) as e:
        sender.send(pb_utils.InferenceResponse())
    assert str(e.value) == (
        "Unable to send response. Response sender has no reference to the decoupled state of "
        "the model."
    )


def test_repr() -> None:
    assert repr(_req(request_id="r")) == (
        "InferenceRequest(model_name='m', inputs=['IN'], requested_output_names=['OUT'], "
        "request_id='r', correlation_id=0, flags=0)"
    )


# -- PreferredMemory / MemoryType / InferenceTrace ----------------------------------------------


def test_memory_type_values_are_upstreams() -> None:
    assert int(pb_utils.TRITONSERVER_MEMORY_GPU) == 0
    assert int(pb_utils.TRITONSERVER_MEMORY_CPU) == 1
    assert pb_utils.MemoryType.TRITONSERVER_MEMORY_CPU is pb_utils.TRITONSERVER_MEMORY_CPU


def test_preferred_memory() -> None:
    pm = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, 1)
    assert pm.preferred_memory_type is pb_utils.TRITONSERVER_MEMORY_GPU
    assert pm.preferred_device_id == 1
    assert repr(pm) == "PreferredMemory(TRITONSERVER_MEMORY_GPU, 1)"
    assert pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU).preferred_device_id == 0


def test_preferred_memory_errors() -> None:
    with pytest.raises(TypeError) as e:
        pb_utils.PreferredMemory(0)  # type: ignore[arg-type]
    assert str(e.value) == (
        "PreferredMemory(): preferred_memory_type must be pb_utils.TRITONSERVER_MEMORY_GPU or "
        "pb_utils.TRITONSERVER_MEMORY_CPU, got 0"
    )
    with pytest.raises(TypeError) as e:
        pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, None)  # type: ignore[arg-type]
    assert str(e.value) == "PreferredMemory(): preferred_device_id must be an int, got NoneType"


# -- BLS through the backend seam ----------------------------------------------------------------


def test_exec_without_runtime() -> None:
    assert _context.get_backend_or_none() is None
    with pytest.raises(pb_utils.TritonModelException) as e:
        _req().exec()
    assert str(e.value) == _context.NO_BACKEND_MESSAGE
    assert str(e.value).startswith("BLS is only supported during the 'execute' function.")


def test_exec(backend: FakeBackend) -> None:
    r = _req(timeout=250)
    response = r.exec()
    assert isinstance(response, pb_utils.InferenceResponse)
    out = pb_utils.get_output_tensor_by_name(response, "OUT")
    assert out is not None
    np.testing.assert_array_equal(out.as_numpy(), np.arange(4, dtype=np.float32) * 2)
    assert backend.calls == [(r, False, 250)]


def test_exec_timeout_zero_is_none(backend: FakeBackend) -> None:
    _req().exec()
    assert backend.calls[0][2] is None


def test_exec_decoupled(backend: FakeBackend) -> None:
    it = _req().exec(decoupled=True)
    assert isinstance(it, pb_utils.ResponseIterator)
    got = [len(resp.output_tensors()) for resp in it]
    assert got == [1, 1, 1, 0]  # the final response comes too, empty, as in Triton
    assert backend.calls[0][1] is True
    # A finished iterator replays from the start, as upstream's.
    assert len(list(it)) == 4
    it.cancel()  # no-op once finished
    assert backend.cancelled == 0


def test_response_iterator_cancel(backend: FakeBackend) -> None:
    it = _req().exec(decoupled=True)
    next(it)
    it.cancel()
    assert backend.cancelled == 1


def test_response_iterator_stop_message() -> None:
    it = pb_utils.ResponseIterator(pb_utils.InferenceResponse())
    assert len(next(it).output_tensors()) == 0
    with pytest.raises(StopIteration) as e:
        next(it)
    assert str(e.value) == "Iteration is done for the responses."


def test_exec_decoupled_type_error(backend: FakeBackend) -> None:
    with pytest.raises(TypeError) as e:
        _req().exec(decoupled=1)  # type: ignore[call-overload]
    assert str(e.value) == "exec(): decoupled must be a bool, got int"


def test_async_exec(backend: FakeBackend) -> None:
    async def main() -> tuple[pb_utils.InferenceResponse, list[pb_utils.InferenceResponse]]:
        one = await _req().async_exec()
        many = await _req().async_exec(decoupled=True)
        return one, list(many)

    one, many = asyncio.run(main())
    assert len(one.output_tensors()) == 1
    assert len(many) == 4
    assert [c[1] for c in backend.calls] == [False, True]


def test_async_exec_without_runtime() -> None:
    async def main() -> None:
        await _req().async_exec()

    with pytest.raises(pb_utils.TritonModelException) as e:
        asyncio.run(main())
    assert str(e.value) == _context.NO_BACKEND_MESSAGE


def test_async_exec_without_loop(backend: FakeBackend) -> None:
    with pytest.raises(RuntimeError, match="no running event loop"):
        _req().async_exec()


def test_backend_returns_garbage(backend: FakeBackend) -> None:
    class Bad(FakeBackend):
        def exec_request(self, request: Any, *, decoupled: bool, timeout_us: int | None) -> Any:
            return 42

    previous = _context.set_backend(Bad())
    try:
        with pytest.raises(pb_utils.TritonModelException) as e:
            _req().exec()
        assert str(e.value) == "the runtime returned int for a BLS request, not a response"
        with pytest.raises(pb_utils.TritonModelException) as e:
            _req().exec(decoupled=True)
        assert str(e.value) == "the runtime returned int for a decoupled BLS request"
    finally:
        _context.set_backend(previous)


def test_process_backend_and_context_precedence() -> None:
    proc = FakeBackend("proc")
    ctx = FakeBackend("ctx")
    assert _context.set_process_backend(proc) is None
    try:
        assert _context.get_backend() is proc
        prev = _context.set_backend(ctx)
        assert _context.get_backend() is ctx
        _context.set_backend(prev)
        assert _context.get_backend() is proc
    finally:
        assert _context.set_process_backend(None) is proc
    assert _context.get_backend_or_none() is None


def test_model_control(backend: FakeBackend) -> None:
    pb_utils.load_model("x", config='{"backend": "python"}', files={"file:1/model.py": b"x"})
    pb_utils.load_model(model_name="y")
    pb_utils.unload_model("x", unload_dependents=True)
    assert backend.loaded == [
        ("x", '{"backend": "python"}', {"file:1/model.py": b"x"}),
        ("y", "", None),
    ]
    assert backend.unloaded == [("x", True)]
    assert pb_utils.is_model_ready("ready") is True
    assert pb_utils.is_model_ready("ready", "2") is False
    assert pb_utils.get_model_dir() == "/models/caller"


def test_model_control_without_runtime() -> None:
    for call in (
        lambda: pb_utils.load_model("x"),
        lambda: pb_utils.unload_model("x"),
        lambda: pb_utils.is_model_ready("x"),
        pb_utils.get_model_dir,
    ):
        with pytest.raises(pb_utils.TritonModelException) as e:
            call()
        assert str(e.value) == _context.NO_BACKEND_MESSAGE


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pb_utils.load_model(None), "load_model(): model_name must be a str, got NoneType"),
        (lambda: pb_utils.load_model("x", config=None),
         "load_model(): config must be a str, got NoneType"),
        (lambda: pb_utils.load_model("x", files=[]),
         "load_model(): files must be a dict or None, got list"),
        (lambda: pb_utils.unload_model(1), "unload_model(): model_name must be a str, got int"),
        (lambda: pb_utils.unload_model("x", 1),
         "unload_model(): unload_dependents must be a bool, got int"),
        (lambda: pb_utils.is_model_ready(1), "is_model_ready(): model_name must be a str, got int"),
        (lambda: pb_utils.is_model_ready("x", 1),
         "is_model_ready(): model_version must be a str, got int"),
    ],
)
def test_model_control_type_errors(call: Any, message: str) -> None:
    with pytest.raises(TypeError) as e:
        call()
    assert str(e.value) == message


# -- make_request (the runtime's constructor) -----------------------------------------------------


def test_make_request() -> None:
    sent: list[tuple[pb_utils.InferenceResponse | None, int]] = []
    cancelled = [False]
    sender = pb_utils.InferenceResponseSender(
        lambda r, f: sent.append((r, f)), lambda: cancelled[0], decoupled=True
    )
    r = _context.make_request(
        [_t("A")],
        ["OUT"],
        model_name="add",
        model_version=1,
        request_id="7",
        correlation_id=5,
        flags=3,
        timeout=10,
        parameters='{"x": 1.5}',
        sender=sender,
    )
    assert r.parameters() == '{"x": 1.5}'  # Triton's own text is kept as given
    assert r.get_response_sender() is sender
    assert (r.request_id(), r.correlation_id(), r.flags(), r.timeout()) == ("7", 5, 3, 10)
    assert not r.is_cancelled()
    cancelled[0] = True
    assert r.is_cancelled()
    r.get_response_sender().send(pb_utils.InferenceResponse(), flags=1)
    assert len(sent) == 1


def test_make_request_parameters_dict_and_errors() -> None:
    r = _context.make_request([], [], model_name="m", parameters={"a": "b"})
    assert r.parameters() == '{"a": "b"}'
    with pytest.raises(ValueError) as e:  # noqa: PT011 - the text is compared exactly
        _context.make_request([], [], model_name="m", parameters="[1]")
    assert str(e.value) == "make_request(): parameters='[1]' is not a JSON object"


def test_own_sender_is_one_object_across_threads() -> None:
    import threading

    r = _req()
    got: list[pb_utils.InferenceResponseSender] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        got.append(r.get_response_sender())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in got}) == 1
    assert got[0] is r.get_response_sender()
