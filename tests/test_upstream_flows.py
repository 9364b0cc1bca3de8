"""Triton's own models for response parameters, response senders, request cancellation and
``async def execute``, run in both modes with the inputs and assertions of upstream's L0 tests:

* qa ``L0_backend_python/parameters/response_parameters_test.py`` (models
  ``response_parameters``, ``response_parameters_decoupled``, ``response_parameters_bls``);
* qa ``L0_backend_python/response_sender/response_sender_test.py`` and
  ``response_sender_complete_final_test.py`` (``response_sender`` laid out as its
  ``test.sh`` does, ``response_sender_complete_final``);
* qa ``L0_backend_python/decoupled/decoupled_test.py``' BLS cancellation tests (its models
  ``decoupled_bls_cancel``, ``decoupled_bls_async_cancel``,
  ``decoupled_bls_cancel_after_complete`` calling ``response_sender_until_cancelled``);
* (qa ``L0_backend_python/async_execute/concurrency_test.py`` runs in
  ``tests/test_upstream_async_execute.py``;)
* qa ``L0_backend_python/lifecycle/lifecycle_test.py::test_execute_cancel`` and
  ``decoupled/decoupled_test.py::test_decoupled_execute_cancel`` (``execute_cancel``), driven
  through ``LoadedModel.infer_async`` and ``stream(...).cancel()``, the runtime's side of a
  client's ``future.cancel()`` / ``stop_stream(cancel_requests=True)``.

Where upstream's client sees a gRPC status, these tests see the ``InferenceError`` code of the
same name (``INVALID_ARGUMENT``: ``TritonError.INVALID_ARG``, ``CANCELLED``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from upstream_models import PYTHON_MODELS, QA_BACKEND_PYTHON, repository

from pb_tensor.runtime import InferenceError, LoadedModel, ModelRepository, Outputs
from pb_tensor.utils import TritonError

DECOUPLED = "model_transaction_policy { decoupled: True }\n"
DECOUPLED_MODELS = QA_BACKEND_PYTHON / "decoupled" / "models"
BLS_CANCEL = [
    "decoupled_bls_cancel", "decoupled_bls_async_cancel", "decoupled_bls_cancel_after_complete",
]  # fmt: skip
Loader = Callable[[str], LoadedModel]


def _decoupled(text: str) -> str:
    """``echo "model_transaction_policy { decoupled: True }" >> config.pbtxt``"""
    return text + DECOUPLED


@pytest.fixture(scope="module")
def upstream_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sender = PYTHON_MODELS / "response_sender"
    return repository(
        tmp_path_factory.mktemp("flows"),
        {
            "response_parameters": PYTHON_MODELS / "response_parameters",
            "response_parameters_decoupled": PYTHON_MODELS / "response_parameters_decoupled",
            "response_parameters_bls": PYTHON_MODELS / "response_parameters_bls",
            "response_sender": sender,
            "response_sender_decoupled": sender,
            "response_sender_async": sender,
            "response_sender_decoupled_async": sender,
            "response_sender_complete_final": PYTHON_MODELS / "response_sender_complete_final",
            "execute_cancel": PYTHON_MODELS / "execute_cancel",
            "execute_cancel_decoupled": PYTHON_MODELS / "execute_cancel",
            "response_sender_until_cancelled": PYTHON_MODELS / "response_sender_until_cancelled",
            **{name: DECOUPLED_MODELS / name for name in BLS_CANCEL},
        },
        model_file={
            "response_sender_async": "model_async.py",
            "response_sender_decoupled_async": "model_async.py",
        },
        config_edit={
            "response_sender_decoupled": _decoupled,
            "response_sender_decoupled_async": _decoupled,
            # decoupled/test.sh appends the policy to execute_cancel's configuration; the
            # name it carries is the folder's (the runtime checks it), hence the rename.
            "execute_cancel_decoupled": lambda t: _decoupled(
                t.replace('name: "execute_cancel"', 'name: "execute_cancel_decoupled"')
            ),
        },
    )


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "isolated"])
def load(request: pytest.FixtureRequest, upstream_repo: Path) -> Iterator[Loader]:
    """``load(name)``: the model in this module's mode, loaded once per mode. Model logs at
    INFO reach ``logging`` (stubs take the level at load)."""
    isolated: bool = request.param
    runtime_log = logging.getLogger("pb_tensor.runtime")
    level = runtime_log.level
    runtime_log.setLevel(logging.INFO)
    cache: dict[str, LoadedModel] = {}
    try:
        with ModelRepository(upstream_repo) as repo:

            def get(name: str) -> LoadedModel:
                if name not in cache:
                    cache[name] = repo.load(name, isolated=isolated, timeout=60)
                return cache[name]

            yield get
    finally:
        runtime_log.setLevel(level)


def _text(value: Any) -> str:
    """A BYTES element as text (``str(value, encoding="utf-8")`` in upstream's tests)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


# -- response parameters (qa parameters/response_parameters_test.py) -------------------------------
def _params_input(params: Any) -> dict[str, Any]:
    return {"RESPONSE_PARAMETERS": np.array([[json.dumps(params)]], dtype=np.object_)}


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"many_elements": False},
        {"bool": True, "str": "Hello World!", "int": 1024},
        {"a": "1", "b": "2", "c": 3, "d": False, "e": 5, "f": ""},
    ],
    ids=["empty", "one", "three", "multi"],
)
def test_response_parameters(load: Loader, params: dict[str, Any]) -> None:
    result = load("response_parameters").infer(_params_input(params))
    assert isinstance(result, Outputs)
    assert result.parameters == params
    assert _text(result["OUTPUT"][0][0]) == json.dumps(params)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ([], ", got <class 'list'>"),
        ({"1": "int key"}, "Expect parameters keys to have type str, found type <class 'int'>"),
        (
            {"int": 2, "float": 0.5},
            "Expect parameters values to have type bool/int/str, found type <class 'float'>",
        ),
        (
            {"bool": True, "null": None},
            "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>",
        ),
        (
            {"str": "", "list": ["variable"]},
            "Expect parameters values to have type bool/int/str, found type <class 'list'>",
        ),
    ],
    ids=["wrong_type", "int_key", "float", "null", "nested"],
)
def test_response_parameters_refused(load: Loader, params: Any, expected: str) -> None:
    with pytest.raises(InferenceError) as info:
        load("response_parameters").infer(_params_input(params))
    assert info.value.code() == TritonError.INVALID_ARG
    assert expected in info.value.message()


