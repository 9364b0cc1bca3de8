"""The sequence batcher (``sequence_batching``): correlation ids route a sequence to one
instance's slot, the configured control inputs (START, END, READY, CORRID) reach the model,
Direct and Oldest strategies, the backlog, idle sequences, Triton's errors; and request
rescheduling (``set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)``) for iterative
sequences, with upstream's qa models (``sequence_py``, ``iterative_sequence``,
``request_rescheduling_addsub``, ``wrong_return_type``) and their assertions."""

from __future__ import annotations

import json
import logging
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from upstream_models import PYTHON_MODELS, repository

from pb_tensor.runtime import InferenceError, LoadedModel, ModelRepository, Outputs
from pb_tensor.runtime._scheduling._sequence import SequenceBatcher
from pb_tensor.utils import TritonError

_MODEL = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

CONTROLS = ("START", "END", "READY", "CORRID")

class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]
        self.sums = {}
        self.calls = 0

    def execute(self, requests):
        self.calls += 1
        out = []
        ready = [pb_utils.get_input_tensor_by_name(r, "READY") for r in requests]
        ready = [None if t is None else bool(t.as_numpy().reshape(-1)[0]) for t in ready]
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            cid = request.correlation_id()
            self.sums[cid] = self.sums.get(cid, 0) + int(value.reshape(-1)[0])
            controls = {}
            for name in CONTROLS:
                t = pb_utils.get_input_tensor_by_name(request, name)
                if t is not None:
                    a = t.as_numpy()
                    values = [v.decode() if isinstance(v, bytes) else v.item()
                              for v in a.reshape(-1)]
                    controls[name] = [str(a.dtype), list(a.shape), values]
            info = json.dumps({"instance": self.instance, "controls": controls,
                               "flags": request.flags(), "cid": cid,
                               "batch": len(requests), "call": self.calls,
                               "ready": ready})
            shape = value.shape
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.full(shape, self.sums[cid], np.int32)),
                pb_utils.Tensor("INFO", np.full(shape, info, dtype=np.object_)),
            ]))
        return out
