"""The dynamic batcher (``dynamic_batching``): batches formed by Triton's rules (max and
preferred batch sizes, queue delay, shapes), each response to its own caller, queue
policies (REJECT / DELAY timeouts, max_queue_size, priority levels), cancellation while
queued, and the statistics that show the batches."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pb_tensor.runtime import InferenceError, InferFuture, LoadedModel, ModelRepository, Outputs
from pb_tensor.utils import TritonError

_MODEL = '''
import json, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.seq = 0

    def execute(self, requests):
        self.seq += 1
        sleep = json.loads(requests[0].parameters()).get("sleep", 0)
        time.sleep(sleep)
        out = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            rows = value.shape[0]
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", value),
                pb_utils.Tensor("BATCH", np.full((rows, 1), len(requests), np.int32)),
                pb_utils.Tensor("SEQ", np.full((rows, 1), self.seq, np.int32)),
            ]))
        return out
'''


def _load(
    root: Path, batching: str, *, max_batch_size: int = 8, ragged: bool = False,
    isolated: bool = False,
) -> tuple[ModelRepository, LoadedModel]:
    (root / "b" / "1").mkdir(parents=True)
    (root / "b" / "1" / "model.py").write_text(_MODEL)
    rag = " allow_ragged_batch: true" if ragged else ""
    dims = "[ -1 ]" if max_batch_size else "[ -1, -1 ]"
    one = "[ 1 ]" if max_batch_size else "[ -1, 1 ]"
    (root / "b" / "config.pbtxt").write_text(textwrap.dedent(f"""
        backend: "python"
        max_batch_size: {max_batch_size}
        input [ {{ name: "IN" data_type: TYPE_INT32 dims: {dims}{rag} }} ]
        output [
          {{ name: "OUT" data_type: TYPE_INT32 dims: {dims} }},
          {{ name: "BATCH" data_type: TYPE_INT32 dims: {one} }},
          {{ name: "SEQ" data_type: TYPE_INT32 dims: {one} }}
        ]
    """) + batching)
    repo = ModelRepository(root)
    return repo, repo.load("b", isolated=isolated, timeout=60)


def _req(value: int, shape: tuple[int, ...] = (1, 2)) -> dict[str, np.ndarray]:
    return {"IN": np.full(shape, value, np.int32)}


def _check_own(
    results: list[Outputs | InferenceError], shapes: list[tuple[int, ...]]
) -> list[tuple[int, int]]:
    """Each result holds its own request's input; (batch length, execution) of each."""
    seen = []
    for i, (result, shape) in enumerate(zip(results, shapes)):
        assert not isinstance(result, InferenceError), result
        np.testing.assert_array_equal(result["OUT"], np.full(shape, i, np.int32))
        seen.append((int(result["BATCH"][0, 0]), int(result["SEQ"][0, 0])))
    return seen


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_max_batch_size_batches_and_statistics(tmp_path: Path, isolated: bool) -> None:
    """Ten queued requests, max_batch_size 4 (the preferred size Triton fills in): three
    execute calls of 4, 4 and 2 requests, each response to its own request; the statistics
    count 10 inferences in 3 executions."""
    repo, model = _load(tmp_path, "dynamic_batching { }", max_batch_size=4,
                        isolated=isolated)  # fmt: skip
    with repo:
        results = model.infer_many([_req(i) for i in range(10)])
        seen = _check_own(results, [(1, 2)] * 10)
        stats = model.statistics()
    assert seen == [(4, 1)] * 4 + [(4, 2)] * 4 + [(2, 3)] * 2
    assert stats["execution_count"] == 3
    assert stats["inference_count"] == 10
    assert stats["inference_stats"]["success"]["count"] == 10
    assert stats["inference_stats"]["queue"]["count"] == 10
    assert stats["inference_stats"]["fail"]["count"] == 0
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (2, 1), (4, 2)
    ]


