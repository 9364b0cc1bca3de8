"""Ensembles (``platform: "ensemble"``): upstream's ensemble tests, the dataflow run (order
independence, decoupled steps, ensembles of ensembles, BLS to an ensemble), Triton's
load-time validation messages, shared-memory hops and unloading."""

from __future__ import annotations

import re
import shutil
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from runtime_models import ensemble, step
from upstream_models import PYTHON_MODELS, QA_BACKEND_PYTHON, UPSTREAM, repository

from pb_tensor.runtime import (
    EnsembleModel,
    InferenceError,
    LoadedModel,
    ModelLoadError,
    ModelRepository,
)
from pb_tensor.utils import TritonError

pytest.importorskip("google.protobuf")

L0_SIMPLE_ENSEMBLE = UPSTREAM / "server" / "qa" / "L0_simple_ensemble"

HEADER = """
import numpy as np
import triton_python_backend_utils as pb_utils
"""

ADD_ONE = (
    """
    backend: "python"
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
    """
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)]))
            return out
    """,
)

ADD2 = (
    """
    backend: "python"
    input [ { name: "A" data_type: TYPE_INT32 dims: [ -1 ] },
            { name: "B" data_type: TYPE_INT32 dims: [ -1 ] } ]
    output [ { name: "SUM" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
    """
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                a = pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
                b = pb_utils.get_input_tensor_by_name(r, "B").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", a + b)]))
            return out
    """,
)

REPEAT = (
    """
    backend: "python"
    model_transaction_policy { decoupled: true }
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
    """,
    """
    class TritonPythonModel:
        def execute(self, requests):
            for r in requests:
                sender = r.get_response_sender()
                for v in pb_utils.get_input_tensor_by_name(r, "IN").as_numpy():
                    sender.send(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUT", np.array([v], np.int32))]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
    """,
)

RAISES = (
    ADD_ONE[0],
    """
    class TritonPythonModel:
        def execute(self, requests):
            raise pb_utils.TritonModelException("step failed")
    """,
)

UNLOADER = (
    ADD_ONE[0],
    """
    class TritonPythonModel:
        def execute(self, requests):
            pb_utils.unload_model(model_name="chain", unload_dependents=True)
            return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")])
                    for r in requests]
    """,
)

BLS_TO_ENSEMBLE = (
    ADD_ONE[0],
    """
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN")
                reply = pb_utils.InferenceRequest(
                    model_name="chain", requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", x.as_numpy())]).exec()
                if reply.has_error():
                    raise pb_utils.TritonModelException(reply.error().message())
                y = pb_utils.get_output_tensor_by_name(reply, "OUT").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", y * 10)]))
            return out
    """,
)


BLS_DECOUPLED = (
    ADD_ONE[0],
    """
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN")
                got = []
                request = pb_utils.InferenceRequest(
                    model_name="fan_out", requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", x.as_numpy())])
                for reply in request.exec(decoupled=True):
                    if reply.has_error():
                        raise pb_utils.TritonModelException(reply.error().message())
                    t = pb_utils.get_output_tensor_by_name(reply, "OUT")
                    if t is not None:
                        got.append(int(t.as_numpy()[0]))
                out.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array(got, np.int32))]))
            return out
    """,
)


MARKER = (
    ADD_ONE[0],
    """
    PARAMETERS = [{}, {"sequence_id": 42, "sequence_start": True, "sequence_end": True},
                  {"sequence_start": 1}]

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)],
                                                      parameters=PARAMETERS[int(x[0])]))
            return out
    """,
)

ECHO_SEQUENCE = (
    ADD_ONE[0],
    """
    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.array([r.correlation_id(), r.flags()], np.int32))]) for r in requests]
    """,
)


# IN -> add_one -> t1 -> add_one -> OUT, the steps written in reverse order.
CHAIN = ensemble([step("add_one", {"IN": "t1"}, {"OUT": "OUT"}),
                  step("add_one", {"IN": "IN"}, {"OUT": "t1"})])  # fmt: skip


def build(root: Path, models: dict[str, tuple[str, str | None] | str]) -> Path:
    """A repository: name -> (config, model code) for Python models, config text for
    ensembles (with an empty version directory, as Triton wants one)."""
    for name, spec in models.items():
        config, code = (spec, None) if isinstance(spec, str) else spec
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
        if code is not None:
            (root / name / "1" / "model.py").write_text(HEADER + textwrap.dedent(code))
    return root


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[ModelRepository]:
    root = build(tmp_path / "models", {
        "add_one": ADD_ONE, "add2": ADD2, "repeat": REPEAT, "raises": RAISES,
        "bls_chain": BLS_TO_ENSEMBLE, "chain": CHAIN, "unloader": UNLOADER,
        "bls_fan_out": BLS_DECOUPLED,
        "bls_step": ensemble([step("bls_chain", {"IN": "IN"}, {"OUT": "b"}),
                              step("add_one", {"IN": "b"}, {"OUT": "OUT"})]),
        "marker": MARKER, "echo_sequence": ECHO_SEQUENCE,
        "sequence": ensemble([step("marker", {"IN": "IN"}, {"OUT": "t"}),
                              step("echo_sequence", {"IN": "t"}, {"OUT": "OUT"})]),
        "outer": ensemble([step("chain", {"IN": "IN"}, {"OUT": "c"}),
                           step("add_one", {"IN": "c"}, {"OUT": "OUT"})]),
        "fan_out": ensemble([step("add_one", {"IN": "r"}, {"OUT": "OUT"}),
                             step("repeat", {"IN": "IN"}, {"OUT": "r"})]),
        "fails": ensemble([step("add_one", {"IN": "IN"}, {"OUT": "t"}),
                           step("raises", {"IN": "t"}, {"OUT": "OUT"})]),
    })  # fmt: skip
    with ModelRepository(root) as r:
        yield r


# -- upstream --------------------------------------------------------------------------------
def test_upstream_l0_backend_python_ensemble(tmp_path: Path) -> None:
    # qa/L0_backend_python/ensemble: test.sh lays out ensemble, add_sub_1 and add_sub_2;
    # ensemble_test.py's infer("ensemble") and its assertions (shared memory unchanged after).
    root = repository(tmp_path / "models", {"add_sub_1": PYTHON_MODELS / "add_sub",
                                            "add_sub_2": PYTHON_MODELS / "add_sub"})
    (root / "ensemble" / "1").mkdir(parents=True)
    shutil.copy(PYTHON_MODELS / "ensemble" / "config.pbtxt", root / "ensemble")
    assert (QA_BACKEND_PYTHON / "ensemble" / "ensemble_test.py").is_file()
    with ModelRepository(root) as repo:
        model = repo.load("ensemble")
        shape = [16]
        input_data_0 = np.random.random(shape).astype(np.float32)
        input_data_1 = np.random.random(shape).astype(np.float32)
        model.infer({"INPUT0": input_data_0, "INPUT1": input_data_1})
        before = repo.pool.stats().used
        result = model.infer({"INPUT0": input_data_0, "INPUT1": input_data_1})
        output0 = result["OUTPUT0"]
        output1 = result["OUTPUT1"]
        assert output0 is not None
        assert output1 is not None
        assert np.allclose(output0, 2 * input_data_0, atol=1e-06)
        assert np.allclose(output1, 2 * input_data_1, atol=1e-06)
        del result, output0, output1
        assert repo.pool.stats().used == before


def test_upstream_l0_simple_ensemble_partial_add_sub(tmp_path: Path) -> None:
    # qa/L0_simple_ensemble test_ensemble_partial_add_sub. Its 'simple' model is an ONNX
    # add_sub (INPUT0 + INPUT1, INPUT0 - INPUT1): the same model in Python, same config.
    models = L0_SIMPLE_ENSEMBLE / "models"
    root = repository(tmp_path / "models", {"partial_add_sub": models / "partial_add_sub"})
    (root / "ensemble_partial_add_sub" / "1").mkdir(parents=True)
    shutil.copy(models / "ensemble_partial_add_sub" / "config.pbtxt",
                root / "ensemble_partial_add_sub")  # fmt: skip
    build(root, {"simple": (
        """
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
                { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
                 { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
        """,
        """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                    b = pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()
                    out.append(pb_utils.InferenceResponse([
                        pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
                return out
        """,
    )})
    with ModelRepository(root) as repo:
        input0_np = np.random.randint(0, 100, size=(1, 16), dtype=np.int32)
        input1_np = np.random.randint(0, 100, size=(1, 16), dtype=np.int32)
        model = repo.load("ensemble_partial_add_sub", isolated=False)
        result = model.infer({"INPUT0": input0_np, "INPUT1": input1_np},
                             requested_outputs=["OUTPUT0", "OUTPUT1"])  # fmt: skip
        intermediate_1_np = input1_np - input1_np
        expected_output0_np = input0_np + intermediate_1_np
        assert np.allclose(result["OUTPUT0"], expected_output0_np)
        assert result.get("OUTPUT1") is None


# -- dataflow --------------------------------------------------------------------------------
def test_steps_run_in_dataflow_order_whatever_the_file_order(repo: ModelRepository) -> None:
    model = repo.load("chain", isolated=False)
    assert isinstance(model, LoadedModel)
    out = model.infer({"IN": np.array([1, 2, 3], np.int32)})
    np.testing.assert_array_equal(out["OUT"], [3, 4, 5])
    results = model.infer_many([{"IN": np.array([5], np.int32)}, {"IN": np.array([1.5])}])
    np.testing.assert_array_equal(results[0]["OUT"], [7])  # type: ignore[index]
    assert isinstance(results[1], InferenceError)
    future = model.infer_async({"IN": np.array([0], np.int32)})
    np.testing.assert_array_equal(future.result(10)["OUT"], [2])


def test_requests_are_validated_as_any_model(repo: ModelRepository) -> None:
    model = repo.load("chain", isolated=False)
    with pytest.raises(InferenceError) as info:
        model.infer({"IN": np.array([1.0], np.float32)})
    assert info.value.message() == (
        "[request id: <id_unknown>] inference input 'IN' data-type is 'FP32', but model "
        "'chain' expects 'INT32'")
    with pytest.raises(InferenceError) as info:
        model.infer({"IN": np.array([1], np.int32)}, requested_outputs=["t1"])
    assert info.value.message() == "unexpected inference output 't1' for model 'chain'"


def test_a_failing_step_fails_the_request_naming_the_ensemble(repo: ModelRepository) -> None:
    model = repo.load("fails", isolated=False)
    with pytest.raises(InferenceError) as info:
        model.infer({"IN": np.array([1], np.int32)})
    assert info.value.message().startswith("in ensemble 'fails', ")
    assert "step failed" in info.value.message()


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_an_ensemble_records_its_own_statistics(repo: ModelRepository, isolated: bool) -> None:
    # core's ensemble RequestTracker: each request a success (with one execution of its
    # batch size) or a failure; the composing models record their own requests.
    chain = repo.load("chain", isolated=isolated)
    for value in (1, 2):
        chain.infer({"IN": np.array([value], np.int32)})
    with pytest.raises(InferenceError):
        chain.infer({"IN": np.array([1.0], np.float32)})  # refused by the validation
    stats = chain.statistics()
    assert (stats["name"], stats["inference_count"], stats["execution_count"]) == ("chain", 2, 2)
    infer = stats["inference_stats"]
    assert (infer["success"]["count"], infer["fail"]["count"]) == (2, 1)
    assert infer["success"]["ns"] > 0
    assert infer["compute_infer"]["count"] == 2
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (1, 2)]
    # A failing step fails the ensemble's request too.
    fails = repo.load("fails", isolated=isolated)
    with pytest.raises(InferenceError):
        fails.infer({"IN": np.array([1], np.int32)})
    assert fails.statistics()["inference_stats"]["fail"]["count"] == 1
    # Decoupled (a stream through the flow): one success per request.
    fan_out = repo.load("fan_out", isolated=isolated)
    assert len(list(fan_out.stream({"IN": np.array([10, 20], np.int32)}))) == 2
    assert fan_out.statistics()["inference_stats"]["success"]["count"] == 1


