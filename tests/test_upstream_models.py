"""Triton's own models, byte-for-byte (``tests/upstream``), run with the inputs and assertions
of upstream's own clients and L0 tests, in both isolated and in-process mode.

Sources (each test names its own):

* python_backend ``examples/*/client.py`` for the examples, laid out as the examples' READMEs
  copy them;
* the server's ``qa/L0_backend_python/python_test.py`` and ``test.sh`` for the
  ``qa/python_models`` it loads (``identity_bool`` is ``identity_fp32`` with test.sh's ``sed``);
* the server's ``qa/L0_backend_python/bls/test.sh`` for ``bls_init_error`` (the load fails) and
  ``argument_validation/test.sh`` for its model (``test_infer_shm_leak.py``'s check);
* ``qa/L0_backend_python/io/io_test.py`` for qa ``add_sub`` (laid out as ``qa_add_sub``: the
  example of the same name is in the same repository);
* the server's ``qa/L0_backend_python/lifecycle`` (``lifecycle_test.py``, ``test.sh``) for
  ``error_code``, ``execute_error``, ``wrong_model``, ``init_error``, ``fini_error`` and
  ``auto_complete_error``.

One repository per module; each model is loaded once per mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from upstream_models import EXAMPLES, PYTHON_MODELS, QA_BACKEND_PYTHON, repository

from pb_tensor.runtime import InferenceError, LoadedModel, ModelLoadError, ModelRepository
from pb_tensor.utils import TritonError

QA = {
    name: PYTHON_MODELS / name
    for name in (
        "identity_fp32", "identity_bf16", "init_args", "optional", "non_contiguous", "string",
        "string_fixed", "multi_file", "bls_init_error", "error_code", "execute_error",
        "wrong_model", "init_error", "fini_error", "auto_complete_error",
    )
}  # fmt: skip
QA["qa_add_sub"] = PYTHON_MODELS / "add_sub"  # io/test.sh's add_sub (the examples' is "add_sub")
QA["identity_bool"] = PYTHON_MODELS / "identity_fp32"

EXAMPLE_FILES: dict[str, tuple[Path, Path | None]] = {
    "add_sub": (EXAMPLES / "add_sub" / "model.py", EXAMPLES / "add_sub" / "config.pbtxt"),
    "pytorch": (EXAMPLES / "pytorch" / "model.py", EXAMPLES / "pytorch" / "config.pbtxt"),
    "jax": (EXAMPLES / "jax" / "model.py", EXAMPLES / "jax" / "config.pbtxt"),
    "custom_metrics": (
        EXAMPLES / "custom_metrics" / "model.py", EXAMPLES / "custom_metrics" / "config.pbtxt"
    ),
    "bls_sync": (EXAMPLES / "bls" / "sync_model.py", EXAMPLES / "bls" / "sync_config.pbtxt"),
    "bls_async": (EXAMPLES / "bls" / "async_model.py", EXAMPLES / "bls" / "async_config.pbtxt"),
    "bls_decoupled_sync": (
        EXAMPLES / "bls_decoupled" / "sync_model.py",
        EXAMPLES / "bls_decoupled" / "sync_config.pbtxt",
    ),
    "bls_decoupled_async": (
        EXAMPLES / "bls_decoupled" / "async_model.py",
        EXAMPLES / "bls_decoupled" / "async_config.pbtxt",
    ),
    "repeat_int32": (
        EXAMPLES / "decoupled" / "repeat_model.py", EXAMPLES / "decoupled" / "repeat_config.pbtxt"
    ),
    "square_int32": (
        EXAMPLES / "decoupled" / "square_model.py", EXAMPLES / "decoupled" / "square_config.pbtxt"
    ),
    "nobatch_auto_complete": (EXAMPLES / "auto_complete" / "nobatch_model.py", None),
    "batch_auto_complete": (EXAMPLES / "auto_complete" / "batch_model.py", None),
}  # fmt: skip

_ARGS = QA_BACKEND_PYTHON / "argument_validation" / "models" / "argument_validation"
QA_FILES: dict[str, tuple[Path, Path | None]] = {
    "argument_validation": (_ARGS / "1" / "model.py", _ARGS / "config.pbtxt"),
}

NON_DECOUPLED_EXAMPLES = [
    "add_sub", "pytorch", "jax", "custom_metrics", "bls_sync", "bls_async",
]  # fmt: skip


# Models importing what the runtime extra does not install (the interop extra does).
_NEEDS = {"pytorch": "torch", "bls_sync": "torch", "bls_async": "torch", "jax": "jax",
          "identity_bf16": "torch"}  # fmt: skip


def _needs(name: str) -> None:
    """Skip the test when ``name`` (or the model it calls) imports a package not installed."""
    module = _NEEDS.get(name)
    if module is not None:
        pytest.importorskip(module)


def _sed(name: str, dtype: str | None = None) -> Callable[[str], str]:
    """test.sh's ``sed -i "s/^name:.*/name: \"<name>\"/"`` (and ``s/TYPE_FP32/<dtype>/g``)."""

    def edit(text: str) -> str:
        lines = [f'name: "{name}"' if line.startswith("name:") else line
                 for line in text.splitlines()]  # fmt: skip
        out = "\n".join(lines) + "\n"
        return out if dtype is None else out.replace("TYPE_FP32", dtype)

    return edit


