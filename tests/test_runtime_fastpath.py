"""The runtime's fast paths keep every observable behaviour: requests built without the public
constructor, senders made on first use, validation of numpy inputs before they become
tensors."""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_models import EXAMPLES, HEADER, IDENTITY_CONFIG

from pb_tensor import Tensor, TritonDtype
from pb_tensor.errors import TritonModelException
from pb_tensor.runtime import InferenceError, ModelRepository
from pb_tensor.runtime._validate import (
    IOSpec,
    ModelSpec,
    array_tensors,
    arrays_ok,
    validate_request,
)
from pb_tensor.utils import InferenceResponse, TritonError
from pb_tensor.utils._context import (
    InferenceResponseSender,
    claim_direct_send,
    created_senders,
    make_request,
    new_request,
    responses_sent,
    sender_is_closed,
)

pytest.importorskip("google.protobuf", reason="the runtime needs protobuf (the runtime extra)")

# -- requests built for the runtime ---------------------------------------------------------


class _Source:
    """A sender source that records what the requests ask of it."""

    def __init__(self, cancelled: bool = False, done: bool = False) -> None:
        self.made: list[tuple[int, frozenset[str]]] = []
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.cancelled = cancelled
        self.done = done

    def make_sender(
        self, index: int, requested_output_names: Collection[str]
    ) -> InferenceResponseSender:
        self.made.append((index, frozenset(requested_output_names)))
        sender = InferenceResponseSender(
            lambda r, f: self.sent.append((r, f)), lambda: self.cancelled,
            decoupled=False, requested_output_names=requested_output_names,
        )  # fmt: skip
        if self.done:
            from pb_tensor.utils._context import close_sender

            close_sender(sender)
        return sender

    def is_cancelled(self, index: int) -> bool:
        return self.cancelled


def _tensors() -> list[Tensor]:
    return [Tensor("A", np.arange(3, dtype=np.float32)), Tensor("B", np.ones(2, np.int64))]


def _fast(**kw: Any) -> Any:
    args: dict[str, Any] = dict(
        inputs=_tensors(), requested_output_names=["X", "Y"], model_name="m",
        model_version=3, request_id="", correlation_id=0, flags=0, timeout=0,
        parameters="{}", source=_Source(), index=0,
    )  # fmt: skip
    args.update(kw)
    return new_request(**args)


def _public(**kw: Any) -> Any:
    args: dict[str, Any] = dict(
        inputs=_tensors(), requested_output_names=["X", "Y"], model_name="m",
        model_version=3, request_id="", correlation_id=0, flags=0, timeout=0, parameters="{}",
    )  # fmt: skip
    args.update(kw)
    return make_request(args.pop("inputs"), args.pop("requested_output_names"), **args)


def _view(r: Any) -> tuple[Any, ...]:
    return (
        [(t.name(), t.as_numpy().tolist()) for t in r.inputs()], r.requested_output_names(),
        r.request_id(), r.correlation_id(), r.flags(), r.timeout(), r.parameters(),
        r.model_name(), r.model_version(), repr(r.preferred_memory()),
        r.trace().get_context(),
        r.is_cancelled(), repr(r),
    )  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"request_id": "r7", "correlation_id": 12, "flags": 3, "timeout": 99},
        {"correlation_id": "seq-1"},
        {"correlation_id": 2**64 - 1, "flags": 2**32 - 1, "timeout": 2**64 - 1},
        {"parameters": '{"a": 1, "b": "x"}'},
        {"requested_output_names": ["Y", "X", "Y"]},
    ],
)
def test_new_request_is_what_the_public_constructor_builds(kw: dict[str, Any]) -> None:
    assert _view(_fast(**kw)) == _view(_public(**kw))


@pytest.mark.parametrize(
    "kw",
    [
        {"correlation_id": -1},
        {"correlation_id": 2**64},
        {"correlation_id": None},
        {"correlation_id": 1.5},
        {"flags": -1},
        {"flags": 2**32},
        {"flags": True},
        {"timeout": -1},
        {"request_id": 5},
        {"parameters": "[1, 2]"},
    ],
)
def test_new_request_refuses_what_the_public_constructor_refuses(kw: dict[str, Any]) -> None:
    with pytest.raises((TypeError, TritonModelException, ValueError)) as public:
        _public(**kw)
    with pytest.raises((TypeError, TritonModelException, ValueError)) as fast:
        _fast(**kw)
    assert type(fast.value) is type(public.value)
    assert str(fast.value) == str(public.value)