def test_step_response_sequence_parameters_override_the_next_step(
    repo: ModelRepository,
) -> None:
    # core's ConsumeResponse: sequence_id / sequence_start / sequence_end response parameters
    # of a step set the correlation id and flags of the steps its outputs feed.
    model = repo.load("sequence", isolated=False)
    out = model.infer({"IN": np.array([0], np.int32)}, correlation_id=7)
    assert out["OUT"].tolist() == [7, 0]
    out = model.infer({"IN": np.array([1], np.int32)}, correlation_id=7)
    assert out["OUT"].tolist() == [42, 3]
    with pytest.raises(InferenceError) as info:
        model.infer({"IN": np.array([2], np.int32)}, correlation_id=7)
    assert info.value.message() == (
        "in ensemble 'sequence', expect parameter 'sequence_start' to be "
        "TRITONSERVER_PARAMETER_BOOL")
    assert info.value.code() == TritonError.INVALID_ARG


def test_decoupled_step_each_response_flows_on(repo: ModelRepository) -> None:
    # core's ensemble scheduler: each response of a decoupled step is an iteration of its
    # output tensors; later steps run once per iteration, the ensemble responds per iteration
    # and is itself decoupled.
    model = repo.load("fan_out", isolated=False)
    assert model.decoupled
    assert model.config["model_transaction_policy"]["decoupled"] is True
    got = [o["OUT"].tolist() for o in model.stream({"IN": np.array([10, 20, 30], np.int32)})]
    assert got == [[11], [21], [31]]
    assert list(model.stream({"IN": np.array([], np.int32)})) == []