@pytest.fixture(scope="module")
def triton_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where test.sh's models live: ``$TRITON_DIR/qa/L0_backend_python/models`` (qa init_args
    checks ``args["model_repository"]`` against it)."""
    root = tmp_path_factory.mktemp("triton")
    models = root / "qa" / "L0_backend_python" / "models"
    edits = {
        "identity_bool": _sed("identity_bool", "TYPE_BOOL"),  # L0_backend_python/test.sh
        "execute_error": _sed("execute_error"),  # lifecycle/test.sh
        "wrong_model": _sed("wrong_model", "TYPE_UINT32"),  # lifecycle/test.sh
    }
    repository(models, QA, config_edit=edits, files={**EXAMPLE_FILES, **QA_FILES})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_DIR", str(root))
        yield models


@pytest.fixture(scope="module")
def models(triton_dir: Path) -> Iterator[Callable[[str, bool], LoadedModel]]:
    """``models(name, isolated)``: the model in that mode, loaded once for the module (both
    modes stay loaded, so the comparison of the modes reuses them)."""
    cache: dict[tuple[str, bool], LoadedModel] = {}
    with ModelRepository(triton_dir) as repo:

        def get(name: str, isolated: bool) -> LoadedModel:
            if (name, isolated) not in cache:
                cache[name, isolated] = repo.load(name, isolated=isolated, timeout=120)
            return cache[name, isolated]

        yield get


@pytest.fixture(params=[False, True], ids=["in_process", "isolated"])
def load(
    request: pytest.FixtureRequest, models: Callable[[str, bool], LoadedModel]
) -> Callable[[str], LoadedModel]:
    """``load(name)``: the model in this test's mode."""
    isolated: bool = request.param
    return lambda name: models(name, isolated)


def _add_sub_inputs() -> dict[str, np.ndarray[Any, Any]]:
    # examples/*/client.py: shape [4], np.random.rand(*shape).astype(np.float32)
    rng = np.random.default_rng(0)
    return {f"INPUT{i}": rng.random(4).astype(np.float32) for i in range(2)}