def test_sender_is_made_on_first_use_once() -> None:
    source = _Source()
    r = _fast(source=source, index=4)
    assert source.made == []
    assert created_senders([r]) == []
    senders: list[InferenceResponseSender] = []
    threads = [
        threading.Thread(target=lambda: senders.append(r.get_response_sender()))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s is senders[0] for s in senders)
    assert source.made == [(4, frozenset({"X", "Y"}))]
    assert created_senders([r]) == [senders[0]]


def test_cancellation_reaches_a_request_without_a_sender() -> None:
    source = _Source(cancelled=False)
    r = _fast(source=source)
    assert r.is_cancelled() is False
    source.cancelled = True
    assert r.is_cancelled() is True
    assert source.made == []  # asking did not make a sender
    assert r.get_response_sender().is_cancelled() is True


def test_directly_delivered_response_counts_as_sent() -> None:
    r = _fast(source=_Source(), requested_output_names=["X"])
    a, b = Tensor("X", np.zeros(1, np.int8)), Tensor("Y", np.zeros(1, np.int8))
    response = InferenceResponse([a, b])
    assert claim_direct_send(r, response) is True
    assert [t.name() for t in response.output_tensors()] == ["X"]  # pruned as send() does
    assert claim_direct_send(r, response) is False  # the next one goes through the sender
    sender = r.get_response_sender()
    assert responses_sent(sender) == 1
    assert sender_is_closed(sender)
    with pytest.raises(TritonModelException) as e:
        sender.send(InferenceResponse())
    assert str(e.value) == (
        "Unable to send response. Non-decoupled model cannot send more than one response."
    )


def test_taken_sender_is_not_claimed() -> None:
    source = _Source()
    r = _fast(source=source)
    sender = r.get_response_sender()
    assert claim_direct_send(r, InferenceResponse()) is False
    assert r.get_response_sender() is sender
    sender.send(InferenceResponse(), 1)
    assert len(source.sent) == 1


def test_request_built_by_a_model_keeps_the_refusing_sender() -> None:
    r = make_request(_tensors(), ["X"], model_name="m")
    with pytest.raises(TritonModelException) as e:
        r.get_response_sender().send(InferenceResponse())
    assert "has no reference to the decoupled state" in str(e.value)


# -- senders of a model's requests, in both modes -----------------------------------------

LATE = """
class TritonPythonModel:
    def initialize(self, args):
        self.previous = []

    def execute(self, requests):
        outcomes = []
        for old in self.previous:
            try:
                old.get_response_sender().send(ok(old))
                outcomes.append("sent")
            except pb_utils.TritonModelException as exc:
                outcomes.append(str(exc))
        self.previous = list(requests)
        if outcomes:
            error = pb_utils.TritonError(" | ".join(outcomes))
            return [pb_utils.InferenceResponse(error=error) for r in requests]
        responses = []
        for r in requests:
            mode = int(value(r)[0])
            if mode == 1:
                r.get_response_sender()  # taken, not used: the returned response uses it
            if mode == 2:
                r.get_response_sender().send(
                    ok(r), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                responses.append(None)
            elif mode == 3:
                responses.append(None)  # no response at all
            else:
                responses.append(ok(r))
        return responses
"""


@pytest.fixture(scope="module")
def late_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    (root / "late" / "1").mkdir(parents=True)
    (root / "late" / "1" / "model.py").write_text(HEADER + textwrap.dedent(LATE))
    (root / "late" / "config.pbtxt").write_text('name: "late"\n' + IDENTITY_CONFIG)
    return root


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_senders_after_the_batch_ended(late_repo: Path, isolated: bool) -> None:
    with ModelRepository(late_repo) as repo, repo.load(
        "late", isolated=isolated, timeout=60
    ) as model:
        first = model.infer_many([{"IN": np.array([m], np.int32)} for m in (0, 1, 2, 3)])
        assert [r["OUT"].tolist() for r in first[:3] if not isinstance(r, InferenceError)] == [
            [0], [1], [2]]  # fmt: skip
        assert isinstance(first[3], InferenceError)
        assert first[3].message() == (
            "Failed to process the request(s) for model 'late_0', message: the model "
            "neither returned nor sent a response for the request"
        )
        with pytest.raises(InferenceError) as info:
            model.infer({"IN": np.array([0], np.int32)})
        more = "Unable to send response. Non-decoupled model cannot send more than one response."
        closed = "Unable to send response. Response sender has been closed."
        assert info.value.message() == " | ".join([more, more, more, closed])
        assert info.value.code() == TritonError.INTERNAL


# -- validation of numpy inputs before they become tensors ---------------------------------

_DTYPES = [TritonDtype.TYPE_FP32, TritonDtype.TYPE_INT64, TritonDtype.TYPE_BOOL,
           TritonDtype.TYPE_UINT8, TritonDtype.TYPE_FP16]  # fmt: skip
