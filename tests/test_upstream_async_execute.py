"""``async def execute`` of decoupled models runs concurrently on one instance, as in Triton
(issue 18 item 12), in both modes.

* qa ``L0_backend_python/async_execute/concurrency_test.py`` with its models
  ``async_execute_decouple`` and ``async_execute_decouple_bls`` (laid out as its ``test.sh``
  does): its cases and assertions, with shorter delays and without its wall-clock sleeps; where
  upstream proves overlap by what arrived after a sleep, the ordering of the responses or the
  model's own count of requests in flight proves it here.
* The runtime's own models record how many requests they hold at once (no timing asserted):
  a coroutine ``execute`` and a plain ``execute`` that answers from threads (Triton's instance
  takes its next batch once ``execute`` returned, in both cases); a task that raises fails
  only its own requests; cancelling one request in flight leaves the others; unloading waits
  for the requests in flight.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from upstream_models import PYTHON_MODELS, repository

from pb_tensor.runtime import InferenceError, LoadedModel, ModelRepository, Outputs
from pb_tensor.utils import TritonError

Loader = Callable[[str], LoadedModel]

# Modes of the runtime's own models: wait until WANT requests were in flight at once, then
# answer; wait for the caller's cancellation; or raise after the wait.
GATHER, UNTIL_CANCELLED, RAISE = 0, 1, 2

_COROUTINE = '''
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Each request: a first response, then (at most 10 s) a wait for WANT requests in flight
    at once (or for the caller's cancellation), then the final response; PEAK is the most
    requests this instance held at once."""

    def initialize(self, args):
        self.inflight = 0
        self.peak = 0

    async def execute(self, requests):
        await asyncio.gather(*(self._one(r) for r in requests))
        return None

    def _out(self, shape):
        peak = pb_utils.Tensor("PEAK", np.full(shape, self.peak, np.int32))
        return pb_utils.InferenceResponse([peak])

    async def _one(self, request):
        modes = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()
        mode = int(modes.flatten()[0])
        want = int(pb_utils.get_input_tensor_by_name(request, "WANT").as_numpy().flatten()[0])
        sender = request.get_response_sender()
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        sender.send(self._out(modes.shape))
        try:
            for _ in range(1000):
                if sender.is_cancelled() if mode == 1 else self.peak >= want:
                    break
                await asyncio.sleep(0.01)
        finally:
            self.inflight -= 1
        if mode == 2:
            raise ValueError("raised on purpose")
        sender.send(self._out(modes.shape),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

_THREADS = '''
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """_COROUTINE's model, answering from a thread per request after execute returned."""

    def initialize(self, args):
        self.lock = threading.Lock()
        self.inflight = 0
        self.peak = 0

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._one, args=(request,), daemon=True).start()
        return None

    def _one(self, request):
        want = int(pb_utils.get_input_tensor_by_name(request, "WANT").as_numpy()[0])
        sender = request.get_response_sender()
        with self.lock:
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
        for _ in range(1000):
            if self.peak >= want:
                break
            time.sleep(0.01)
        with self.lock:
            self.inflight -= 1
            peak = self.peak
        out = pb_utils.Tensor("PEAK", np.array([peak], np.int32))
        sender.send(pb_utils.InferenceResponse([out]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

_CONFIG = """
backend: "python"
input [
  { name: "MODE" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "WANT" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [ { name: "PEAK" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: True }
"""
# The same through the dynamic batcher, one request per batch.
_BATCHER_CONFIG = _CONFIG + "max_batch_size: 1\ndynamic_batching { }\n"


@pytest.fixture(scope="module")
def models_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # async_execute/test.sh: both models, as they are.
    root = repository(
        tmp_path_factory.mktemp("async_execute"),
        {
            "async_execute_decouple": PYTHON_MODELS / "async_execute_decouple",
            "async_execute_decouple_bls": PYTHON_MODELS / "async_execute_decouple_bls",
        },
    )
    for name, source, config in (
        ("in_flight", _COROUTINE, _CONFIG),
        ("in_flight_threads", _THREADS, _CONFIG),
        ("in_flight_batcher", _COROUTINE, _BATCHER_CONFIG),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(source)
        (root / name / "config.pbtxt").write_text(config)
    return root


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "isolated"])
def repo(
    request: pytest.FixtureRequest, models_repo: Path
) -> Iterator[tuple[ModelRepository, bool]]:
    with ModelRepository(models_repo) as repo:
        yield repo, bool(request.param)


@pytest.fixture
def load(repo: tuple[ModelRepository, bool]) -> Iterator[Loader]:
    """``load(name)``: a fresh load of the model in this module's mode (instance counters
    start at zero), unloaded after the test."""
    repository_, isolated = repo
    loaded: list[LoadedModel] = []

    def get(name: str) -> LoadedModel:
        model = repository_.load(name, isolated=isolated, timeout=60)
        loaded.append(model)
        return model

    yield get
    for model in loaded:
        model.unload()


def _streams(
    model: LoadedModel, inputs: list[dict[str, Any]]
) -> list[list[Outputs | InferenceError]]:
    """Run each input as a stream of its own, all at once (as the upstream test's
    ``async_stream_infer`` calls); each stream's responses, or the error that ended it."""
    results: list[list[Outputs | InferenceError]] = [[] for _ in inputs]

    def read(i: int) -> None:
        try:
            for response in model.stream(inputs[i]):
                results[i].append(response)
        except InferenceError as exc:
            results[i].append(exc)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return results


def _in_flight(mode: int, want: int, batched: bool = False) -> dict[str, Any]:
    shape = [1, 1] if batched else [1]
    return {"MODE": np.full(shape, mode, np.int32), "WANT": np.full(shape, want, np.int32)}


# -- qa async_execute/concurrency_test.py ----------------------------------------------------------
@pytest.mark.parametrize(("batch_size", "number_of_requests"), [(4, 1), (1, 4)],
                         ids=["single_request", "multi_request"])  # fmt: skip
@pytest.mark.parametrize("model_name", ["async_execute_decouple", "async_execute_decouple_bls"])
def test_concurrent_execute(load: Loader, model_name: str, batch_size: int,
                            number_of_requests: int) -> None:  # fmt: skip
    """``_concurrent_execute_requests``: every request gets its response with its batch
    size and no error (upstream's 4 s delay: 0.3 s; what proves the overlap is
    test_requests_overlap_on_one_instance)."""
    model = load(model_name)  # the BLS model loads async_execute_decouple on first use
    shape = [batch_size, 1]
    inputs = {"WAIT_SECONDS": np.full(shape, 0.3, dtype=np.float32)}
    results = _streams(model, [inputs] * number_of_requests)
    responses = [r for stream in results for r in stream]
    assert len(responses) == number_of_requests
    for res in responses:
        assert isinstance(res, Outputs), res
        assert res["DUMMY_OUT"].shape[0] == batch_size


def test_concurrent_execute_different_duration(load: Loader) -> None:
    """Of two requests on the one instance, the shorter, sent second, answers first
    (upstream: 10 s and 2 s, 2 s apart; here 1 s and 0.1 s, 0.3 s apart). Executed one after
    the other, the first would answer first."""
    model = load("async_execute_decouple")
    order: list[int] = []
    errors: list[BaseException] = []

    def run(delay: float, batch_size: int) -> None:
        # shape[0] tells the requests apart, as upstream's "batch size to track request id"
        try:
            inputs = {"WAIT_SECONDS": np.full([batch_size, 1], delay, dtype=np.float32)}
            for response in model.stream(inputs):
                order.append(response["DUMMY_OUT"].shape[0])
        except BaseException as exc:  # reported below
            errors.append(exc)

    first = threading.Thread(target=run, args=(1.0, 1))
    first.start()
    threading.Event().wait(0.3)  # upstream's gap after each request
    run(0.1, 2)
    first.join(60)
    assert not errors, errors
    assert order == [2, 1]


def test_model_raise_exception(load: Loader, caplog: pytest.LogCaptureFixture) -> None:
    """The coroutine's exception is logged; the model sent the final flag first, so the
    stream just ends."""
    model = load("async_execute_decouple")
    with caplog.at_level(logging.ERROR, logger="pb_tensor.runtime"):
        assert "ValueError: wait_secs cannot be negative" not in caplog.text
        assert list(model.stream({"WAIT_SECONDS": np.full([1, 1], -1, dtype=np.float32)})) == []
        for _ in range(600):  # the log record may follow the final flag (a stub's records
            if "ValueError: wait_secs cannot be negative" in caplog.text:  # come as sent)
                break
            threading.Event().wait(0.05)
    assert "ValueError: wait_secs cannot be negative" in caplog.text


# -- the runtime's own models: what the model itself counts ----------------------------------------
@pytest.mark.parametrize("name", ["in_flight", "in_flight_threads", "in_flight_batcher"])
def test_requests_overlap_on_one_instance(load: Loader, name: str) -> None:
    """Four requests to one instance are all in the model at once: each waits until the
    model held four (before: one at a time, each waited 10 s and saw one), also when the
    dynamic batcher sends them one batch each."""
    model = load(name)
    results = _streams(model, [_in_flight(GATHER, 4, name == "in_flight_batcher")] * 4)
    for stream in results:
        final = stream[-1]
        assert isinstance(final, Outputs), final
        assert final.final
        assert int(final["PEAK"].flatten()[0]) == 4


def test_raising_task_fails_only_its_request(
    load: Loader, caplog: pytest.LogCaptureFixture
) -> None:
    """Of two requests in flight, the one whose coroutine raises ends with that error (the
    traceback is logged, as upstream logs it); the other gets its final response."""
    model = load("in_flight")
    with caplog.at_level(logging.ERROR, logger="pb_tensor.runtime"):
        raised, fine = _streams(model, [_in_flight(RAISE, 2), _in_flight(GATHER, 2)])
        for _ in range(600):  # (a stub's records come as it sends them)
            if "raised on purpose" in caplog.text:
                break
            threading.Event().wait(0.05)
    error = raised[-1]
    assert isinstance(error, InferenceError), raised
    assert error.code() == TritonError.INTERNAL
    assert error.message().startswith(
        "Failed to process the request(s) for model 'in_flight_0', message: "
        "ValueError: raised on purpose"
    )
    assert isinstance(raised[0], Outputs)  # its first response came before
    final = fine[-1]
    assert isinstance(final, Outputs)
    assert final.final
    assert int(final["PEAK"][0]) == 2
    assert "ValueError: raised on purpose" in caplog.text


def test_cancel_one_request_in_flight(load: Loader) -> None:
    """Cancelling one of two requests in flight on one instance reaches that request's
    coroutine only: it fails with CANCELLED, the other ends normally."""
    model = load("in_flight")
    cancelled = model.stream(_in_flight(UNTIL_CANCELLED, 0))
    assert int(next(cancelled)["PEAK"][0]) == 1  # executing
    other = model.stream(_in_flight(GATHER, 2))
    assert int(next(other)["PEAK"][0]) == 2  # both in flight
    cancelled.cancel()
    with pytest.raises(InferenceError) as info:
        next(cancelled)
    assert info.value.code() == TritonError.CANCELLED
    rest = list(other)
    assert len(rest) == 1
    assert rest[0].final
    assert int(rest[0]["PEAK"][0]) == 2


def test_unload_waits_for_requests_in_flight(load: Loader) -> None:
    """Unloading while a coroutine holds a request lets it finish first (Triton keeps the
    model until its response factories are gone), then the model is gone."""
    model = load("in_flight")
    stream = model.stream(_in_flight(UNTIL_CANCELLED, 0))
    assert int(next(stream)["PEAK"][0]) == 1
    unloading = threading.Thread(target=model.unload)
    unloading.start()
    unloading.join(0.3)
    assert unloading.is_alive()  # waiting for the request in flight
    stream.cancel()  # the model's coroutine ends it
    with pytest.raises(InferenceError):
        next(stream)
    unloading.join(60)
    assert not unloading.is_alive()
    assert not model.loaded