def test_batch_size_counts_first_dimension(tmp_path: Path) -> None:
    """Requests of batch size 2 with max_batch_size 4: two requests per execute call;
    inference_count counts batch elements (8), batch_stats the total batch size (4)."""
    repo, model = _load(tmp_path, "dynamic_batching { }", max_batch_size=4)
    with repo:
        results = model.infer_many([_req(i, (2, 2)) for i in range(4)])
        seen = _check_own(results, [(2, 2)] * 4)
        stats = model.statistics()
    assert seen == [(2, 1), (2, 1), (2, 2), (2, 2)]
    assert (stats["inference_count"], stats["execution_count"]) == (8, 2)
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (4, 2)
    ]


def test_preferred_batch_size(tmp_path: Path) -> None:
    """Preferred size 4 of max 8: six queued requests leave as 4, then 2 once the queue
    delay passed."""
    repo, model = _load(tmp_path, """
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 200000 }
""")
    with repo:
        seen = _check_own(model.infer_many([_req(i) for i in range(6)]),
                          [(1, 2)] * 6)  # fmt: skip
    assert seen == [(4, 1)] * 4 + [(2, 2)] * 2


def test_queue_delay_gathers_requests_from_threads(tmp_path: Path) -> None:
    """With a queue delay, requests made one after another from separate callers
    (``infer_async``) wait for each other and run as one batch."""
    repo, model = _load(tmp_path, "dynamic_batching { max_queue_delay_microseconds: 1500000 }")
    with repo:
        futures = [model.infer_async(_req(i)) for i in range(3)]
        seen = _check_own([f.result(30) for f in futures], [(1, 2)] * 3)
    assert seen == [(3, 1)] * 3


def test_concurrent_callers_get_their_own_replies(tmp_path: Path) -> None:
    """Sixteen threads calling in a loop on a stub process: batches run back to back (each
    batch's replies handed over once the next batch left), every caller gets its own
    outputs, each reply names an execution whose size it reports, and the statistics
    count every request once."""
    repo, model = _load(tmp_path, "dynamic_batching { }", isolated=True)
    seen: dict[int, list[tuple[int, int]]] = {}
    wrong: list[tuple[int, object]] = []

    def caller(k: int) -> None:
        for j in range(12):
            value = k * 100 + j
            out = model.infer(_req(value))
            if not np.array_equal(out["OUT"], np.full((1, 2), value, np.int32)):
                wrong.append((value, out["OUT"]))
            seen.setdefault(int(out["SEQ"][0, 0]), []).append((value, int(out["BATCH"][0, 0])))

    with repo:
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = model.statistics()
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert sum(len(v) for v in seen.values()) == 16 * 12
    assert all(size == len(v) for v in seen.values() for _, size in v)
    assert stats["execution_count"] == len(seen)
    assert stats["inference_count"] == 16 * 12
    assert stats["inference_stats"]["success"]["count"] == 16 * 12
    assert sum(b["batch_size"] * b["compute_infer"]["count"]
               for b in stats["batch_stats"]) == 16 * 12  # fmt: skip


@pytest.mark.parametrize("ragged", [False, True], ids=["equal_shapes", "ragged"])
def test_shapes_of_variable_inputs(tmp_path: Path, ragged: bool) -> None:
    """A variable-size input must have the batch's shape: a request of another shape ends
    the batch (and starts the next); with ``allow_ragged_batch`` all run together."""
    repo, model = _load(tmp_path, "dynamic_batching { }", ragged=ragged)
    shapes = [(1, 2), (1, 2), (1, 3), (1, 2)]
    with repo:
        results = model.infer_many([_req(i, s) for i, s in enumerate(shapes)])
        seen = _check_own(results, shapes)
    if ragged:
        assert seen == [(4, 1)] * 4
    else:
        assert seen == [(2, 1), (2, 1), (1, 2), (1, 3)]


def test_without_dynamic_batching_requests_run_alone(tmp_path: Path) -> None:
    """No ``dynamic_batching``: concurrent callers' requests each get an execute call."""
    repo, model = _load(tmp_path, "")
    with repo:
        futures = [model.infer_async(_req(i), parameters={"sleep": 0.05})
                   for i in range(3)]  # fmt: skip
        seen = _check_own([f.result(30) for f in futures], [(1, 2)] * 3)
    assert [b for b, _ in seen] == [1, 1, 1]
    assert sorted(s for _, s in seen) == [1, 2, 3]