_NUMPY = {TritonDtype.TYPE_FP32: np.float32, TritonDtype.TYPE_INT64: np.int64,
          TritonDtype.TYPE_BOOL: np.bool_, TritonDtype.TYPE_UINT8: np.uint8,
          TritonDtype.TYPE_FP16: np.float16}  # fmt: skip


@st.composite
def _case(draw: st.DrawFn) -> tuple[ModelSpec, dict[str, Any]]:
    max_batch = draw(st.sampled_from([0, 0, 2, 4]))
    n = draw(st.integers(1, 3))
    inputs = []
    for i in range(n):
        dims = tuple(draw(st.lists(st.sampled_from([-1, 1, 2, 3]), max_size=3)))
        inputs.append(IOSpec(f"I{i}", draw(st.sampled_from(_DTYPES)), dims))
    spec = ModelSpec("m", max_batch, tuple(inputs), (IOSpec("O", TritonDtype.TYPE_FP32, (-1,)),))
    given: dict[str, Any] = {}
    batch = draw(st.integers(0, 5))
    for io in inputs:
        if draw(st.integers(0, 9)) == 0:
            continue  # missing
        name = io.name if draw(st.integers(0, 9)) else "I9"
        shape = [d if d != -1 else draw(st.integers(0, 3)) for d in io.dims]
        if draw(st.integers(0, 5)) == 0 and shape:
            shape[-1] += 1
        if max_batch > 0 and draw(st.integers(0, 9)):
            shape.insert(0, batch if draw(st.integers(0, 9)) else batch + 1)
        dtype: Any = _NUMPY[io.dtype] if draw(st.integers(0, 7)) else np.float64
        if draw(st.integers(0, 9)) == 0:
            dtype = np.dtype(dtype).newbyteorder(">")
        given[name] = np.zeros(shape, dtype=dtype)
    return spec, given


@settings(max_examples=400, deadline=None)
@given(_case())
def test_arrays_ok_agrees_with_validation(case: tuple[ModelSpec, dict[str, Any]]) -> None:
    spec, given = case
    try:
        tensors = [Tensor(name, value) for name, value in given.items()]
        wanted = validate_request(spec, tensors, None)
    except (InferenceError, TritonModelException):  # refused as an input, or by validation
        assert not arrays_ok(spec, given)
        return
    assert wanted == ["O"]
    # No optional or BYTES inputs here: the quick check decides every valid case of arrays
    # with numpy's own dtype objects itself (other equal dtypes take the full path).
    if all(v.dtype is np.dtype(v.dtype.type) for v in given.values()):
        assert arrays_ok(spec, given)


def test_arrays_ok_decides_the_common_cases() -> None:
    spec = ModelSpec("m", 4, (IOSpec("A", TritonDtype.TYPE_FP32, (-1, 2)),
                              IOSpec("B", TritonDtype.TYPE_INT32, ())), ())  # fmt: skip
    a = np.zeros((3, 5, 2), np.float32)
    b = np.zeros((3,), np.int32)
    assert arrays_ok(spec, {"A": a, "B": b})
    assert not arrays_ok(spec, {"A": a, "B": b[:2]})  # batch sizes differ
    assert not arrays_ok(spec, {"A": a[:, :, :1], "B": b})  # fixed dim
    assert not arrays_ok(spec, {"A": np.zeros((5, 1, 2), np.float32), "B": np.zeros(5, np.int32)})
    assert not arrays_ok(spec, {"A": a, "B": b.astype(np.int64)})
    assert not arrays_ok(spec, {"A": a, "B": [0, 0, 0]})  # not an array: the full path
    optional = ModelSpec("m", 0, (IOSpec("A", TritonDtype.TYPE_FP32, (-1,), optional=True),), ())
    assert optional.array_table is None
    text = ModelSpec("m", 0, (IOSpec("A", TritonDtype.TYPE_BYTES, (-1,)),), ())
    assert text.array_table is None


def test_infer_errors_are_the_same_on_both_paths(late_repo: Path) -> None:
    """A request the fast check passes on runs as before; one it does not gets the full
    validation's messages."""
    with ModelRepository(late_repo) as repo, repo.load("late", isolated=False) as model:
        with pytest.raises(InferenceError) as info:
            model.infer({"IN": np.zeros((1, 2), np.int32)})
        assert info.value.message() == (
            "[request id: <id_unknown>] unexpected shape for input 'IN' for model 'late'. "
            "Expected [-1], got [1,2]. "
        )
        with pytest.raises(InferenceError) as info:
            model.infer({"IN": np.zeros(2, np.int64)})
        assert info.value.message() == (
            "[request id: <id_unknown>] inference input 'IN' data-type is 'INT64', but model "
            "'late' expects 'INT32'"
        )
        assert model.infer({"IN": [4]})["OUT"].tolist() == [4]  # a list takes the slow path


