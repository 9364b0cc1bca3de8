"""The example repository in both modes: add_sub, string identity, torch DLPack, decoupled
streaming, BLS, auto_complete_config; zero-copy outputs; request validation messages."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pb_tensor.runtime import InferenceError, LoadedModel, ModelRepository
from pb_tensor.utils import TritonError

EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "model_repository"
)

Loader = Callable[[str], LoadedModel]


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "isolated"])
def load(request: pytest.FixtureRequest) -> Iterator[Loader]:
    """``load(name)``: the example model in this module's mode, loaded once per module."""
    isolated: bool = request.param
    cache: dict[str, LoadedModel] = {}
    with ModelRepository(EXAMPLES) as repo:

        def get(name: str) -> LoadedModel:
            if name not in cache:
                cache[name] = repo.load(name, isolated=isolated, timeout=60)
            return cache[name]

        yield get


def _in_pool(array: np.ndarray[Any, Any]) -> bool:
    """Whether ``array`` views shared memory (a pool segment), i.e. no copy was made: its data
    lies in a mapping of a /dev/shm file or a memfd (sealed pools)."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                path = fields[5].strip() if len(fields) > 5 else ""
                return path.startswith(("/dev/shm/", "/memfd:"))
    return False


def test_models_listed() -> None:
    with ModelRepository(EXAMPLES) as repo:
        assert repo.models() == [
            "add_sub", "auto_complete", "bls_add_sub", "decoupled_repeat", "string_identity",
            "torch_dlpack",
        ]  # fmt: skip
        assert repo.versions("add_sub") == [1]


def test_add_sub(load: Loader) -> None:
    model = load("add_sub")
    a = np.arange(16, dtype=np.float32)
    b = np.full(16, 0.5, dtype=np.float32)
    out = model.infer({"INPUT0": a, "INPUT1": b})
    assert sorted(out) == ["OUTPUT0", "OUTPUT1"]
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    assert out["OUTPUT0"].dtype == np.float32
    # Small outputs travel inside the stub's message (the channel's INLINE_MAX), large ones
    # in the pool (test_add_sub_large_input_zero_copy).
    assert not _in_pool(out["OUTPUT0"])
    assert model.instance_name == "add_sub_0_0"
    assert (model.pid is not None) is model.isolated


def test_add_sub_requested_outputs(load: Loader) -> None:
    model = load("add_sub")
    a = np.ones(4, np.float32)
    out = model.infer({"INPUT0": a, "INPUT1": a}, requested_outputs=["OUTPUT1"])
    assert list(out) == ["OUTPUT1"]
    np.testing.assert_array_equal(out["OUTPUT1"], np.zeros(4, np.float32))


def test_add_sub_large_input_zero_copy(load: Loader) -> None:
    model = load("add_sub")
    a = np.arange(1 << 20, dtype=np.float32)
    out = model.infer({"INPUT0": a, "INPUT1": a})
    np.testing.assert_array_equal(out["OUTPUT0"], a * 2)
    assert _in_pool(out["OUTPUT1"]) is model.isolated


def test_add_sub_error_response(load: Loader) -> None:
    model = load("add_sub")
    with pytest.raises(InferenceError) as info:
        model.infer({"INPUT0": np.ones(4, np.float32), "INPUT1": np.ones(3, np.float32)})
    assert info.value.message() == "INPUT0 and INPUT1 must have the same shape, got (4,) and (3,)"
    assert info.value.code() == TritonError.INVALID_ARG


def test_infer_many_one_failure_does_not_fail_others(load: Loader) -> None:
    model = load("add_sub")
    a = np.arange(4, dtype=np.float32)
    results = model.infer_many(
        [{"INPUT0": a, "INPUT1": a}, {"INPUT0": a}, {"INPUT0": a, "INPUT1": a[:2]},
         {"INPUT0": a, "INPUT1": -a}]
    )  # fmt: skip
    assert len(results) == 4
    ok0, missing, bad_shape, ok3 = results
    assert isinstance(ok0, dict)
    np.testing.assert_array_equal(ok0["OUTPUT0"], a * 2)
    assert isinstance(missing, InferenceError)
    assert missing.message() == (
        "[request id: <id_unknown>] expected 2 inputs but got 1 inputs for model 'add_sub'. "
        "Got input(s) ['INPUT0'], but missing required input(s) ['INPUT1']. Please provide all "
        "required input(s)."
    )
    assert isinstance(bad_shape, InferenceError)
    assert bad_shape.code() == TritonError.INVALID_ARG
    assert isinstance(ok3, dict)
    np.testing.assert_array_equal(ok3["OUTPUT0"], np.zeros(4, np.float32))


def test_string_identity(load: Loader) -> None:
    model = load("string_identity")
    out = model.infer({"INPUT0": ["hello", "wörld", ""]})
    assert out["OUTPUT0"].dtype == object
    assert out["OUTPUT0"].tolist() == [b"hello", "wörld".encode(), b""]
    raw = np.array([b"a\x00b", b"c"], dtype=object)
    assert model.infer({"INPUT0": raw})["OUTPUT0"].tolist() == [b"a\x00b", b"c"]


def test_torch_dlpack_zero_copy(load: Loader) -> None:
    pytest.importorskip("torch")
    model = load("torch_dlpack")
    a = np.arange(8, dtype=np.float32)
    out = model.infer({"INPUT0": a})
    np.testing.assert_array_equal(out["OUTPUT0"], a * 2)
    assert out["ZERO_COPY"].tolist() == [True]


def test_torch_tensor_as_input(load: Loader) -> None:
    torch = pytest.importorskip("torch")
    model = load("add_sub")
    t = torch.arange(4, dtype=torch.float32)
    out = model.infer({"INPUT0": t, "INPUT1": t})
    np.testing.assert_array_equal(out["OUTPUT0"], np.arange(4, dtype=np.float32) * 2)


def test_decoupled_stream(load: Loader) -> None:
    model = load("decoupled_repeat")
    assert model.decoupled
    outs = list(model.stream({"N": np.array([5], np.int32)}))
    assert [o["OUT"].tolist() for o in outs] == [[0], [1], [2], [3], [4]]
    # The model ends with a flags-only send(flags=FINAL): no response carries the flag.
    assert [o.final for o in outs] == [False] * 5
    assert list(model.stream({"N": np.array([0], np.int32)})) == []
    a = np.ones(2, np.float32)
    assert [o.final for o in load("add_sub").stream({"INPUT0": a, "INPUT1": a})] == [True]


def test_decoupled_stream_stopped_early_cancels(load: Loader) -> None:
    model = load("decoupled_repeat")
    stream = model.stream({"N": np.array([1000000], np.int32)})
    assert next(stream)["OUT"].tolist() == [0]
    stream.close()  # cancels; the model sees is_cancelled() and sends its final flag
    outs = list(model.stream({"N": np.array([2], np.int32)}))
    assert [o["OUT"].tolist() for o in outs] == [[0], [1]]


_UNTIL_CANCELLED = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        sender = requests[0].get_response_sender()
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([0], np.int32))]))
        for _ in range(1000):  # execute runs until the caller cancels (at most 10 s)
            if sender.is_cancelled():
                break
            time.sleep(0.01)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _like_decoupled_repeat(root: Path, name: str, source: str) -> None:
    """A model ``name`` under ``root``: ``source`` with decoupled_repeat's configuration."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(source)
    config = (Path(EXAMPLES) / "decoupled_repeat" / "config.pbtxt").read_text()
    (root / name / "config.pbtxt").write_text(
        config.replace('name: "decoupled_repeat"', f'name: "{name}"')
    )


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_request_while_iterating_a_stream_is_refused(tmp_path: Path, isolated: bool) -> None:
    """While its ``execute`` runs, the one instance is the iterating thread's: a request of
    that thread is refused. (Once a decoupled ``execute`` returned, the instance is free,
    as in Triton: decoupled_repeat, which answers from a thread, would serve it.)"""
    _like_decoupled_repeat(tmp_path, "waits", _UNTIL_CANCELLED)
    with ModelRepository(tmp_path) as repo:
        model = repo.load("waits", isolated=isolated, timeout=60)
        stream = model.stream({"N": np.array([1], np.int32)})
        assert next(stream)["OUT"].tolist() == [0]
        with pytest.raises(InferenceError) as info:
            model.infer({"N": np.array([1], np.int32)})
        assert info.value.code() == TritonError.UNAVAILABLE
        assert "this thread is already using it" in info.value.message()
        stream.cancel()
        with pytest.raises(InferenceError) as info:
            next(stream)
        assert info.value.code() == TritonError.CANCELLED