def test_response_parameters_decoupled(load: Loader) -> None:
    params = [{"bool": False, "int": 2048}, {"str": "Hello World!"}]
    responses = list(load("response_parameters_decoupled").stream(_params_input(params)))
    assert len(responses) == len(params)
    for response, expected in zip(responses, params):
        # Upstream also expects "triton_final_response": False, a parameter Triton's gRPC
        # streaming front end adds; the runtime has no front end and adds nothing.
        assert response.parameters == expected
        assert _text(response["OUTPUT"][0][0]) == json.dumps(expected)


def test_response_parameters_bls(load: Loader) -> None:
    load("response_parameters")
    load("response_parameters_decoupled")
    params = {"bool": False, "int": 2048, "str": "Hello World!"}
    params_decoupled = [{}, {"bool": True, "int": 10000}, {"str": "?"}]
    result = load("response_parameters_bls").infer(
        {
            "RESPONSE_PARAMETERS": np.array([[json.dumps(params)]], dtype=np.object_),
            "RESPONSE_PARAMETERS_DECOUPLED": np.array(
                [[json.dumps(params_decoupled)]], dtype=np.object_
            ),
        }
    )
    assert _text(result["OUTPUT"][0][0]) == "True"


# -- response senders (qa response_sender/response_sender_test.py) --------------------------------
def _sender_inputs(
    before: int, final_before: bool, returned: bool, after: int, final_after: bool
) -> dict[str, Any]:
    return {
        "NUMBER_OF_RESPONSE_BEFORE_RETURN": np.array([[before]], np.uint8),
        "SEND_COMPLETE_FINAL_FLAG_BEFORE_RETURN": np.array([[final_before]], bool),
        "RETURN_A_RESPONSE": np.array([[returned]], bool),
        "NUMBER_OF_RESPONSE_AFTER_RETURN": np.array([[after]], np.uint8),
        "SEND_COMPLETE_FINAL_FLAG_AFTER_RETURN": np.array([[final_after]], bool),
    }