'''


def _load(
    root: Path, sequence: str, *, max_batch_size: int = 0, count: int = 1,
    isolated: bool = False, dims: str = "[ 1 ]",
) -> tuple[ModelRepository, LoadedModel]:  # fmt: skip
    (root / "s" / "1").mkdir(parents=True)
    (root / "s" / "1" / "model.py").write_text(_MODEL)
    (root / "s" / "config.pbtxt").write_text(textwrap.dedent(f"""
        backend: "python"
        max_batch_size: {max_batch_size}
        input [ {{ name: "IN" data_type: TYPE_INT32 dims: {dims} }} ]
        output [
          {{ name: "SUM" data_type: TYPE_INT32 dims: {dims} }},
          {{ name: "INFO" data_type: TYPE_STRING dims: {dims} }}
        ]
        instance_group [ {{ count: {count} kind: KIND_CPU }} ]
    """) + sequence)
    repo = ModelRepository(root)
    return repo, repo.load("s", isolated=isolated, timeout=60)


def _x(value: int, batching: bool = False) -> dict[str, np.ndarray]:
    return {"IN": np.full((1, 1) if batching else (1,), value, np.int32)}


def _info(result: Outputs) -> dict[str, object]:
    raw = result["INFO"].reshape(-1)[0]
    info: dict[str, object] = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return info


def _sum(result: Outputs) -> int:
    return int(result["SUM"].reshape(-1)[0])


_CONTROLS = """
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: %s } ] }
  ]
}
"""


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_control_inputs_follow_the_configuration(tmp_path: Path, isolated: bool) -> None:
    """START / END / READY / CORRID inputs with the configured types and values, shape
    [1, 1] for a batching model; the model sees the request's flags and correlation id."""
    repo, model = _load(tmp_path, _CONTROLS % "TYPE_UINT64", max_batch_size=2,
                        isolated=isolated)  # fmt: skip
    with repo:
        first = model.infer(_x(1, True), correlation_id=7, sequence_start=True)
        middle = model.infer(_x(2, True), correlation_id=7)
        last = model.infer(_x(3, True), correlation_id=7, sequence_end=True)
    assert [_sum(r) for r in (first, middle, last)] == [1, 3, 6]
    infos = [_info(r) for r in (first, middle, last)]
    assert [i["flags"] for i in infos] == [1, 0, 2]
    assert [i["cid"] for i in infos] == [7, 7, 7]
    assert [i["controls"] for i in infos] == [
        {"START": ["int32", [1, 1], [start]], "END": ["float32", [1, 1], [end]],
         "READY": ["bool", [1, 1], [True]], "CORRID": ["uint64", [1, 1], [7]]}
        for start, end in ((1, 0.0), (0, 0.0), (0, 1.0))
    ]  # fmt: skip


def test_string_correlation_id(tmp_path: Path) -> None:
    """A TYPE_STRING CORRID carries a string correlation id (shape [1] without batching);
    an integer id is refused with Triton's message, as is a string id for an integer
    CORRID."""
    repo, model = _load(tmp_path, _CONTROLS % "TYPE_STRING")
    with repo:
        result = model.infer(_x(4), correlation_id="seq-a", flags=3)
        with pytest.raises(InferenceError) as info:
            model.infer(_x(4), correlation_id=5, sequence_start=True, request_id="r1")
    assert _info(result)["controls"]["CORRID"] == ["object", [1], ["seq-a"]]  # type: ignore[index]
    assert _info(result)["cid"] == "seq-a"
    assert info.value.message() == (
        "[request id: r1] sequence batching control 'CORRID' data-type is 'UINT64', but "
        "model 's' expects 'BYTES'"
    )
    assert info.value.code() == TritonError.INVALID_ARG


def test_errors_have_tritons_messages(tmp_path: Path) -> None:
    """No correlation id, no START for an unknown sequence, a batch of two, and a string
    id longer than 128 characters: Triton's errors."""
    repo, model = _load(tmp_path, "sequence_batching { }", max_batch_size=4)
    with repo:
        errors = []
        for inputs, kwargs in (
            (_x(1, True), {}),
            (_x(1, True), {"correlation_id": 9}),
            ({"IN": np.ones((2, 1), np.int32)}, {"correlation_id": 9, "sequence_start": True}),
            (_x(1, True), {"correlation_id": "x" * 129, "sequence_start": True}),
        ):
            with pytest.raises(InferenceError) as info:
                model.infer(inputs, **kwargs)  # type: ignore[arg-type]
            errors.append((info.value.code(), info.value.message()))
        ok = model.infer(_x(1, True), correlation_id="x" * 128, sequence_start=True)
    assert errors == [
        (TritonError.INVALID_ARG, "inference request to model 's' must specify a non-zero "
         "or non-empty correlation ID"),
        (TritonError.INVALID_ARG, "inference request for sequence 9 to model 's' must "
         "specify the START flag on the first request of the sequence"),
        (TritonError.INVALID_ARG, "inference request to model 's' must specify batch-size 1 "
         "due to requirements of sequence batcher"),
        (TritonError.UNSUPPORTED, "string correlation ID cannot be longer than 128 "
         "characters"),
    ]  # fmt: skip
    assert _sum(ok) == 1


def test_sequences_stay_on_their_instance(tmp_path: Path) -> None:
    """Two instances of one slot each (Direct, no batching): two interleaved sequences each
    run every request on their own instance, their state kept apart."""
    repo, model = _load(tmp_path, "sequence_batching { }", count=2)
    with repo:
        results: dict[int, list[Outputs]] = {1: [], 2: []}
        for step, flags in enumerate((1, 0, 2)):
            for cid in (1, 2):
                results[cid].append(model.infer(_x(cid * 10 + step), correlation_id=cid,
                                                flags=flags))  # fmt: skip
    instances = {cid: {_info(r)["instance"] for r in rs} for cid, rs in results.items()}
    assert instances == {1: {"s_0_0"}, 2: {"s_0_1"}}
    assert [_sum(r) for r in results[1]] == [10, 21, 33]
    assert [_sum(r) for r in results[2]] == [20, 41, 63]


def test_backlog_waits_for_a_free_slot(tmp_path: Path) -> None:
    """One instance with one slot: a second sequence's START waits in the backlog until the
    first sequence ended, then runs."""
    repo, model = _load(tmp_path, "sequence_batching { }")
    with repo:
        model.infer(_x(1), correlation_id=1, sequence_start=True)
        waiting = model.infer_async(_x(5), correlation_id=2, sequence_start=True)
        mid = model.infer(_x(2), correlation_id=1)
        end = model.infer(_x(3), correlation_id=1, sequence_end=True)
        second = waiting.result(30)
    assert (_sum(mid), _sum(end), _sum(second)) == (3, 6, 5)
    assert _info(second)["call"] == _info(end)["call"] + 1  # type: ignore[operator]


def test_direct_keeps_slot_positions_with_null_requests(tmp_path: Path) -> None:
    """Direct, two slots on one instance: the second sequence's requests run at index 1
    of their batch, behind a null request (READY false, correlation id 0) in the empty
    slot 0, as Triton's Direct batcher pads them; the null request answers nobody."""
    repo, model = _load(tmp_path, _CONTROLS % "TYPE_UINT64", max_batch_size=2)
    with repo:
        model.infer(_x(1, True), correlation_id=1, sequence_start=True)
        model.infer(_x(2, True), correlation_id=2, sequence_start=True)
        model.infer(_x(3, True), correlation_id=1, sequence_end=True)
        second = model.infer(_x(4, True), correlation_id=2, sequence_end=True)
        stats = model.statistics()
    info = _info(second)
    assert (info["batch"], info["ready"], _sum(second)) == (2, [False, True], 6)
    assert (stats["execution_count"], stats["inference_count"]) == (4, 4)


def test_oldest_batches_across_sequences(tmp_path: Path) -> None:
    """Oldest strategy: four sequences' requests leave together (max_batch_size 4), one
    request per sequence per batch; two requests of one sequence never share a batch."""
    repo, model = _load(tmp_path, """
sequence_batching {
  oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 3000000 }
}
""", max_batch_size=4)  # fmt: skip
    with repo:
        starts = [model.infer_async(_x(c, True), correlation_id=c, sequence_start=True)
                  for c in range(1, 5)]  # fmt: skip
        first = [f.result(30) for f in starts]
        ends = [model.infer_async(_x(10, True), correlation_id=c, sequence_end=True)
                for c in range(1, 5)]  # fmt: skip
        second = [f.result(30) for f in ends]
        stats = model.statistics()
    assert [_info(r)["batch"] for r in first + second] == [4] * 8
    assert [_sum(r) for r in second] == [11, 12, 13, 14]
    assert (stats["execution_count"], stats["inference_count"]) == (2, 8)


_DELAY = "max_queue_delay_microseconds: 500000"


@pytest.mark.parametrize("strategy", [
    f"oldest {{ max_candidate_sequences: 2 {_DELAY} }}",
    f"direct {{ minimum_slot_utilization: 1.0 {_DELAY} }}",
], ids=["oldest", "direct"])  # fmt: skip
def test_batches_hold_requests_of_one_shape(tmp_path: Path, strategy: str) -> None:
    """A variable-size input (not ragged), both requests queued before the delay ends:
    a request of another shape than the batch's first waits for a later batch (Oldest),
    or leaves its slot to a null request (Direct)."""
    idle = "max_sequence_idle_microseconds: 10000000"
    repo, model = _load(tmp_path, f"sequence_batching {{ {strategy} {idle} }}", max_batch_size=2,
                        dims="[ -1 ]")  # fmt: skip
    with repo:
        model.infer({"IN": np.ones((1, 2), np.int32)}, correlation_id=1, sequence_start=True)
        model.infer({"IN": np.ones((1, 3), np.int32)}, correlation_id=2, sequence_start=True)
        first = model.infer_async({"IN": np.ones((1, 2), np.int32)}, correlation_id=1)
        other = model.infer_async({"IN": np.ones((1, 3), np.int32)}, correlation_id=2)
        results = [first.result(30), other.result(30)]
    infos = [_info(r) for r in results]
    assert infos[0]["call"] != infos[1]["call"]
    assert [r["SUM"].shape for r in results] == [(1, 2), (1, 3)]
    if strategy.startswith("direct"):
        assert [i["batch"] for i in infos] == [1, 2]  # slot 0 padded
    else:
        assert [i["batch"] for i in infos] == [1, 1]


def test_one_request_per_sequence_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Two requests of one sequence queued together run in two execute calls, in order."""
    repo, model = _load(tmp_path, """
sequence_batching { oldest { max_candidate_sequences: 2 max_queue_delay_microseconds: 500000 } }
""", max_batch_size=4)  # fmt: skip
    # infer_async runs each call on a worker thread of its own, so two calls do not reach the
    # batcher in the order they were made (nor do two concurrent requests in Triton): the END
    # request is made once the START one is in its sequence's queue.
    queued = threading.Event()
    enqueue = SequenceBatcher._enqueue

    def _observed(self: SequenceBatcher, entry: Any) -> InferenceError | None:
        refusal = enqueue(self, entry)
        queued.set()
        return refusal

    monkeypatch.setattr(SequenceBatcher, "_enqueue", _observed)
    with repo:
        a = model.infer_async(_x(1, True), correlation_id=3, sequence_start=True)
        assert queued.wait(30)
        b = model.infer_async(_x(2, True), correlation_id=3, sequence_end=True)
        results = [a.result(30), b.result(30)]
    assert [_sum(r) for r in results] == [1, 3]
    assert [_info(r)["batch"] for r in results] == [1, 1]
    assert [_info(r)["call"] for r in results] == [1, 2]


def test_cancelled_request_ends_its_sequence(tmp_path: Path) -> None:
    """A sequence whose waiting request is cancelled ends (Triton releases its slot): the
    caller gets CANCELLED, the sequence's next request without START is refused, and the
    slot serves a new sequence."""
    repo, model = _load(tmp_path, "sequence_batching { }")
    with repo:
        model.infer(_x(1), correlation_id=1, sequence_start=True)
        waiting = model.infer_async(_x(5), correlation_id=2, sequence_start=True)
        assert waiting.cancel()
        with pytest.raises(InferenceError) as info:
            waiting.result(30)
        assert info.value.code() == TritonError.CANCELLED
        with pytest.raises(InferenceError, match="sequence 2 to model 's' must specify the START"):
            model.infer(_x(1), correlation_id=2)
        assert _sum(model.infer(_x(2), correlation_id=1, sequence_end=True)) == 3
        third = model.infer(_x(7), correlation_id=3, sequence_start=True, sequence_end=True)
    assert (_sum(third), _info(third)["call"]) == (7, 3)


_BLS_TIMEOUT = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        bls = pb_utils.InferenceRequest(
            model_name="s", inputs=[pb_utils.Tensor("IN", np.array([1], np.int32))],
            requested_output_names=["SUM"], correlation_id=2,
            flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, timeout=200000)
        response = bls.exec()
        text = response.error().message() if response.has_error() else "ok"
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("TEXT", np.array([text], dtype=np.object_))])]
'''