# -- python_backend examples ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["add_sub", "pytorch", "jax", "custom_metrics"])
def test_example_add_sub_clients(load: Callable[[str], LoadedModel], name: str) -> None:
    # examples/{add_sub,pytorch,jax,custom_metrics}/client.py
    _needs(name)
    inputs = _add_sub_inputs()
    out = load(name).infer(inputs, requested_outputs=["OUTPUT0", "OUTPUT1"], request_id="1")
    assert np.allclose(inputs["INPUT0"] + inputs["INPUT1"], out["OUTPUT0"])
    assert np.allclose(inputs["INPUT0"] - inputs["INPUT1"], out["OUTPUT1"])


def test_example_custom_metrics_reports_its_metric(load: Callable[[str], LoadedModel]) -> None:
    # examples/custom_metrics/client.py reads requests_process_latency_ns{model=...,version="1"}
    # from the metrics endpoint; here LoadedModel.metrics() has the same family and labels.
    model = load("custom_metrics")
    model.infer(_add_sub_inputs())
    family = model.metrics()["requests_process_latency_ns"]
    assert family["kind"] == "COUNTER"
    assert family["description"] == "Cumulative time spent processing requests"
    labels = [m["labels"] for m in family["metrics"]]
    assert {"model": "custom_metrics", "version": "1"} in labels


@pytest.mark.parametrize("name", ["bls_sync", "bls_async"])
def test_example_bls(load: Callable[[str], LoadedModel], name: str) -> None:
    # examples/bls/sync_client.py and async_client.py
    _needs(name)
    inputs = _add_sub_inputs()
    model = load(name)
    if name == "bls_async":
        # async_model.py calls "pytorch" and "add_sub" concurrently: OUTPUT0 from one,
        # OUTPUT1 from the other.
        out = model.infer(inputs, requested_outputs=["OUTPUT0", "OUTPUT1"], request_id="1")
        assert np.allclose(inputs["INPUT0"] + inputs["INPUT1"], out["OUTPUT0"])
        assert np.allclose(inputs["INPUT0"] - inputs["INPUT1"], out["OUTPUT1"])
        return
    for target in ("add_sub", "pytorch"):  # the model name travels as a BYTES input
        named = {**inputs, "MODEL_NAME": np.array([target], dtype=np.object_)}
        out = model.infer(named, requested_outputs=["OUTPUT0", "OUTPUT1"], request_id="1")
        assert np.allclose(inputs["INPUT0"] + inputs["INPUT1"], out["OUTPUT0"])
        assert np.allclose(inputs["INPUT0"] - inputs["INPUT1"], out["OUTPUT1"])
    undefined = {**inputs, "MODEL_NAME": np.array(["undefined_model"], dtype=np.object_)}
    with pytest.raises(InferenceError) as e:
        model.infer(undefined, requested_outputs=["OUTPUT0", "OUTPUT1"], request_id="1")
    assert "Request for unknown model: 'undefined_model' is not found" in e.value.message()


@pytest.mark.parametrize("name", ["bls_decoupled_sync", "bls_decoupled_async"])
def test_example_bls_decoupled(load: Callable[[str], LoadedModel], name: str) -> None:
    # examples/bls_decoupled/{sync,async}_client.py: SUM is IN * IN (sync: one BLS stream of
    # the square model) or 2 * IN * IN (async: two streams gathered), for 4, 2, 0, 1.
    model = load(name)
    factor = 2 if name == "bls_decoupled_async" else 1
    for value in [4, 2, 0, 1]:
        data = np.array([value], dtype=np.int32)
        out = model.infer({"IN": data}, requested_outputs=["SUM"], request_id="1")
        assert np.allclose(factor * data * data, out["SUM"])


def test_example_repeat(load: Callable[[str], LoadedModel]) -> None:
    # examples/decoupled/repeat_client.py
    in_value, delay_value, wait_value = [4, 2, 0, 1], [1, 2, 3, 4], 5
    responses = list(load("repeat_int32").stream(
        {"IN": np.array(in_value, dtype=np.int32), "DELAY": np.array(delay_value, np.uint32),
         "WAIT": np.array([wait_value], dtype=np.uint32)},
        requested_outputs=["OUT", "IDX"], request_id="0",
    ))  # fmt: skip
    assert len(responses) == len(in_value)
    for i, response in enumerate(responses):
        assert np.array_equal(np.array([in_value[i]], dtype=np.int32), response["OUT"])