ZERO_PRE = (0, True, False, 0, False)
ZERO_POST = (0, False, False, 0, True)
ONE_PRE = (1, True, False, 0, False)
ONE_POST = (0, False, False, 1, True)
TWO_PRE = (2, True, False, 0, False)
TWO_POST = (0, False, False, 2, True)
PRE_AND_POST = (1, False, False, 3, True)
ON_RETURN = (0, False, True, 0, False)
PRE_AND_ON = (1, True, True, 0, False)
ON_AND_POST = (0, False, True, 1, True)


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions raised in threads (a model's send after its sender closed raises in the
    model's own thread, where upstream says nothing catches it)."""
    errors: list[BaseException] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            errors.append(args.exc_value)

    threading.excepthook = hook
    try:
        yield errors
    finally:
        threading.excepthook = previous


def _late_send_raised(errors: list[BaseException], message: str) -> None:
    """Wait (bounded) for the model's post-return send to raise ``message`` in its thread
    (upstream's response_sender.cc checks the non-decoupled rule before the closed one)."""
    for _ in range(600):
        if errors:
            break
        threading.Event().wait(0.05)
    assert [str(e) for e in errors] == [f"Unable to send response. {message}"]


def _count(responses: list[Outputs]) -> tuple[int, bool, int]:
    """``_assert_responses_valid``: responses before return, whether one was returned (at
    most one), responses after return, told apart by their INDEX."""
    before, returned, after = 0, False, 0
    for result in responses:
        index = result["INDEX"]
        response_id = index.sum() / index.shape[0]
        if response_id < 1000:
            assert not returned, "Expect at most one response returned per request."
            returned = True
        elif response_id < 2000:
            before += 1
        elif response_id < 3000:
            after += 1
        else:
            raise AssertionError(f"Unexpected response_id: {response_id}")
    return before, returned, after


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (ON_RETURN, (0, True, 0)),
        (ONE_PRE, (1, False, 0)),
        (ONE_POST, (0, False, 1)),
        # The 2nd send raises in the model: the client gets the 1st response only.
        (TWO_PRE, (1, False, 0)),
        (PRE_AND_ON, (1, False, 0)),
        (ON_AND_POST, (0, True, 0)),
    ],
    ids=["on_return", "one_pre", "one_post", "two_pre", "pre_and_on", "on_and_post"],
)
@pytest.mark.parametrize("name", ["response_sender", "response_sender_async"])
def test_non_decoupled_response_sender(
    load: Loader,
    name: str,
    case: tuple[Any, ...],
    expected: tuple[int, bool, int],
    thread_errors: list[BaseException],
) -> None:
    # Upstream reads these through a gRPC stream: every response the client receives. The
    # async model sends after return from a task on the model's event loop, which keeps
    # running after execute returned (before: those responses never came).
    model = load(name)
    responses = list(model.stream(_sender_inputs(*case)))
    assert _count(responses) == expected
    # A stub's thread errors go to its stderr, a task's to asyncio's log.
    if case == ON_AND_POST and not model.isolated and name == "response_sender":
        _late_send_raised(thread_errors, "Non-decoupled model cannot send more than one response.")