def test_max_queue_size_rejects(tmp_path: Path) -> None:
    """Beyond ``max_queue_size`` a request is refused with Triton's error."""
    repo, model = _load(tmp_path, "dynamic_batching { default_queue_policy { max_queue_size: 2 } }",
                        max_batch_size=0)  # fmt: skip
    with repo:
        results = model.infer_many([_req(i) for i in range(4)])
        stats = model.statistics()
    _check_own(results[:2], [(1, 2)] * 2)
    for error in results[2:]:
        assert isinstance(error, InferenceError)
        assert error.message() == "[request id: <id_unknown>] Exceeds maximum queue size"
        assert error.code() == TritonError.UNAVAILABLE
    assert stats["inference_stats"]["fail"]["count"] == 2


@pytest.mark.parametrize("action", ["REJECT", "DELAY"])
def test_queue_timeout(tmp_path: Path, action: str) -> None:
    """A request waiting longer than the policy's timeout behind a 0.4 s execution is
    rejected (``REJECT``: "Request timeout expired") or still runs (``DELAY``)."""
    repo, model = _load(tmp_path, f"""
dynamic_batching {{ default_queue_policy {{
  timeout_action: {action} default_timeout_microseconds: 100000 }} }}
""", max_batch_size=0)  # fmt: skip
    with repo:
        results = model.infer_many([_req(i) for i in range(2)],
                                   parameters={"sleep": 0.4})  # fmt: skip
    _check_own(results[:1], [(1, 2)])
    if action == "DELAY":
        _check_own(results, [(1, 2)] * 2)
    else:
        assert isinstance(results[1], InferenceError)
        assert results[1].message() == "Request timeout expired"
        assert results[1].code() == TritonError.UNAVAILABLE


def test_priority_levels(tmp_path: Path) -> None:
    """With two priority levels, a request of priority 1 queued after one of the default
    level 2 runs first."""
    repo, model = _load(tmp_path, """
dynamic_batching { priority_levels: 2 default_priority_level: 2 }
""", max_batch_size=0)  # fmt: skip
    with repo:
        busy = model.infer_async(_req(0), parameters={"sleep": 1.0})
        time.sleep(0.2)  # let the first request reach the instance
        low = model.infer_async(_req(1))
        high = model.infer_async(_req(2), priority=1)
        order = {k: int(f.result(30)["SEQ"][0, 0]) for k, f in
                 (("busy", busy), ("low", low), ("high", high))}  # fmt: skip
    assert order == {"busy": 1, "high": 2, "low": 3}


def test_cancel_while_queued(tmp_path: Path) -> None:
    """A request cancelled while it waits in the queue never reaches the model."""
    repo, model = _load(tmp_path, "dynamic_batching { }", max_batch_size=0)
    with repo:
        busy = model.infer_async(_req(0), parameters={"sleep": 0.5})
        time.sleep(0.1)
        queued = model.infer_async(_req(1))
        queued.cancel()
        with pytest.raises(InferenceError) as info:
            queued.result(30)
        assert info.value.code() == TritonError.CANCELLED
        busy.result(30)
        stats = model.statistics()
    assert stats["execution_count"] == 1


# -- qa response_sender/response_sender_test.py::test_*_multiple_requests ---------------------
_SENDER_BATCHING = "dynamic_batching { max_queue_delay_microseconds: 500000 }\n"
_DECOUPLED = "model_transaction_policy { decoupled: True }\n"