def test_ensemble_of_ensembles(repo: ModelRepository) -> None:
    outer = repo.load("outer", isolated=False)
    assert isinstance(outer, EnsembleModel)
    np.testing.assert_array_equal(outer.infer({"IN": np.array([0, 7], np.int32)})["OUT"],
                                  [3, 10])  # fmt: skip
    names = [m.name for m in outer.composing_models]
    assert names == ["chain", "add_one"]


def test_bls_to_an_ensemble_from_a_stub(repo: ModelRepository) -> None:
    model = repo.load("bls_chain")
    np.testing.assert_array_equal(model.infer({"IN": np.array([1, 2], np.int32)})["OUT"],
                                  [30, 40])  # fmt: skip


@pytest.mark.parametrize("isolated", [True, False])
def test_bls_inside_a_step(repo: ModelRepository, isolated: bool) -> None:
    # bls_chain's execute calls the chain ensemble through BLS while it runs as a step.
    model = repo.load("bls_step", isolated=isolated)
    np.testing.assert_array_equal(model.infer({"IN": np.array([1, 2], np.int32)})["OUT"],
                                  [31, 41])  # fmt: skip


def test_bls_to_a_decoupled_ensemble_streams_its_responses(repo: ModelRepository) -> None:
    model = repo.load("bls_fan_out")
    np.testing.assert_array_equal(model.infer({"IN": np.array([5, 6], np.int32)})["OUT"],
                                  [6, 7])  # fmt: skip
    fan_out = repo.shared_model("fan_out", -1, True)
    got = [o["OUT"].tolist() for o in fan_out.stream({"IN": np.array([1, 2], np.int32)})]
    assert got == [[2], [3]]