# -- inputs copied once, when the request is made -------------------------------------------


def test_array_tensors_copy_gives_contiguous_writable_copies() -> None:
    spec = ModelSpec("m", 0, (IOSpec("A", TritonDtype.TYPE_FP32, (-1, 2)),
                              IOSpec("B", TritonDtype.TYPE_INT32, (3,))), ())  # fmt: skip
    a = np.arange(12, dtype=np.float32).reshape(6, 2)[::2]  # strided: not C-contiguous
    b = np.arange(3, dtype=np.int32)
    b.flags.writeable = False
    shared = array_tensors(spec, {"A": a, "B": b})
    copied = array_tensors(spec, {"A": a, "B": b}, copy=True)
    assert shared is not None
    assert copied is not None
    assert np.shares_memory(shared[1].as_numpy(), b)
    for tensor, source in zip(copied, (a, b)):
        array = tensor.as_numpy()
        assert not np.shares_memory(array, source)
        assert array.flags.c_contiguous
        assert array.flags.writeable
        assert array.dtype == source.dtype
        assert array.tolist() == source.tolist()
    assert [t.name() for t in copied] == ["A", "B"]
    assert [t.dtype for t in copied] == [TritonDtype.TYPE_FP32, TritonDtype.TYPE_INT32]


SLOW_ECHO = """
class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            array = value(r)
            if array[0] < 0:
                time.sleep(0.5)  # holds the only instance while the next request waits
            responses.append(ok(r, array.copy()))
        return responses
"""


def test_in_process_inputs_are_copied_when_the_request_is_made(tmp_path: Path) -> None:
    """As a Triton client's bytes are on their way once it sent them: a caller changing its
    array while its request waits for the instance does not change the request (the copy
    used to be made when the request ran; it failed before)."""
    (tmp_path / "slow_echo" / "1").mkdir(parents=True)
    (tmp_path / "slow_echo" / "1" / "model.py").write_text(HEADER + textwrap.dedent(SLOW_ECHO))
    (tmp_path / "slow_echo" / "config.pbtxt").write_text('name: "slow_echo"\n' + IDENTITY_CONFIG)
    with ModelRepository(tmp_path) as repo, repo.load("slow_echo", isolated=False) as model:
        first = model.infer_async({"IN": np.array([-1], np.int32)})
        caller = np.array([1, 2], np.int32)
        second = model.infer_async({"IN": caller})
        caller[:] = 7
        assert second.result(timeout=30)["OUT"].tolist() == [1, 2]
        assert first.result(timeout=30)["OUT"].tolist() == [-1]


@pytest.mark.parametrize("share", [False, True], ids=["copied", "shared"])
def test_requested_outputs_take_the_array_path(share: bool) -> None:
    """Arrays that match the configuration become the request's tensors at once whether or
    not the caller names outputs (tritonclient usually does); the outputs, their order and
    the errors are those of the full validation."""
    a = np.arange(4, dtype=np.float32)
    b = np.ones(4, dtype=np.float32)
    inputs = {"INPUT0": a, "INPUT1": b}
    with ModelRepository(EXAMPLES, share_inputs=share) as repo, repo.load(
        "add_sub", isolated=False
    ) as model:
        data = model._request(inputs, ("OUTPUT1", "OUTPUT0", "OUTPUT1"), None, 0, 0, "")
        assert data.validated
        assert data.delivered
        assert data.requested_outputs == ["OUTPUT1", "OUTPUT0"]
        assert np.shares_memory(data.inputs[0].as_numpy(), a) is share
        out = model.infer(inputs, requested_outputs=["OUTPUT1"])
        assert list(out) == ["OUTPUT1"]
        assert out["OUTPUT1"].tolist() == (a - b).tolist()
        out = model.infer(inputs, requested_outputs=iter(["OUTPUT1", "OUTPUT0"]))
        assert sorted(out) == ["OUTPUT0", "OUTPUT1"]
        for requested in (["OUTPUT0", "X"], "OUTPUT0"):
            with pytest.raises(InferenceError) as info:
                model.infer(inputs, requested_outputs=requested)
            bad = "X" if requested != "OUTPUT0" else "O"
            assert info.value.message() == (
                f"unexpected inference output '{bad}' for model 'add_sub'"
            )
        assert model.statistics()["inference_stats"]["fail"]["count"] == 2