@pytest.mark.parametrize("name", ["response_sender", "response_sender_async"])
def test_non_decoupled_final_before_any_response(load: Loader, name: str) -> None:
    with pytest.raises(InferenceError) as info:
        load(name).infer(_sender_inputs(*ZERO_PRE))
    assert "Non-decoupled model cannot send complete final before sending a response" in (
        info.value.message()
    )


def test_non_decoupled_sender_after_return_with_infer(load: Loader) -> None:
    """A response sent from another thread after ``execute`` returned None is the
    request's response (before: "the model neither returned nor sent a response")."""
    result = load("response_sender").infer(_sender_inputs(*ONE_POST))
    assert int(result["INDEX"][0][0]) == 2000


@pytest.mark.parametrize(
    "case",
    [ZERO_PRE, ZERO_POST, ONE_PRE, ONE_POST, TWO_PRE, TWO_POST, PRE_AND_POST, PRE_AND_ON],
    ids=["zero_pre", "zero_post", "one_pre", "one_post", "two_pre", "two_post",
         "pre_and_post", "pre_and_on"],
)  # fmt: skip
@pytest.mark.parametrize("name", ["response_sender_decoupled", "response_sender_decoupled_async"])
def test_decoupled_response_sender(load: Loader, name: str, case: tuple[Any, ...]) -> None:
    if name.endswith("_async") and case == PRE_AND_ON:
        pytest.skip("upstream tests this case with the sync model only (its TODO)")
    before, _, returned, after, _ = case
    responses = list(load(name).stream(_sender_inputs(*case)))
    # pre_and_on: the returned response errors after the final flag: nothing reaches the
    # client (upstream's test_decoupled_one_response_pre_and_on_return).
    assert _count(responses) == (before, False if case == PRE_AND_ON else returned, after)


@pytest.mark.parametrize("case", [ON_RETURN, ON_AND_POST], ids=["on_return", "on_and_post"])
def test_decoupled_response_returned(
    load: Loader, case: tuple[Any, ...], thread_errors: list[BaseException]
) -> None:
    model = load("response_sender_decoupled")
    with pytest.raises(InferenceError) as info:
        list(model.stream(_sender_inputs(*case)))
    assert "using the decoupled mode and the execute function must return None" in (
        info.value.message()
    )
    if case == ON_AND_POST and not model.isolated:
        _late_send_raised(thread_errors, "Response sender has been closed.")


def test_respond_after_complete_final(
    load: Loader, caplog: pytest.LogCaptureFixture
) -> None:
    """qa response_sender_complete_final_test.py: one response, then the model's second
    send raises "Response sender has been closed." inside the model."""
    input0 = np.array([[123.45]], np.float32)
    with caplog.at_level(logging.INFO, logger="pb_tensor.runtime"):
        responses = list(load("response_sender_complete_final").stream({"INPUT0": input0}))
    assert len(responses) == 1
    assert np.allclose(input0, responses[0]["OUTPUT0"])
    log = caplog.text
    assert "Unexpected request length" not in log
    assert "Expected exception not raised" not in log
    assert "Test FAILED" not in log
    assert "Test Passed" in log