def test_backlog_timeout(tmp_path: Path) -> None:
    """A request with a timeout (a BLS request's ``timeout``, in microseconds) whose
    sequence waits in the backlog past it fails with Triton's message."""
    repo, model = _load(tmp_path, "sequence_batching { }")
    (tmp_path / "caller" / "1").mkdir(parents=True)
    (tmp_path / "caller" / "1" / "model.py").write_text(_BLS_TIMEOUT)
    (tmp_path / "caller" / "config.pbtxt").write_text(
        'backend: "python"\n'
        'output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
    )
    with repo:
        model.infer(_x(1), correlation_id=1, sequence_start=True)
        caller = repo.load("caller", isolated=False, timeout=60)
        text = caller.infer({})["TEXT"][0]
        assert _sum(model.infer(_x(2), correlation_id=1, sequence_end=True)) == 3
    assert text == b"timeout of the corresponding sequence has been expired"


def test_idle_sequence_loses_its_slot(tmp_path: Path) -> None:
    """A sequence idle longer than max_sequence_idle_microseconds is released: its next
    request without START is refused, and its slot serves a new sequence."""
    repo, model = _load(tmp_path, "sequence_batching { max_sequence_idle_microseconds: 100000 }")
    with repo:
        model.infer(_x(1), correlation_id=1, sequence_start=True)
        time.sleep(0.3)
        with pytest.raises(InferenceError, match="must specify the START flag"):
            model.infer(_x(1), correlation_id=1)
        assert _sum(model.infer(_x(4), correlation_id=2, sequence_start=True)) == 4


