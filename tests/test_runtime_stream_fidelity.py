"""A request's responses as Triton delivers them, in both modes:

* an error response that does not carry the final flag leaves the request running: the
  stream raises it and goes on with the responses the model sends after it;
* a response sender the model lets go of before the final flag ends its request
  (``ResponseSenderDropped``; python_backend's ``ResponseSender`` destructor deletes the
  response factory, and no final flag ever comes), without a wait and without restarting the
  stub;
* requests refused when they are submitted (``RequestRefused``: invalid for the
  configuration, a full queue, a sequence that did not start) are told apart from errors met
  while running;
* requests queued one after the other from one thread reach the model's queue in that order
  (the dynamic and the sequence batcher), as a Triton stream's requests do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from runtime_models import IDENTITY_CONFIG, STEPS_MODEL, write_model

from pb_tensor.runtime import (
    InferenceError,
    LoadedModel,
    ModelRepository,
    RequestRefused,
    ResponseSenderDropped,
)

_DECOUPLED = 'model_transaction_policy { decoupled: true }\n'

_MODELS: dict[str, tuple[str, str]] = {
    # runtime_models.STEPS_MODEL: IN[0] says what it sends.
    "errors_then_more": (_DECOUPLED, STEPS_MODEL),
    # A non-decoupled model that takes the sender and lets go of it without sending.
    "drops_sender": ("", """
        class TritonPythonModel:
            def execute(self, requests):
                for request in requests:
                    request.get_response_sender()
                return None
    """),
    # Records the order in which its requests arrive, batch by batch.
    "batched": ("max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 300000 "
                "preferred_batch_size: [ 8 ] }\n", """
        class TritonPythonModel:
            def execute(self, requests):
                return [ok(r, np.array([[i, int(value(r)[0][0])]], np.int32))
                        for i, r in enumerate(requests)]
    """),
    # A running sum per sequence: START resets it, each request adds its IN.
    "summing": ("sequence_batching { max_sequence_idle_microseconds: 5000000 control_input [ "
                "{ name: \"START\" control [ { kind: CONTROL_SEQUENCE_START "
                "int32_false_true: [ 0, 1 ] } ] } ] }\n", """
        class TritonPythonModel:
            def initialize(self, args):
                self.total = 0
            def execute(self, requests):
                responses = []
                for request in requests:
                    start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
                    if int(start.flat[0]):
                        self.total = 0
                    self.total += int(value(request).sum())
                    responses.append(ok(request, np.array([self.total], np.int32)))
                return responses
    """),
}


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream_fidelity")
    for name, (extra, code) in _MODELS.items():
        config = IDENTITY_CONFIG
        if name == "batched":  # a batch dimension, then [1]
            config = config.replace("dims: [ -1 ]", "dims: [ 1 ]")
        write_model(root, name, code, config + extra)
    return root


@pytest.fixture(params=[False, True], ids=["in_process", "isolated"])
def repo(request: pytest.FixtureRequest, repo_dir: Path) -> Iterator[tuple[ModelRepository, bool]]:
    with ModelRepository(repo_dir) as r:
        yield r, request.param


def _load(repo: tuple[ModelRepository, bool], name: str) -> LoadedModel:
    r, isolated = repo
    return r.load(name, isolated=isolated, timeout=60)


def _mode(mode: int) -> dict[str, np.ndarray[tuple[int], np.dtype[np.int32]]]:
    return {"IN": np.array([mode], np.int32)}


# -- error responses that are not final ----------------------------------------------------------


def test_the_responses_after_an_error_response_come_too(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "errors_then_more") as model:
        stream = model.stream(_mode(0))
        first = next(stream)
        assert first["OUT"].tolist() == [1]
        assert not first.final
        with pytest.raises(InferenceError) as info:
            next(stream)
        assert type(info.value) is InferenceError
        assert info.value.message() == "bad step"
        assert not stream.finished  # the error did not carry the final flag
        second = next(stream)
        assert second["OUT"].tolist() == [2]
        assert not second.final
        with pytest.raises(StopIteration):
            next(stream)
        assert stream.finished


def test_an_error_response_with_the_final_flag_ends_the_stream(
    repo: tuple[ModelRepository, bool],
) -> None:
    with _load(repo, "errors_then_more") as model:
        stream = model.stream(_mode(2))
        assert next(stream)["OUT"].tolist() == [1]
        with pytest.raises(InferenceError, match=r"^bad step$"):
            next(stream)
        assert stream.finished
        with pytest.raises(StopIteration):
            next(stream)


def test_a_for_loop_ends_at_the_first_error(repo: tuple[ModelRepository, bool]) -> None:
    # As before: a loop that meets the error response leaves; the request is cancelled and
    # drained when the iterator goes.
    with _load(repo, "errors_then_more") as model:
        seen = []

        def loop() -> None:
            for outputs in model.stream(_mode(0)):
                seen.append(outputs["OUT"].tolist())

        with pytest.raises(InferenceError, match=r"^bad step$"):
            loop()
        assert seen == [[1]]
        assert model.infer(_mode(2))["OUT"].tolist() == [1]  # the model serves on


# -- senders the model lets go of ----------------------------------------------------------------


def test_a_dropped_sender_ends_its_request_at_once(
    repo: tuple[ModelRepository, bool], caplog: pytest.LogCaptureFixture
) -> None:
    _, isolated = repo
    with caplog.at_level(logging.WARNING, logger="pb_tensor.runtime"), \
            _load(repo, "errors_then_more") as model:  # fmt: skip
        pids = model.pids
        stream = model.stream(_mode(1))
        assert next(stream)["OUT"].tolist() == [1]
        with pytest.raises(ResponseSenderDropped) as info:
            next(stream)
        assert info.value.message() == (
            f"Failed to process the request(s) for model '{model.instance_name}', message: the "
            "model dropped the request's response sender without sending the final flag "
            "(Triton's client gets no further response and no final flag)")
        assert isinstance(info.value, InferenceError)
        assert stream.finished
        # The instance serves on, in the same stub: nothing waited for the final flag.
        assert next(model.stream(_mode(2)))["OUT"].tolist() == [1]
        assert model.pids == pids
        assert (pids[0] is not None) == isolated
    assert not [r for r in caplog.records if "restarting" in r.getMessage()]


def test_a_dropped_sender_of_a_non_decoupled_model(repo: tuple[ModelRepository, bool]) -> None:
    # execute returned None and its sender is gone: Triton's client would wait forever.
    with _load(repo, "drops_sender") as model:
        with pytest.raises(ResponseSenderDropped):
            model.infer({"IN": np.array([1], np.int32)})
        with pytest.raises(ResponseSenderDropped):
            model.infer_async({"IN": np.array([1], np.int32)}).result(timeout=30)


# -- refusals ------------------------------------------------------------------------------------


def test_refusals_are_told_apart(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "errors_then_more") as model:
        with pytest.raises(RequestRefused) as info:
            next(model.stream({"IN": np.array([1], np.int64)}))
        assert "data-type is 'INT64', but model 'errors_then_more' expects 'INT32'" in (
            info.value.message())
        with pytest.raises(InferenceError) as error:
            list(model.stream(_mode(2)))
        assert not isinstance(error.value, RequestRefused)
    with _load(repo, "summing") as model:
        with pytest.raises(RequestRefused, match="must specify the START flag"):
            model.infer({"IN": np.array([1], np.int32)}, correlation_id=5)
        with pytest.raises(RequestRefused, match="must specify a non-zero or non-empty"):
            model.infer({"IN": np.array([1], np.int32)}, sequence_start=True)


# -- the order of queued requests ----------------------------------------------------------------


def test_queued_requests_keep_the_order_they_were_made_in(
    repo: tuple[ModelRepository, bool],
) -> None:
    # Each request made (not awaited) before the next: one batch, in that order.
    with _load(repo, "batched") as model:
        for make in (model.infer_async, model.stream):
            calls = [make({"IN": np.array([[n]], np.int32)}) for n in range(8)]
            results = [c.result(timeout=30) if hasattr(c, "result") else next(iter(c))
                       for c in calls]  # fmt: skip
            assert [r["OUT"].tolist() for r in results] == [[[i, i]] for i in range(8)]


def test_a_sequence_made_without_waiting_runs_in_order(
    repo: tuple[ModelRepository, bool],
) -> None:
    with _load(repo, "summing") as model:
        for round_ in range(3):
            futures = [
                model.infer_async({"IN": np.array([n], np.int32)}, correlation_id=7 + round_,
                                  sequence_start=n == 0, sequence_end=n == 9)
                for n in range(10)
            ]  # fmt: skip
            totals = [f.result(timeout=30)["OUT"].tolist() for f in futures]
            assert totals == [[sum(range(n + 1))] for n in range(10)]
        streams = [model.stream({"IN": np.array([n], np.int32)}, correlation_id=20,
                                sequence_start=n == 0, sequence_end=n == 4)
                   for n in range(5)]  # fmt: skip
        assert [next(s)["OUT"].tolist() for s in streams] == [[0], [1], [3], [6], [10]]