# -- cancellation (qa lifecycle_test.py::test_execute_cancel, decoupled_test.py) -------------------
class _LogWatch(logging.Handler):
    """Sets an event when a record containing ``text`` is emitted."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if self.text in message:
            self.seen.set()


@pytest.fixture
def watch() -> Iterator[Callable[[str], _LogWatch]]:
    logger = logging.getLogger("pb_tensor.runtime")
    made: list[_LogWatch] = []

    def start(text: str) -> _LogWatch:
        handler = _LogWatch(text)
        logger.addHandler(handler)
        made.append(handler)
        return handler

    yield start
    for handler in made:
        logger.removeHandler(handler)


def test_execute_cancel(load: Loader, watch: Callable[[str], _LogWatch]) -> None:
    model = load("execute_cancel")
    running = watch("[execute_cancel] Request not cancelled at 1.0 s")
    cancelled = watch("[execute_cancel] Request cancelled at ")
    future = model.infer_async({"EXECUTE_DELAY": np.array([[4.0]], np.float32)})
    assert running.seen.wait(60), running.messages  # the request is executing
    assert not future.done()
    assert future.cancel()
    with pytest.raises(InferenceError) as info:
        future.result(timeout=0)  # a cancelled request fails at once, as in a client
    assert info.value.code() == TritonError.CANCELLED
    assert info.value.message() == "Locally cancelled by application!"
    assert cancelled.seen.wait(60), cancelled.messages  # the model saw is_cancelled()
    assert not future.cancel()  # done
    # The instance is free again once the model finished the cancelled request.
    with pytest.raises(InferenceError) as info:
        model.infer({"EXECUTE_DELAY": np.array([[0.0]], np.float32)})
    assert info.value.message().endswith("not cancelled")


def test_decoupled_execute_cancel(load: Loader, watch: Callable[[str], _LogWatch]) -> None:
    model = load("execute_cancel_decoupled")
    running = watch("[execute_cancel] Request not cancelled at 1.0 s")
    cancelled = watch("[execute_cancel] Request cancelled at ")
    stream = model.stream({"EXECUTE_DELAY": np.array([[10.0]], np.float32)})
    errors: list[InferenceError] = []

    def read() -> None:
        try:
            for _ in stream:
                pass
        except InferenceError as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert running.seen.wait(60), running.messages
    stream.cancel()  # stop_stream(cancel_requests=True)
    reader.join(60)
    assert not reader.is_alive()
    assert cancelled.seen.is_set() or cancelled.seen.wait(60), cancelled.messages
    assert [e.code() for e in errors] == [TritonError.CANCELLED]


def test_cancel_while_queued_never_runs(load: Loader, watch: Callable[[str], _LogWatch]) -> None:
    """A request cancelled while it waits for the instance fails without reaching the
    model; the running one is unaffected (the queue is the runtime's: one mode suffices)."""
    model = load("execute_cancel")
    if model.isolated:
        pytest.skip("the wait for the instance is the same in both modes")
    started = watch("[execute_cancel] Request not cancelled at 1.0 s")
    first = model.infer_async({"EXECUTE_DELAY": np.array([[2.0]], np.float32)})
    assert started.seen.wait(60), started.messages
    queued = model.infer_async({"EXECUTE_DELAY": np.array([[9.0]], np.float32)})
    assert queued.cancel()
    with pytest.raises(InferenceError) as info:
        first.result(timeout=60)
    assert info.value.message().endswith("not cancelled")
    with pytest.raises(InferenceError) as info:
        queued.result(timeout=0)
    assert info.value.code() == TritonError.CANCELLED
    # Only the first request ran: two seconds, never cancelled.
    assert [m for m in started.messages if "cancelled at" in m] == [
        "[execute_cancel] Request not cancelled at 1.0 s",
        "[execute_cancel] Request not cancelled at 2.0 s",
    ]


def test_infer_async_from_asyncio(load: Loader, watch: Callable[[str], _LogWatch]) -> None:
    """``asyncio.wrap_future``: awaiting gives the outcome; cancelling the awaiting task
    cancels the request in the model."""
    model = load("execute_cancel")
    if model.isolated:
        pytest.skip("test_execute_cancel covers the isolated cancellation path")
    running = watch("[execute_cancel] Request not cancelled at 1.0 s")
    cancelled = watch("[execute_cancel] Request cancelled at ")

    async def main() -> None:
        with pytest.raises(InferenceError) as info:
            await asyncio.wrap_future(
                model.infer_async({"EXECUTE_DELAY": np.array([[0.0]], np.float32)})
            )
        assert info.value.message().endswith("not cancelled")
        task = asyncio.ensure_future(
            asyncio.wrap_future(
                model.infer_async({"EXECUTE_DELAY": np.array([[4.0]], np.float32)})
            )
        )
        while not running.seen.is_set():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), 120))
    assert cancelled.seen.wait(60), cancelled.messages