def test_start_of_a_running_sequence_continues_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new START for a running sequence continues in its slot, with Triton's warning."""
    repo, model = _load(tmp_path, "sequence_batching { }")
    with repo, caplog.at_level(logging.WARNING, logger="pb_tensor.runtime"):
        model.infer(_x(1), correlation_id=4, sequence_start=True)
        again = model.infer(_x(2), correlation_id=4, sequence_start=True)
    assert _info(again)["instance"] == "s_0_0"
    assert "sequence 4 for model 's' has a conflict. The previous sequence did not end " \
        "before this sequence start. Previous sequence will be terminated early." in caplog.text


# -- upstream's models ---------------------------------------------------------------------
def _upstream(tmp_path: Path, *names: str) -> ModelRepository:
    return ModelRepository(repository(tmp_path, {n: PYTHON_MODELS / n for n in names}))


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_iterative_sequence_reschedules(tmp_path: Path, isolated: bool) -> None:
    """qa bls_request_rescheduling ``test_decoupled_e2e``: iterative_sequence with IN 3
    sends 2, 1, 0, rescheduling its request after each non-final response."""
    with _upstream(tmp_path, "iterative_sequence") as repo:
        model = repo.load("iterative_sequence", isolated=isolated, timeout=60)
        for _ in range(2):  # each request is a sequence of its own
            outputs = [int(r["OUT"][0]) for r in model.stream({"IN": np.array([3], np.int32)})]
            assert outputs == [2, 1, 0]
            model.unload()
            model = repo.load("iterative_sequence", isolated=isolated, timeout=60)