def _sender_inputs(
    before: int, final_before: bool, returned: bool, after: int, final_after: bool
) -> dict[str, np.ndarray]:
    return {
        "NUMBER_OF_RESPONSE_BEFORE_RETURN": np.array([[before]], np.uint8),
        "SEND_COMPLETE_FINAL_FLAG_BEFORE_RETURN": np.array([[final_before]], bool),
        "RETURN_A_RESPONSE": np.array([[returned]], bool),
        "NUMBER_OF_RESPONSE_AFTER_RETURN": np.array([[after]], np.uint8),
        "SEND_COMPLETE_FINAL_FLAG_AFTER_RETURN": np.array([[final_after]], bool),
    }


def _assert_responses_valid(
    responses: list[Outputs], before: int, returned: bool, after: int
) -> None:
    """Upstream's ``_assert_responses_valid``: responses numbered < 1000 were returned,
    < 2000 sent before returning, < 3000 after."""
    before_count = 0
    response_returned = False
    after_count = 0
    for result in responses:
        result_np = result["INDEX"]
        response_id = result_np.sum() / result_np.shape[0]
        if response_id < 1000:
            assert not response_returned, "Expect at most one response returned per request."
            response_returned = True
        elif response_id < 2000:
            before_count += 1
        elif response_id < 3000:
            after_count += 1
        else:
            raise ValueError(f"Unexpected response_id: {response_id}")
    assert before == before_count
    assert returned == response_returned
    assert after == after_count


def _parallel(model: LoadedModel, inputs: list[dict[str, np.ndarray]]) -> list[Outputs]:
    """Every request's responses, the requests made at once (one stream each, as a gRPC
    stream's ``async_stream_infer`` sends them)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
        streams = list(pool.map(lambda x: list(model.stream(x)), inputs))
    return [r for responses in streams for r in responses]


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
@pytest.mark.parametrize("decoupled", [False, True], ids=["non_decoupled", "decoupled"])
def test_upstream_response_sender_multiple_requests(
    tmp_path: Path, isolated: bool, decoupled: bool
) -> None:
    """qa response_sender's ``test_decoupled_multiple_requests`` and
    ``test_non_decoupled_multiple_requests``: the requests, each answering differently,
    reach the batching models (``response_sender[_decoupled][_async]_batching``, laid out
    as response_sender/test.sh does) together; upstream's assertions on all responses."""
    from upstream_models import PYTHON_MODELS, repository

    sender = PYTHON_MODELS / "response_sender"
    suffix = _DECOUPLED if decoupled else ""
    names = [f"response_sender{'_decoupled' if decoupled else ''}{a}_batching"
             for a in ("", "_async")]  # fmt: skip
    repository(
        tmp_path, {name: sender for name in names},
        model_file={names[1]: "model_async.py"},
        config_edit={name: (lambda t: t + suffix + _SENDER_BATCHING) for name in names},
    )  # fmt: skip
    if decoupled:
        parallel_inputs = [_sender_inputs(*p) for p in (
            (0, True, False, 0, False), (0, False, False, 0, True), (1, True, False, 0, False),
            (0, False, False, 1, True), (2, True, False, 0, False), (0, False, False, 2, True),
            (1, False, False, 3, True),
        )]  # fmt: skip
        expected = (4, False, 6)
    else:
        parallel_inputs = [_sender_inputs(*p) for p in (
            (0, False, True, 0, False), (1, True, False, 0, False), (0, False, False, 1, True),
        )]  # fmt: skip
        expected = (1, True, 1)
    with ModelRepository(tmp_path) as repo:
        for name in names:
            model = repo.load(name, isolated=isolated, timeout=60)
            _assert_responses_valid(_parallel(model, parallel_inputs), *expected)
            assert model.statistics()["execution_count"] < len(parallel_inputs)


@pytest.mark.parametrize(("batching", "isolated"), [("dynamic_batching { }", False), ("", True)],
                         ids=["dynamic_batcher", "stub_default_queue"])