def test_example_square(load: Callable[[str], LoadedModel]) -> None:
    # examples/decoupled/square_client.py: value N gives N responses of [N]; 0 gives none.
    model = load("square_int32")
    for value in [4, 2, 0, 1]:
        responses = list(model.stream({"IN": np.array([value], dtype=np.int32)},
                                      requested_outputs=["OUT"], request_id=str(value)))
        assert len(responses) == value
        for response in responses:
            assert np.array_equal(np.array([value], dtype=np.int32), response["OUT"])


def test_example_auto_complete(load: Callable[[str], LoadedModel]) -> None:
    # examples/auto_complete/client.py
    expected_ios = [{"name": n, "data_type": "TYPE_FP32", "dims": [4]}
                    for n in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")]  # fmt: skip
    for name, max_batch_size in (("nobatch_auto_complete", 0), ("batch_auto_complete", 4)):
        config = load(name).config
        assert config["max_batch_size"] == max_batch_size
        for io in config["input"] + config["output"]:
            expected = next(e for e in expected_ios if e["name"] == io["name"])
            assert io["data_type"] == expected["data_type"]
            assert io["dims"] == expected["dims"]


# -- qa/L0_backend_python/python_test.py --------------------------------------------------------


def test_qa_bool(load: Callable[[str], LoadedModel]) -> None:
    input_data = np.array([[True, False, True]], dtype=bool)
    output0 = load("identity_bool").infer({"INPUT0": input_data})["OUTPUT0"]
    assert output0 is not None
    assert np.all(output0 == input_data)


def test_qa_bf16(load: Callable[[str], LoadedModel]) -> None:
    # identity_bf16 asserts inside the model that as_numpy() of its BF16 input raises.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    pytest.importorskip("torch")
    np_input = np.ones([2, 2], dtype=ml_dtypes.bfloat16)
    np_output = load("identity_bf16").infer({"INPUT0": np_input})["OUTPUT0"]
    assert np_output.dtype == np_input.dtype
    assert np.array_equal(np_output, np_input)


def test_qa_init_args(load: Callable[[str], LoadedModel]) -> None:
    # output response in this model is the number of keys in the args
    out = load("init_args").infer({"IN": np.zeros([2, 2], dtype=np.float32)})["OUT"]
    assert out == 7


def test_qa_unicode(load: Callable[[str], LoadedModel]) -> None:
    model = load("string")
    for _ in range(2):
        input_data = np.array([bytes("😀", encoding="utf-8")], dtype=np.bytes_)
        output0 = model.infer({"INPUT0": input_data})["OUTPUT0"]
        assert output0 is not None
        assert output0[0] == input_data


def test_qa_optional_input(load: Callable[[str], LoadedModel]) -> None:
    model = load("optional")
    rng = np.random.default_rng(0)
    for has_input0 in [True, False]:
        for has_input1 in [True, False]:
            inputs = {}
            input0 = rng.integers(0, 100, size=(1,), dtype=np.int32) if has_input0 else None
            input1 = rng.integers(0, 100, size=(1,), dtype=np.int32) if has_input1 else None
            if input0 is not None:
                inputs["INPUT0"] = input0
            if input1 is not None:
                inputs["INPUT1"] = input1
            # The model's default for a missing input is [5].
            a = input0 if input0 is not None else np.array([5], dtype=np.int32)
            b = input1 if input1 is not None else np.array([5], dtype=np.int32)
            out = model.infer(inputs)
            np.testing.assert_equal(out["OUTPUT0"], a + b)
            np.testing.assert_equal(out["OUTPUT1"], a - b)


def test_qa_string(load: Callable[[str], LoadedModel]) -> None:
    # string_fixed answers "123456" (np.bytes_), then an empty np.object_ array, in turn.
    model = load("string_fixed")
    for i in range(4):
        input_data = np.array(["123456"], dtype=np.object_)
        output0 = model.infer({"INPUT0": input_data})["OUTPUT0"]
        assert output0 is not None
        if i % 2 == 0:
            assert output0[0] == input_data.astype(np.bytes_)
        else:
            assert output0.size == 0


def test_qa_non_contiguous(load: Callable[[str], LoadedModel]) -> None:
    shape, new_shape, shape_reorder = [2, 10, 11, 6, 5], [10, 2, 6, 5, 11], [1, 0, 4, 2, 3]
    input_numpy = np.random.default_rng(0).random(shape).astype(np.float32)
    result = load("non_contiguous").infer({"INPUT0": input_numpy})
    assert np.all(input_numpy.reshape(new_shape) == result["OUTPUT0"])
    assert np.all(result["OUTPUT1"] == input_numpy.T)
    assert np.all(np.transpose(input_numpy, shape_reorder) == result["OUTPUT2"])


def test_qa_multi_file(load: Callable[[str], LoadedModel]) -> None:
    # test.sh starts the server with multi_file loaded: initialize raises unless
    # `import file1` and `from . import file2` both work.
    assert load("multi_file").loaded


def test_qa_identity_fp32(load: Callable[[str], LoadedModel]) -> None:
    # python_test.py's _infer_help
    input_data_0 = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    output0 = load("identity_fp32").infer({"INPUT0": input_data_0})["OUTPUT0"]
    assert np.all(input_data_0 == output0)


def test_qa_bls_init_error(load: Callable[[str], LoadedModel]) -> None:
    # bls/test.sh: the server must not start with bls_init_error (BLS in initialize).
    with pytest.raises(ModelLoadError) as e:
        load("bls_init_error")
    assert "BLS is only supported during the 'execute' function." in str(e.value)


def test_qa_argument_validation(load: Callable[[str], LoadedModel]) -> None:
    # argument_validation/test.sh runs test_infer_shm_leak.py: no inputs, and OUTPUT0 == [1]
    # when the unittest.main("model", exit=False) run inside execute passed.
    output0 = load("argument_validation").infer({})["OUTPUT0"]
    assert output0 == [1], "python_unittest failed for model argument_validation"


def test_qa_requested_output_default(load: Callable[[str], LoadedModel]) -> None:
    # io/io_test.py test_requested_output_default (qa add_sub)
    rng = np.random.default_rng(0)
    input0_data, input1_data = (rng.random(16).astype(np.float32) for _ in range(2))
    inputs = {"INPUT0": input0_data, "INPUT1": input1_data}
    model = load("qa_add_sub")
    outputs = model.infer(inputs, requested_outputs=["OUTPUT1"])
    assert len(outputs) == 1
    assert np.allclose(input0_data - input1_data, outputs["OUTPUT1"])
    outputs = model.infer(inputs)  # without requested outputs: all of them
    assert len(outputs) == len(inputs)
    assert np.allclose(input0_data + input1_data, outputs["OUTPUT0"])
    assert np.allclose(input0_data - input1_data, outputs["OUTPUT1"])


# -- qa/L0_backend_python/lifecycle (lifecycle_test.py, test.sh) ----------------------------------


def test_qa_error_code(load: Callable[[str], LoadedModel]) -> None:
    # lifecycle_test.py test_error_code: the gRPC status names the code; here it is the code.
    model = load("error_code")
    for error in ["UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE",
                  "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED", "(default)"]:  # fmt: skip
        with pytest.raises(InferenceError) as e:
            model.infer({"ERROR_CODE": np.array([[error]], dtype=np.object_)})
        if error == "(default)":
            assert e.value.message() == "unrecognized error code: (default)"
            assert e.value.code() is TritonError.INTERNAL
        else:
            assert e.value.message() == "error code: " + error
            assert e.value.code() is getattr(TritonError, error)


def test_qa_batch_error(load: Callable[[str], LoadedModel]) -> None:
    # lifecycle_test.py test_batch_error: three requests in one batch (test.sh's dynamic
    # batcher gathers them); the first and third fail, the second passes.
    rng = np.random.default_rng(0)
    input_datas = [rng.standard_normal((2, 2)).astype(np.float32) for _ in range(3)]
    results = load("execute_error").infer_many([{"IN": x} for x in input_datas])
    assert isinstance(results[0], InferenceError)
    assert isinstance(results[2], InferenceError)
    assert not isinstance(results[1], InferenceError)
    assert np.array_equal(results[1]["OUT"], input_datas[1])


def test_qa_infer_pymodel_error(load: Callable[[str], LoadedModel]) -> None:
    # lifecycle_test.py test_infer_pymodel_error
    input_data = (16384 * np.random.default_rng(0).standard_normal((2, 2))).astype(np.uint32)
    with pytest.raises(InferenceError) as e:
        load("wrong_model").infer({"IN": input_data})
    assert e.value.message().startswith("Failed to process the request(s) for model ")


@pytest.mark.parametrize(
    ("name", "text"),
    [("init_error", "name 'lorem_ipsum' is not defined"),
     ("auto_complete_error", "name 'undefined_variable' is not defined")],
)  # fmt: skip
def test_qa_load_errors(load: Callable[[str], LoadedModel], name: str, text: str) -> None:
    # lifecycle/test.sh: the server fails to start and its log names the Python error.
    with pytest.raises(ModelLoadError) as e:
        load(name)
    assert text in str(e.value)


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_qa_fini_error(
    triton_dir: Path, isolated: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # lifecycle/test.sh: the server stops and its log names finalize's error.
    with ModelRepository(triton_dir) as repo:
        model = repo.load("fini_error", isolated=isolated, timeout=120)
        with caplog.at_level("ERROR", logger="pb_tensor.runtime"):
            model.unload()
    assert any("name 'undefined_variable' is not defined" in r.getMessage()
               for r in caplog.records)  # fmt: skip


# -- both modes give the same results (issue 18 item 4) ---------------------------------------


def test_every_example_gives_the_same_results_in_both_modes(
    models: Callable[[str, bool], LoadedModel],
) -> None:
    for name in _NEEDS:
        _needs(name)
    results: list[list[dict[str, list[Any]]]] = []
    for isolated in (False, True):
        mode: list[dict[str, list[Any]]] = []
        for name in [*NON_DECOUPLED_EXAMPLES, "bls_decoupled_sync", "bls_decoupled_async"]:
            inputs: dict[str, Any] = (
                {"IN": np.array([3], dtype=np.int32)} if "decoupled" in name
                else _add_sub_inputs()
            )  # fmt: skip
            if name == "bls_sync":
                inputs["MODEL_NAME"] = np.array(["add_sub"], dtype=np.object_)
            out = models(name, isolated).infer(inputs)
            mode.append({k: [str(v.dtype), v.shape, v.tolist()] for k, v in out.items()})
        for name in ("repeat_int32", "square_int32"):
            inputs = (
                {"IN": np.array([2], dtype=np.int32)} if name == "square_int32"
                else {"IN": np.array([4, 2], np.int32), "DELAY": np.array([1, 1], np.uint32),
                      "WAIT": np.array([1], np.uint32)}
            )  # fmt: skip
            for response in models(name, isolated).stream(inputs):
                mode.append({k: [str(v.dtype), v.shape, v.tolist()] for k, v in response.items()})
        for name in ("nobatch_auto_complete", "batch_auto_complete"):
            mode.append({"config": [models(name, isolated).config]})
        results.append(mode)
    assert results[0] == results[1]