# -- BLS cancellation (qa decoupled/decoupled_test.py) ---------------------------------------------
def _bls_cancel_inputs(max_sum: int, ignore_cancel: bool) -> dict[str, Any]:
    """``prepare_decoupled_bls_cancel_inputs(input_value=1, ...)``"""
    return {
        "INPUT": np.array([1], dtype=np.int32),
        "MAX_SUM": np.array([max_sum], dtype=np.int32),
        "IGNORE_CANCEL": np.array([ignore_cancel], dtype=np.bool_),
    }


@pytest.mark.parametrize("name", ["decoupled_bls_cancel", "decoupled_bls_async_cancel"])
def test_decoupled_bls_cancel(load: Loader, name: str) -> None:
    """ResponseIterator.cancel() reaches the called model: it sees is_cancelled() and ends
    with a CANCELLED error response (before: 20 responses, never cancelled)."""
    load("response_sender_until_cancelled")
    result = load(name).infer(_bls_cancel_inputs(10, False))
    assert result["IS_CANCELLED"][0], "error: expected the request to be cancelled"
    assert np.array_equal(result["SUM"], np.array([10], dtype=np.int32))


def test_decoupled_bls_ignore_cancel(load: Loader) -> None:
    """Upstream runs both caller models; the callee's side, the one tested here, is the
    same for both (test time)."""
    load("response_sender_until_cancelled")
    result = load("decoupled_bls_cancel").infer(_bls_cancel_inputs(10, True))
    assert not result["IS_CANCELLED"][0], "error: expected the request not being cancelled"
    assert result["SUM"][0] > 10


@pytest.mark.parametrize(("max_sum", "cancelled"), [(10, True), (25, False)],
                         ids=["after_cancellation", "after_completion"])  # fmt: skip
def test_decoupled_bls_cancel_after_complete(load: Loader, max_sum: int, cancelled: bool) -> None:
    load("response_sender_until_cancelled")
    result = load("decoupled_bls_cancel_after_complete").infer(_bls_cancel_inputs(max_sum, False))
    assert bool(result["IS_CANCELLED"][0]) is cancelled
    if cancelled:
        assert np.array_equal(result["SUM"], np.array([max_sum], dtype=np.int32))
    else:
        assert result["SUM"][0] < max_sum


# -- waits the caller can interrupt (issue 18 item 5; the runtime's own model) ---------------------
_UNTIL_CANCELLED = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        sender = requests[0].get_response_sender()
        while not sender.is_cancelled():  # sends nothing until the caller gives up
            time.sleep(0.01)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
_UNTIL_CANCELLED_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: True }
"""


class _Alarm(TimeoutError):
    """What the test's SIGALRM handler raises."""


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_wait_for_responses_is_interruptible(tmp_path: Path, isolated: bool) -> None:
    """A signal handler's exception reaches a caller waiting for a decoupled model's
    responses (no timeout set); the request is cancelled, and the model serves again."""
    import signal

    (tmp_path / "waits" / "1").mkdir(parents=True)
    (tmp_path / "waits" / "1" / "model.py").write_text(_UNTIL_CANCELLED)
    (tmp_path / "waits" / "config.pbtxt").write_text(_UNTIL_CANCELLED_CONFIG)

    def alarm(signum: int, frame: Any) -> None:
        raise _Alarm("alarm")

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        with ModelRepository(tmp_path) as repo, repo.load("waits", isolated=isolated) as model:
            for _ in range(2):
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                with pytest.raises(_Alarm):
                    list(model.stream({"IN": np.array([1], np.int32)}))
            assert model.is_ready()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- BLS request timeout (qa bls model's test_timeout, run by a caller of the runtime's own) -------