def test_unload_fails_queued_requests(tmp_path: Path, batching: str, isolated: bool) -> None:
    """Unloading waits for the running batch; requests still queued (in the dynamic
    batcher's queue, or a stub model's default one) fail with Triton's unknown-model
    error."""
    repo, model = _load(tmp_path, batching, max_batch_size=0, isolated=isolated)
    with repo:
        busy = model.infer_async(_req(0), parameters={"sleep": 0.5})
        time.sleep(0.1)
        queued = [model.infer_async(_req(i)) for i in (1, 2)]
        time.sleep(0.1)
        model.unload()
        _check_own([busy.result(30)], [(1, 2)])
        for future in queued:
            with pytest.raises(InferenceError) as info:
                future.result(30)
            assert info.value.message() == "Request for unknown model: 'b' is not found"
        assert not model.loaded


# -- the default scheduler's queue (no dynamic_batching) of a stub model ----------------------
def _completed_by(future: InferFuture) -> list[str]:
    """The name of the thread that will complete ``future`` (a quick callback runs there)."""
    names: list[str] = []
    future.add_done_callback(lambda _: names.append(threading.current_thread().name),
                             quick=True)  # fmt: skip
    return names


def test_stub_model_without_batcher_takes_queued_requests_one_at_a_time(
    tmp_path: Path,
) -> None:
    """Without ``dynamic_batching``, requests queued behind a running one (infer_async
    queues each before it returns) each get an execute call of their own, in the order
    they were queued (Triton's default scheduler); a blocking caller's request joins the
    same queue; the statistics count one execution per inference, each with its queue
    time."""
    repo, model = _load(tmp_path, "", isolated=True)
    with repo:
        futures = [model.infer_async(_req(0), parameters={"sleep": 0.3})]
        futures += [model.infer_async(_req(i)) for i in range(1, 7)]
        last = model.infer(_req(7))  # queued behind the others: they all ran before it
        seen = _check_own([f.result(30) for f in futures] + [last], [(1, 2)] * 8)
        stats = model.statistics()
    assert [b for b, _ in seen] == [1] * 8
    assert [s for _, s in seen] == list(range(1, 9))  # first come, first served
    assert stats["execution_count"] == stats["inference_count"] == 8
    assert stats["inference_stats"]["queue"]["count"] == 8
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (1, 8)
    ]


@pytest.mark.parametrize("batching", ["", "dynamic_batching { }"], ids=["default", "dynamic"])
def test_infer_async_of_a_queued_request_waits_in_no_thread(
    tmp_path: Path, batching: str
) -> None:
    """``infer_async`` of a request that joins a queue (a stub model's, with or without a
    dynamic batcher) starts no background thread: the instance's thread completes the
    future when the request's batch ends."""
    repo, model = _load(tmp_path, batching, isolated=True)
    with repo:
        futures = [model.infer_async(_req(i), parameters={"sleep": 0.2}) for i in range(3)]
        completed = [_completed_by(f) for f in futures]
        _check_own([f.result(30) for f in futures], [(1, 2)] * 3)
    assert completed == [["pb-tensor-batch-b_0"]] * 3


def test_infer_async_of_an_in_process_model_runs_in_a_background_thread(
    tmp_path: Path,
) -> None:
    """An in-process model's request (no queue) runs in a background thread of its own."""
    repo, model = _load(tmp_path, "")
    with repo:
        future = model.infer_async(_req(5), parameters={"sleep": 0.3})
        completed = _completed_by(future)
        np.testing.assert_array_equal(future.result(30)["OUT"], np.full((1, 2), 5, np.int32))
    assert completed == ["pb-tensor-infer-b"]