def test_stub_to_stub_hops_reuse_the_pool_records(tmp_path: Path) -> None:
    # keep_out keeps its output tensors, keep_in its inputs: after the request (and a small
    # one that lets the stubs give back what they sent), the pool holds one copy of the 4 MiB
    # intermediate tensor when the runtime passed the record on (renamed from OUT to X by the
    # receiving stub), two if it had copied it.
    keep_out = (ADD_ONE[0].replace("INT32", "FP32"), """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                    kept = pb_utils.Tensor("OUT", x + 1)
                    self.kept = getattr(self, "kept", []) + [kept]
                    out.append(pb_utils.InferenceResponse([kept]))
                return out
        """)  # fmt: skip
    keep_in = ("""
        backend: "python"
        input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "S" data_type: TYPE_FP32 dims: [ 1 ] } ]
        """, """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    kept = pb_utils.get_input_tensor_by_name(r, "X")
                    self.kept = getattr(self, "kept", []) + [kept]
                    s = np.array([kept.as_numpy().sum()], np.float32)
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("S", s)]))
                return out
        """)  # fmt: skip
    root = build(tmp_path / "models", {
        "keep_out": keep_out, "keep_in": keep_in,
        "hop": ensemble([step("keep_out", {"IN": "IN"}, {"OUT": "mid"}),
                         step("keep_in", {"X": "mid"}, {"S": "S"})],
                        inputs='{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }',
                        outputs='{ name: "S" data_type: TYPE_FP32 dims: [ 1 ] }'),
    })  # fmt: skip
    nbytes = 4 << 20
    with ModelRepository(root) as repo:
        model = repo.load("hop")
        model.infer({"IN": np.zeros(8, np.float32)})
        before = repo.pool.stats().used
        out = model.infer({"IN": np.zeros(nbytes // 4, np.float32)})
        assert out["S"].tolist() == [nbytes // 4]
        model.infer({"IN": np.zeros(8, np.float32)})
        held = repo.pool.stats().used - before
        assert nbytes <= held < 1.5 * nbytes



def test_stub_to_stub_hops_pass_small_tensors_on_in_their_pack(tmp_path: Path) -> None:
    # Two 16 KiB outputs travel together in one pack; the ensemble returns them and passes
    # them to the next step, which keeps them. The caller's outputs and keep_in's inputs are
    # views of one pack when the runtime passed it on (two packs if it had copied them).
    keep_out = ("""
        backend: "python"
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] },
                 { name: "B" data_type: TYPE_FP32 dims: [ -1 ] } ]
        """, """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                    kept = [pb_utils.Tensor("A", x + 1), pb_utils.Tensor("B", x + 2)]
                    self.kept = getattr(self, "kept", []) + kept
                    out.append(pb_utils.InferenceResponse(kept))
                return out
        """)  # fmt: skip
    keep_in = ("""
        backend: "python"
        input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] },
                { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "S" data_type: TYPE_FP32 dims: [ 1 ] } ]
        """, """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    kept = [pb_utils.get_input_tensor_by_name(r, n) for n in ("X", "Y")]
                    self.kept = getattr(self, "kept", []) + kept
                    s = sum(k.as_numpy().sum() for k in kept)
                    out.append(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("S", np.array([s], np.float32))]))
                return out
        """)  # fmt: skip
    root = build(tmp_path / "models", {
        "keep_out": keep_out, "keep_in": keep_in,
        "hop": ensemble([step("keep_out", {"IN": "IN"}, {"A": "a", "B": "b"}),
                         step("keep_in", {"X": "a", "Y": "b"}, {"S": "S"})],
                        inputs='{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }',
                        outputs='{ name: "S" data_type: TYPE_FP32 dims: [ 1 ] }, '
                                '{ name: "a" data_type: TYPE_FP32 dims: [ -1 ] }, '
                                '{ name: "b" data_type: TYPE_FP32 dims: [ -1 ] }'),
    })  # fmt: skip
    n = 4096  # 16 KiB a tensor: both travel in a pack
    with ModelRepository(root) as repo:
        model = repo.load("hop")
        model.infer({"IN": np.zeros(8, np.float32)})
        before = repo.pool.stats().used
        out = model.infer({"IN": np.zeros(n, np.float32)})
        assert out["S"].tolist() == [3 * n]
        assert (out["a"].sum(), out["b"].sum()) == (n, 2 * n)
        model.infer({"IN": np.zeros(8, np.float32)})
        held = repo.pool.stats().used - before  # with the caller's outputs still alive
        assert 2 * n * 4 <= held < 3 * n * 4  # one copy of the two tensors; two if copied

# -- unloading -------------------------------------------------------------------------------
def test_unload_leaves_composing_models_unless_asked(repo: ModelRepository) -> None:
    model = repo.load("chain", isolated=False)
    assert isinstance(model, EnsembleModel)
    step_model = model.composing_models[0]
    assert model.is_ready()
    model.unload()
    assert not model.loaded
    assert not model.is_ready()
    assert step_model.loaded
    with pytest.raises(InferenceError) as info:
        model.infer({"IN": np.array([1], np.int32)})
    assert info.value.message() == "Request for unknown model: 'chain' is not found"
    again = repo.load("chain", isolated=False)
    assert isinstance(again, EnsembleModel)
    assert again.composing_models == [step_model]
    again.unload(unload_dependents=True)
    assert not step_model.loaded


def test_pb_utils_unload_model_with_dependents(repo: ModelRepository) -> None:
    caller = repo.load("bls_chain", isolated=False)
    caller.infer({"IN": np.array([1], np.int32)})  # loads chain (and add_one) through BLS
    chain = repo.shared_model("chain", -1, False)
    assert isinstance(chain, EnsembleModel)
    add_one = chain.composing_models[0]
    repo.load("unloader", isolated=False).infer({"IN": np.array([1], np.int32)})
    # Triton's unload returns once started: the models go in the background (bounded wait).
    deadline = time.monotonic() + 30
    while (chain.loaded or add_one.loaded) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not chain.loaded
    assert not add_one.loaded


# -- validation ------------------------------------------------------------------------------
def load_error(tmp_path: Path, config: str, models: dict[str, tuple[str, str | None] | str]
               | None = None) -> str:
    root = build(tmp_path / "models", {"add_one": ADD_ONE, "add2": ADD2, "repeat": REPEAT,
                                       **(models or {}), "e": config})  # fmt: skip
    with ModelRepository(root) as repo, pytest.raises(ModelLoadError) as info:
        repo.load("e", isolated=False)
    # "failed to load model 'e': " for the ensemble's own configuration (checked before its
    # versions, as Triton does), "... version 1: " for what needs the composing models
    found = re.match(r"failed to load model 'e'( version 1)?: ", str(info.value))
    assert found is not None
    return str(info.value)[found.end():]


ONE = step("add_one", {"IN": "IN"}, {"OUT": "OUT"})
INT = '{ name: "%s" data_type: TYPE_INT32 dims: [ -1 ] }'


@pytest.mark.parametrize(("config", "message"), [
    ('platform: "ensemble"\nbackend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 '
     'dims: [ -1 ] } ]\noutput [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
     f"ensemble_scheduling {{ step [ {ONE} ] }}",
     "Ensemble model 'e' must have platform type 'ensemble' and empty backend type"),
    ('platform: "ensemble"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
     'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]',
     "ensemble scheduling must be set for ensemble e whose platform is ensemble"),
    (ensemble([ONE], extra="instance_group [ { count: 2 } ]"),
     "instance group should not be specified for ensemble 'e'"),
    (ensemble([]), "must specify 'step' for ensemble 'e'"),
    (ensemble(['{ input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } }']),
     "must specify 'model_name' in step 0 of ensemble 'e'"),
    (ensemble([ONE, '{ model_name: "add_one" output_map { key: "OUT" value: "OUT" } }']),
     "must specify 'input_map' in step 1 of ensemble 'e'"),
    (ensemble(['{ model_name: "add_one" input_map { key: "IN" value: "IN" } }']),
     "must specify 'output_map' in step 0 of ensemble 'e'"),
    (ensemble([ONE, step("add_one", {"IN": "IN"}, {"OUT": "OUT"})]),
     "ensemble tensor 'OUT' can appear in an output map only once for ensemble 'e' step 1"),
    (ensemble([ONE], inputs=f"{INT % 'IN'}, {INT % 'UNUSED'}"),
     "ensemble input 'UNUSED' for ensemble e' is not used"),
    (ensemble([ONE], outputs=f"{INT % 'OUT'}, {INT % 'OUT2'}"),
     "ensemble output 'OUT2' for ensemble e' is not used"),
    (ensemble([step("add_one", {"IN": "IN"}, {"OUT": "t"}),
               step("add2", {"A": "t", "B": "nowhere"}, {"SUM": "OUT"})]),
     "output 'OUT' for ensemble 'e' is not written: at least one of its depending tensors, "
     "'nowhere', is not connected"),
    (ensemble([ONE, step("add_one", {"IN": "IN"}, {"OUT": "dangling"})]),
     "ensemble tensor 'dangling' is unused in ensemble 'e'"),
    (ensemble([ONE, step("nope", {"IN": "IN"}, {"OUT": "x"}),
               step("also_missing", {"IN": "x"}, {"OUT": "y"}),
               step("add2", {"A": "y", "B": "IN"}, {"SUM": "OUT2"})],
              outputs=f"{INT % 'OUT'}, {INT % 'OUT2'}"),
     "ensemble e contains models that are not available or ambiguous: also_missing, nope"),
    (ensemble([step("add_one", {"IN": "IN"}, {"OUT": "OUT"}, version=3)]),
     "ensemble 'e' depends on 'add_one' whose required version 3 is not loaded."),
    (ensemble([step("add2", {"A": "IN"}, {"SUM": "OUT"})]),
     "in ensemble e, input B in model add2 is not mapped to any ensemble tensors"),
    (ensemble([step("add_one", {"IN": "IN", "X": "IN"}, {"OUT": "OUT"})]),
     "in ensemble e, ensemble tensor IN is mapping to non-existing input X in model add_one"),
    (ensemble([step("add_one", {"IN": "IN"}, {"OUT": "OUT", "NOPE": "t"}),
               step("add_one", {"IN": "t"}, {"OUT": "OUT2"})],
              outputs=f"{INT % 'OUT'}, {INT % 'OUT2'}"),
     "in ensemble e, ensemble tensor t is mapped from non-existing output NOPE in model "
     "add_one"),
    (ensemble([ONE], inputs='{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }'),
     "in ensemble e, ensemble tensor IN: inconsistent data type: TYPE_FP32 is inferred from "
     "model e while TYPE_INT32 is inferred from model add_one"),
    (ensemble([ONE], inputs='{ name: "IN" data_type: TYPE_INT32 dims: [ 2, 2 ] }'),
     "in ensemble e, ensemble tensor IN: inconsistent shape: [2,2] is inferred from model e "
     "while [-1] is inferred from model add_one"),
    (ensemble([step("repeat", {"IN": "IN"}, {"OUT": "r"}),
               step("add2", {"A": "r", "B": "IN"}, {"SUM": "s"}),
               step("add_one", {"IN": "s"}, {"OUT": "OUT"})]),
     "in ensemble e, step of model 'add2' receives inputs originated from different "
     "decoupled models"),
    # Core names the model an ensemble tensor was first inferred from: the ensemble's own
    # output here.
    (ensemble([step("repeat", {"IN": "IN"}, {"OUT": "r"}),
               step("add2", {"A": "r", "B": "IN"}, {"SUM": "OUT"})]),
     "in ensemble e, step of model 'e' receives inputs originated from different "
     "decoupled models"),
])  # fmt: skip
def test_validation_messages(tmp_path: Path, config: str, message: str) -> None:
    assert load_error(tmp_path, config) == message


def test_validation_max_batch_size(tmp_path: Path) -> None:
    small = (ADD_ONE[0] + "max_batch_size: 4\n", ADD_ONE[1])
    config = ensemble([step("small", {"IN": "IN"}, {"OUT": "OUT"})], extra="max_batch_size: 8")
    assert load_error(tmp_path, config, {"small": small}) == (
        "ensemble e allows maximum batch size 8, but it contains model small which only "
        "allows maximum batch size to be 4")


def test_validation_cycle_and_failing_composing_models(tmp_path: Path) -> None:
    config = ensemble([step("e2", {"IN": "IN"}, {"OUT": "OUT"})])
    assert load_error(tmp_path / "a", config, {"e2": ensemble([step("e", {"IN": "IN"},
                                                                    {"OUT": "OUT"})])}) == (
        "circular dependency between ensembles: e -> ... -> e2 -> e")  # fmt: skip
    broken = (ADD_ONE[0], "class TritonPythonModel:\n    def initialize(self, args):\n"
              "        raise ValueError('no')\n")  # fmt: skip
    config = ensemble([step("broken", {"IN": "IN"}, {"OUT": "OUT"})])
    message = load_error(tmp_path / "b", config, {"broken": broken})
    assert message.startswith(  # core's CheckNode, with the load status of 'broken'
        "ensemble 'e' depends on 'broken' which has no loaded version. Model 'broken' loading "
        "failed with error: version 1 is at UNAVAILABLE state: Internal: ValueError: no\n")
    assert message.endswith("): initialize\n;")
    config = ensemble([step("inner", {"IN": "IN"}, {"OUT": "OUT"})])
    message = load_error(tmp_path / "c", config, {"inner": ensemble([])})
    assert message == (
        "ensemble 'e' depends on 'inner' which is not valid. Model 'inner' failed with error: "
        "failed to load model 'inner': must specify 'step' for ensemble 'inner'")


def test_batching_and_non_batching_steps_reshape(tmp_path: Path) -> None:
    # core's ReshapeTensorDims: a non-batching ensemble feeding a batching model adds a batch
    # dimension of 1, and the ensemble's output loses it again.
    batched = ("""
        backend: "python"
        max_batch_size: 4
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ 3 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 3 ] } ]
        """, ADD_ONE[1])  # fmt: skip
    config = ensemble([step("batched", {"IN": "IN"}, {"OUT": "OUT"})],
                      inputs='{ name: "IN" data_type: TYPE_INT32 dims: [ 3 ] }',
                      outputs='{ name: "OUT" data_type: TYPE_INT32 dims: [ 3 ] }')
    root = build(tmp_path / "models", {"batched": batched, "e": config})
    with ModelRepository(root) as repo:
        out = repo.load("e", isolated=False).infer({"IN": np.array([1, 2, 3], np.int32)})
        assert out["OUT"].shape == (3,)
        np.testing.assert_array_equal(out["OUT"], [2, 3, 4])


def test_ensemble_errors_carry_triton_codes(repo: ModelRepository) -> None:
    model = repo.load("fails", isolated=False)
    with pytest.raises(InferenceError) as info:
        model.infer({"IN": np.array([1], np.int32)})
    assert info.value.code() == TritonError.INTERNAL


# -- step requests the ensemble's own validation proves valid --------------------------------
FIXED3 = ("""
    backend: "python"
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ 3 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 3 ] } ]
    """, ADD_ONE[1])  # fmt: skip

TO_FLOAT = (ADD_ONE[0], """
    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + np.float32(0.5))])
                for r in requests]
    """)  # fmt: skip


def test_steps_are_validated_unless_the_ensemble_checked_their_inputs(tmp_path: Path) -> None:
    # dims [-1] agree with [3] at load, as in Triton, so a request of another shape passes the
    # ensemble's validation and fails the step's; a step fed by another step's output (which
    # nobody checks) is validated too.
    root = build(tmp_path / "models", {
        "fixed3": FIXED3, "add_one": ADD_ONE, "to_float": TO_FLOAT,
        "wild": ensemble([step("fixed3", {"IN": "IN"}, {"OUT": "OUT"})]),
        "exact": ensemble([step("fixed3", {"IN": "IN"}, {"OUT": "OUT"})],
                          inputs='{ name: "IN" data_type: TYPE_INT32 dims: [ 3 ] }'),
        "float_fed": ensemble([step("to_float", {"IN": "IN"}, {"OUT": "t"}),
                               step("add_one", {"IN": "t"}, {"OUT": "OUT"})]),
    })  # fmt: skip
    with ModelRepository(root) as repo:
        wild = repo.load("wild", isolated=False)
        np.testing.assert_array_equal(wild.infer({"IN": np.array([1, 2, 3], np.int32)})["OUT"],
                                      [2, 3, 4])  # fmt: skip
        with pytest.raises(InferenceError) as info:
            wild.infer({"IN": np.array([1, 2], np.int32)})
        assert info.value.message() == (
            "in ensemble 'wild', [request id: <id_unknown>] unexpected shape for input 'IN' for "
            "model 'fixed3'. Expected [3], got [2]. ")
        exact = repo.load("exact", isolated=False)
        np.testing.assert_array_equal(exact.infer({"IN": np.array([1, 2, 3], np.int32)})["OUT"],
                                      [2, 3, 4])  # fmt: skip
        results = exact.infer_many([{"IN": np.array([5, 6, 7], np.int32)},
                                    {"IN": np.array([1, 2], np.int32)}])  # fmt: skip
        np.testing.assert_array_equal(results[0]["OUT"], [6, 7, 8])  # type: ignore[index]
        assert isinstance(results[1], InferenceError)
        assert results[1].message() == (
            "[request id: <id_unknown>] unexpected shape for input 'IN' for model 'exact'. "
            "Expected [3], got [2]. ")
        with pytest.raises(InferenceError) as info:
            repo.load("float_fed", isolated=False).infer({"IN": np.array([1], np.int32)})
        assert info.value.message() == (
            "in ensemble 'float_fed', [request id: <id_unknown>] inference input 'IN' "
            "data-type is 'FP64', but model 'add_one' expects 'INT32'")