def test_request_rescheduling_addsub(tmp_path: Path) -> None:
    """qa bls_request_rescheduling ``test_non_decoupled_e2e``: the first request is
    rescheduled (its response None) and answered when it runs again."""
    with _upstream(tmp_path, "request_rescheduling_addsub") as repo:
        model = repo.load("request_rescheduling_addsub", timeout=60)
        in0 = np.random.randn(16).astype(np.float32)
        in1 = np.random.randn(16).astype(np.float32)
        out = model.infer({"INPUT0": in0, "INPUT1": in1})
        stats = model.statistics()
    assert out["OUTPUT0"][0] == (in0 + in1)[0]
    assert out["OUTPUT1"][0] == (in0 - in1)[0]
    assert (stats["execution_count"], stats["inference_count"]) == (2, 1)


def test_wrong_return_type(tmp_path: Path) -> None:
    """qa bls_request_rescheduling ``test_wrong_return_type``: a response returned for a
    rescheduled request is an error."""
    with _upstream(tmp_path, "wrong_return_type") as repo:
        model = repo.load("wrong_return_type", timeout=60)
        with pytest.raises(InferenceError) as info:
            model.infer({"INPUT0": np.random.randn(4).astype(np.float32)})
    assert ("Expected a None object in the execute function return list for reschduled "
            "request") in info.value.message()  # fmt: skip


@pytest.mark.parametrize("decoupled", [False, True], ids=["nondecoupled", "decoupled"])
def test_sequence_py_ordering(tmp_path: Path, decoupled: bool) -> None:
    """qa L0_sequence_batcher ``SequenceBatcherPreserveOrderingTest`` with sequence_py:
    sequences of start, middle and end requests sent concurrently; each sequence's outputs
    are in order (1, 2, 3) and requests were batched (fewer executions than inferences).
    Four sequences instead of ten, without the random sleeps."""
    edit = (lambda text: text + "\nmodel_transaction_policy { decoupled: true }\n"
            ) if decoupled else (lambda text: text)  # fmt: skip
    root = repository(tmp_path, {"sequence_py": PYTHON_MODELS / "sequence_py"},
                      config_edit={"sequence_py": edit})  # fmt: skip
    with ModelRepository(root) as repo:
        model = repo.load("sequence_py", timeout=60)
        outputs: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def send(cid: int) -> None:
            try:
                for start, end in ((True, False), (False, False), (False, True)):
                    for r in model.stream({"INPUT0": np.ones((1, 1), np.int32)},
                                          correlation_id=cid, sequence_start=start,
                                          sequence_end=end):  # fmt: skip
                        outputs.setdefault(cid, []).append(int(r["OUTPUT0"].reshape(-1)[0]))
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(c,)) for c in range(1, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = model.statistics()
    assert errors == []
    per_request = 3 if decoupled else 1
    assert outputs == {c: [v for v in (1, 2, 3) for _ in range(per_request)]
                       for c in range(1, 5)}  # fmt: skip
    assert int(stats["execution_count"]) < int(stats["inference_count"])


_BLS = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            got = []
            bls = pb_utils.InferenceRequest(
                model_name="iterative_sequence",
                inputs=[pb_utils.Tensor("IN", np.array([3], np.int32))],
                requested_output_names=["OUT"])
            for response in bls.exec(decoupled=True):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if len(response.output_tensors()) > 0:
                    got.append(int(pb_utils.get_output_tensor_by_name(response, "OUT")
                                   .as_numpy()[0]))
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", np.array(got, np.float32))]))
        return out
'''


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_bls_to_a_rescheduling_model(tmp_path: Path, isolated: bool) -> None:
    """What qa ``bls_request_rescheduling``'s ``test_decoupled_e2e`` checks, through a BLS
    call made by a model: iterative_sequence's responses 2, 1, 0 reach the caller."""
    root = repository(tmp_path, {"iterative_sequence": PYTHON_MODELS / "iterative_sequence"})
    (root / "caller" / "1").mkdir(parents=True)
    (root / "caller" / "1" / "model.py").write_text(_BLS)
    (root / "caller" / "config.pbtxt").write_text(
        'backend: "python"\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    )
    with ModelRepository(root) as repo:
        model = repo.load("caller", isolated=isolated, timeout=60)
        assert model.infer({})["OUTPUT0"].tolist() == [2.0, 1.0, 0.0]