_BLS_TIMEOUT_CALLER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """What qa python_models/bls/model.py's test_timeout does, one BLS request per call."""

    def execute(self, requests):
        responses = []
        for request in requests:
            timeout = int(pb_utils.get_input_tensor_by_name(request, "TIMEOUT").as_numpy()[0])
            input0_np = np.random.randn(1, 1024 * 1024)
            input0 = pb_utils.Tensor("INPUT0", input0_np.astype(np.float32))
            infer_request = pb_utils.InferenceRequest(
                model_name="identity_fp32_timeout",
                inputs=[input0],
                requested_output_names=["OUTPUT0"],
                timeout=timeout,
            )
            infer_response = infer_request.exec()
            message = infer_response.error().message() if infer_response.has_error() else ""
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("ERROR", np.array([message.encode()], dtype=np.object_)),
                pb_utils.Tensor(
                    "OUTPUTS", np.array([len(infer_response.output_tensors())], np.int32)
                ),
            ]))
        return responses
'''
_BLS_TIMEOUT_CALLER_CONFIG = """
backend: "python"
input [ { name: "TIMEOUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [
  { name: "ERROR" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "OUTPUTS" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_bls_request_timeout(tmp_path: Path, isolated: bool) -> None:
    """A BLS request's timeout (5 us) expires while it waits for the instance: Triton's
    dynamic batcher rejects it (``default_queue_policy { timeout_action: REJECT
    allow_timeout_override: true }``) with "Request timeout expired" and no outputs
    (before: it ran). The 11 s case of upstream's test (it runs: the 1 s default applies)
    costs the model's 5 s sleep and runs in isolated mode only."""
    repository(tmp_path, {"identity_fp32_timeout": PYTHON_MODELS / "identity_fp32_timeout"})
    (tmp_path / "bls_timeout" / "1").mkdir(parents=True)
    (tmp_path / "bls_timeout" / "1" / "model.py").write_text(_BLS_TIMEOUT_CALLER)
    (tmp_path / "bls_timeout" / "config.pbtxt").write_text(_BLS_TIMEOUT_CALLER_CONFIG)
    with ModelRepository(tmp_path) as repo:
        caller = repo.load("bls_timeout", isolated=isolated, timeout=60)
        result = caller.infer({"TIMEOUT": np.array([5], np.int64)})
        assert "Request timeout expired" in _text(result["ERROR"][0])
        assert result["OUTPUTS"][0] == 0
        if isolated:
            result = caller.infer({"TIMEOUT": np.array([11000000000], np.int64)})
            assert _text(result["ERROR"][0]) == ""
            assert result["OUTPUTS"][0] == 1


# -- a decoupled model streaming BLS responses (qa decoupled_test.py::test_decoupled_bls_stream) ---
def test_decoupled_bls_stream(tmp_path: Path) -> None:
    """decoupled_bls_stream answers each request from a thread it starts, with the
    responses of a decoupled BLS request to square_int32 (laid out as decoupled/test.sh
    does). Isolated only: in-process, a thread the model starts has no BLS (documented)."""
    import shutil

    from upstream_models import EXAMPLES

    repository(tmp_path, {"decoupled_bls_stream": DECOUPLED_MODELS / "decoupled_bls_stream"})
    (tmp_path / "square_int32" / "1").mkdir(parents=True)
    shutil.copy(EXAMPLES / "decoupled" / "square_model.py",
                tmp_path / "square_int32" / "1" / "model.py")  # fmt: skip
    shutil.copy(EXAMPLES / "decoupled" / "square_config.pbtxt",
                tmp_path / "square_int32" / "config.pbtxt")  # fmt: skip
    in_values = [4, 2, 0, 1]
    with ModelRepository(tmp_path) as repo:
        model = repo.load("decoupled_bls_stream", isolated=True, timeout=60)
        for i, value in enumerate(in_values):
            responses = list(
                model.stream({"IN": np.array([value], dtype=np.int32)}, request_id=str(i))
            )
            assert len(responses) == value
            expected = np.array([value], dtype=np.int32)
            for response in responses:
                assert np.array_equal(expected, response["OUT"])