_RETURNS_SOON = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        sender = requests[0].get_response_sender()
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([0], np.int32))]))
        time.sleep(0.3)  # returns on its own, whatever the caller does meanwhile
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_request_while_an_execute_returns_on_its_own_waits(tmp_path: Path) -> None:
    """In-process, a decoupled ``execute`` runs on a thread of its own: a request the
    iterating thread makes while that ``execute`` is still running waits for the instance
    (its release does not depend on the caller) instead of being refused, as a Triton client
    would queue. (A coroutine gathering two BLS streams of one instance asks for the second
    while the first execute is returning: refused at random before.)"""
    _like_decoupled_repeat(tmp_path, "soon", _RETURNS_SOON)
    with ModelRepository(tmp_path) as repo:
        model = repo.load("soon", isolated=False, timeout=60)
        stream = model.stream({"N": np.array([1], np.int32)})
        assert next(stream)["OUT"].tolist() == [0]  # execute is still running
        assert model.infer({"N": np.array([1], np.int32)})["OUT"].tolist() == [0]
        assert list(stream) == []  # the first request's final flag, without a response


def test_decoupled_infer_gives_first_response(load: Loader) -> None:
    model = load("decoupled_repeat")
    assert model.infer({"N": np.array([3], np.int32)})["OUT"].tolist() == [0]