def _engine_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that run each batch on a stub (send it, read its replies),
    in order, from now on."""
    from pb_tensor.runtime._engines import StubEngine

    threads: list[str] = []
    run = StubEngine.run

    def recording(self: StubEngine, *args: object, **kwargs: object) -> object:
        threads.append(threading.current_thread().name)
        return run(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StubEngine, "run", recording)
    return threads


def _first_through_the_queue(model: LoadedModel) -> Outputs:
    """The outputs of a first request, which starts the queue's thread (the dynamic
    batcher's, else a stub model's default queue), once that thread waits for requests."""
    first = model.infer(_req(0))
    scheduler = model._scheduler
    assert scheduler is not None
    queue = scheduler.batcher or scheduler.solo
    assert queue is not None
    deadline = time.monotonic() + 30
    while not queue._waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    return first


@pytest.mark.parametrize("batching", ["", "dynamic_batching { }"], ids=["default", "dynamic"])
def test_a_lone_callers_request_runs_in_its_own_thread(
    tmp_path: Path, batching: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking caller whose request finds the queue empty and the instance idle sends it
    to the stub and reads the reply in its own thread (no hand-over to the instance's
    thread and back); its statistics are a queued request's."""
    threads = _engine_threads(monkeypatch)
    repo, model = _load(tmp_path, batching, isolated=True)
    with repo:
        # The first request goes through the queue's thread, which hands it to the
        # instance's; the others come once that thread waits for requests.
        results = [_first_through_the_queue(model)]
        results += [model.infer(_req(i)) for i in range(1, 5)]
        seen = _check_own(results, [(1, 2)] * 5)
        stats = model.statistics()
    assert seen == [(1, s) for s in range(1, 6)]
    assert threads == ["pb-tensor-batch-b_0"] + [threading.current_thread().name] * 4
    assert stats["execution_count"] == stats["inference_count"] == 5
    assert stats["inference_stats"]["queue"]["count"] == 5


def test_requests_queued_behind_a_lone_caller_go_to_the_instances_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests queued while a caller runs its own request in its thread run after it, in
    order, in the instance's thread (the caller hands the instance over and returns)."""
    threads = _engine_threads(monkeypatch)
    repo, model = _load(tmp_path, "", isolated=True)
    with repo:
        first = _first_through_the_queue(model)
        results: list[Outputs] = []
        caller = threading.Thread(
            target=lambda: results.append(model.infer(_req(1), parameters={"sleep": 0.5})),
            name="lone-caller",
        )
        caller.start()
        deadline = time.monotonic() + 30
        while len(threads) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        futures = [model.infer_async(_req(i)) for i in range(2, 5)]
        completed = [_completed_by(f) for f in futures]
        caller.join(30)
        seen = _check_own([first, *results, *(f.result(30) for f in futures)], [(1, 2)] * 5)
    assert threads == ["pb-tensor-batch-b_0", "lone-caller", *["pb-tensor-batch-b_0"] * 3]
    assert seen == [(1, s) for s in range(1, 6)]
    assert completed == [["pb-tensor-batch-b_0"]] * 3