def test_bls_add_sub(load: Loader) -> None:
    model = load("bls_add_sub")
    a = np.arange(4, dtype=np.float32)
    out = model.infer({"INPUT0": a, "INPUT1": np.ones(4, np.float32)})
    np.testing.assert_array_equal(out["OUTPUT0"], a + 1)
    np.testing.assert_array_equal(out["OUTPUT1"], a - 1)


def test_bls_error_from_target_is_raised_by_model(load: Loader) -> None:
    model = load("bls_add_sub")
    with pytest.raises(InferenceError) as info:
        model.infer({"INPUT0": np.ones(2, np.float32), "INPUT1": np.ones(3, np.float32)})
    text = info.value.message()
    assert text.startswith(
        "Failed to process the request(s) for model 'bls_add_sub_0', message: "
        "TritonModelException: INPUT0 and INPUT1 must have the same shape"
    )


def test_auto_complete_without_config_file(load: Loader) -> None:
    model = load("auto_complete")
    config = model.config
    assert config["max_batch_size"] == 8
    assert config["input"][0]["name"] == "INPUT0"
    assert config["input"][0]["dims"] == [-1]
    assert config["dynamic_batching"]["preferred_batch_size"] == [8]
    assert config["backend"] == "python"
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(model.infer({"INPUT0": x})["OUTPUT0"], x)


# -- validation: Triton core's messages -------------------------------------------------------


def test_unknown_input(load: Loader) -> None:
    model = load("add_sub")
    a = np.ones(4, np.float32)
    with pytest.raises(InferenceError) as info:
        model.infer({"INPUT0": a, "OTHER": a})
    assert info.value.message() == "unexpected inference input 'OTHER' for model 'add_sub'"
    assert info.value.code() == TritonError.INVALID_ARG


def test_too_many_inputs(load: Loader) -> None:
    model = load("add_sub")
    a = np.ones(4, np.float32)
    with pytest.raises(InferenceError, match=r"expected 2 inputs but got 3 inputs"):
        model.infer({"INPUT0": a, "INPUT1": a, "X": a})


def test_unknown_requested_output(load: Loader) -> None:
    model = load("add_sub")
    a = np.ones(4, np.float32)
    with pytest.raises(InferenceError) as info:
        model.infer({"INPUT0": a, "INPUT1": a}, requested_outputs=["NOPE"])
    assert info.value.message() == "unexpected inference output 'NOPE' for model 'add_sub'"


def test_wrong_datatype(load: Loader) -> None:
    model = load("add_sub")
    a = np.ones(4, np.float32)
    with pytest.raises(InferenceError) as info:
        model.infer({"INPUT0": a, "INPUT1": a.astype(np.int64)}, request_id="r7")
    assert info.value.message() == (
        "[request id: r7] inference input 'INPUT1' data-type is 'INT64', but model 'add_sub' "
        "expects 'FP32'"
    )


def test_wrong_shape(load: Loader) -> None:
    model = load("add_sub")
    a = np.ones((2, 2), np.float32)
    with pytest.raises(InferenceError) as info:
        model.infer({"INPUT0": a, "INPUT1": a})
    assert info.value.message() == (
        "[request id: <id_unknown>] unexpected shape for input 'INPUT0' for model 'add_sub'. "
        "Expected [-1], got [2,2]. "
    )


def test_batch_dimension(load: Loader) -> None:
    model = load("auto_complete")
    with pytest.raises(InferenceError) as info:
        model.infer({"INPUT0": np.ones((9, 2), np.float32)})
    assert info.value.message() == (
        "[request id: <id_unknown>] inference request batch-size must be <= 8 for "
        "'auto_complete'"
    )
    with pytest.raises(InferenceError) as info:
        model.infer({"INPUT0": np.ones(3, np.float32)})
    assert info.value.message().startswith(
        "[request id: <id_unknown>] unexpected shape for input 'INPUT0' for model "
        "'auto_complete'. Expected [-1,-1], got [3]. NOTE: Setting a non-zero max_batch_size"
    )
    with pytest.raises(InferenceError) as info:
        model.infer({"INPUT0": np.float32(1.0)})
    assert info.value.message() == (
        "[request id: <id_unknown>] input 'INPUT0' has no shape but model requires batch "
        "dimension for 'auto_complete'"
    )