def test_a_lone_caller_that_handed_its_instance_over_queues_its_next_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that ran its own request and handed the instance to the instance's thread
    (a request was queued meanwhile) no longer owns it: its next request joins the queue
    at once, while the queued request runs, instead of being taken for a request made
    while the caller still uses the instance (held back until the instance is released or
    the self-wait grace period, long here, ends)."""
    from pb_tensor.runtime._scheduling import _instances
    from pb_tensor.runtime._scheduling._batcher import DynamicBatcher

    monkeypatch.setattr(_instances, "_SELF_WAIT_GRACE", 60.0)
    # In order: each request queued and each batch ended, with the thread that did it. The
    # instance's thread starts each batch 0.1 s late (before it records itself as the
    # instance's user), so that the caller's next request surely comes while the instance
    # is between threads: the case under test, not a race the test may lose.
    events: list[tuple[str, str]] = []
    enqueue, execute = DynamicBatcher._enqueue, DynamicBatcher._execute

    def queued(self: DynamicBatcher, *args: Any) -> Any:
        events.append(("queued", threading.current_thread().name))
        return enqueue(self, *args)

    def late(self: DynamicBatcher, *args: Any) -> bool:
        if threading.current_thread().name.startswith("pb-tensor-batch-"):
            time.sleep(0.1)
        try:
            return execute(self, *args)
        finally:
            events.append(("ended", threading.current_thread().name))

    monkeypatch.setattr(DynamicBatcher, "_enqueue", queued)
    monkeypatch.setattr(DynamicBatcher, "_execute", late)
    threads = _engine_threads(monkeypatch)
    repo, model = _load(tmp_path, "", isolated=True)
    with repo:
        first = _first_through_the_queue(model)
        results: list[Outputs | InferenceError] = []

        def caller() -> None:
            results.append(model.infer(_req(1), parameters={"sleep": 0.3}))
            try:  # at once, while the queued request runs in the instance's thread
                results.append(model.infer(_req(3)))
            except InferenceError as exc:
                results.append(exc)

        thread = threading.Thread(target=caller, name="lone-caller")
        thread.start()
        deadline = time.monotonic() + 30
        while len(threads) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        queued = model.infer_async(_req(2), parameters={"sleep": 0.5})
        thread.join(90)
        assert not isinstance(results[-1], InferenceError), results[-1]
        seen = _check_own([first, results[0], queued.result(30), results[1]], [(1, 2)] * 4)
    assert seen == [(1, s) for s in range(1, 5)]  # the next request ran after the queued one
    assert threads == ["pb-tensor-batch-b_0", "lone-caller", "pb-tensor-batch-b_0",
                       "pb-tensor-batch-b_0"]  # fmt: skip
    main, instance = threading.current_thread().name, "pb-tensor-batch-b_0"
    assert events == [
        ("queued", main), ("ended", instance),  # the first request
        ("queued", "lone-caller"), ("queued", main),  # its own request; the queued one
        ("ended", "lone-caller"),  # its own request ran in its thread
        ("queued", "lone-caller"),  # its next request: queued at once
        ("ended", instance), ("ended", instance),  # the queued request, then its next one
    ]


def test_stub_model_without_batcher_infer_many_is_one_execute(tmp_path: Path) -> None:
    """``infer_many`` without ``dynamic_batching`` still hands its requests to the model in
    one execute call, with a stub process as in-process."""
    repo, model = _load(tmp_path, "", isolated=True)
    with repo:
        seen = _check_own(model.infer_many([_req(i) for i in range(3)]), [(1, 2)] * 3)
    assert seen == [(3, 1)] * 3


def test_stub_model_without_batcher_cancel_while_queued(tmp_path: Path) -> None:
    """In a stub model's default queue, a cancelled request never reaches the model
    (Triton's CANCELLED error); the one queued behind it runs next."""
    repo, model = _load(tmp_path, "", isolated=True)
    with repo:
        busy = model.infer_async(_req(0), parameters={"sleep": 0.5})
        time.sleep(0.1)
        cancelled = model.infer_async(_req(1))
        after = model.infer_async(_req(2))
        assert cancelled.cancel()
        with pytest.raises(InferenceError) as info:
            cancelled.result(30)
        assert info.value.code() == TritonError.CANCELLED
        first, second = busy.result(30), after.result(30)
        stats = model.statistics()
    np.testing.assert_array_equal(second["OUT"], np.full((1, 2), 2, np.int32))
    assert (int(first["SEQ"][0, 0]), int(second["SEQ"][0, 0])) == (1, 2)
    assert stats["execution_count"] == 2


@pytest.mark.parametrize("batching", ["", "dynamic_batching { }"], ids=["default", "dynamic"])
def test_done_callback_of_a_queued_request_may_call_the_model(
    tmp_path: Path, batching: str
) -> None:
    """A queued request's future is completed by the instance's thread, but its done
    callbacks run in a worker thread: one may block, or make a request of the same
    one-instance model, which then runs instead of being refused or waiting on itself."""
    repo, model = _load(tmp_path, batching, isolated=True)
    with repo:
        got: list[object] = []
        done = threading.Event()

        def callback(future: object) -> None:
            try:
                got.append(threading.current_thread().name)
                got.append(int(model.infer(_req(7))["OUT"][0, 0]))
            except Exception as exc:  # (the assertion below shows it)
                got.append(exc)
            done.set()

        future = model.infer_async(_req(1), parameters={"sleep": 0.2})
        future.add_done_callback(callback)
        assert done.wait(30)
        assert got == ["pb-tensor-callback", 7]
        np.testing.assert_array_equal(future.result(30)["OUT"], np.full((1, 2), 1, np.int32))
