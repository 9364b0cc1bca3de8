"""Triton's own ensemble configuration tests: qa ``L0_model_config``'s
``autofill_noplatform/ensemble`` cases (each must fail to load with one of its ``expected``
messages) and ``autofill_noplatform_success/ensemble`` cases (each must load with the
configuration its ``expected`` file holds, as ``compare_status.py`` checks).

Their composing models use Triton's ``identity`` (and ``repeat``) test backends; as
``test.sh`` lays the repositories out, each gets a version directory, and here a Python
``model.py`` doing what the identity backend does (output ``i`` is input ``i``), its
``backend:`` line changed to ``"python"``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from upstream_models import UPSTREAM

from pb_tensor.runtime import ModelLoadError, ModelRepository

pytest.importorskip("google.protobuf")

MODEL_CONFIG = UPSTREAM / "server" / "qa" / "L0_model_config"
FAILING = sorted(p.name for p in (MODEL_CONFIG / "autofill_noplatform" / "ensemble").iterdir())
SUCCEEDING = sorted(
    p.name for p in (MODEL_CONFIG / "autofill_noplatform_success" / "ensemble").iterdir()
)

IDENTITY = '''
import json
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's identity test backend: output i is input i."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.names = [(i["name"], o["name"]) for i, o in zip(config["input"], config["output"])]

    def execute(self, requests):
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor(o, pb_utils.get_input_tensor_by_name(r, i).as_numpy())
            for i, o in self.names]) for r in requests]
'''


def _lay_out(target_dir: Path, root: Path) -> None:
    """test.sh: a folder with a config.pbtxt is one model, any other a whole repository; the
    models test.sh gives a version directory get one (here: every model but a lone one)."""
    if (target_dir / "config.pbtxt").is_file():
        shutil.copytree(target_dir, root / target_dir.name)
        return
    for model in target_dir.iterdir():
        if not model.is_dir():
            continue
        shutil.copytree(model, root / model.name)
        (root / model.name / "1").mkdir(exist_ok=True)
        config = root / model.name / "config.pbtxt"
        text = config.read_text()
        for backend in ('backend: "identity"', 'backend: "repeat"'):
            if backend in text:
                config.write_text(text.replace(backend, 'backend: "python"'))
                (root / model.name / "1" / "model.py").write_text(IDENTITY)


@pytest.mark.parametrize("target", FAILING)
def test_l0_model_config_ensemble_failures(tmp_path: Path, target: str) -> None:
    target_dir = MODEL_CONFIG / "autofill_noplatform" / "ensemble" / target
    _lay_out(target_dir, tmp_path)
    expecteds = [p.read_text().strip() for p in sorted(target_dir.glob("expected*"))]
    with ModelRepository(tmp_path) as repo, pytest.raises(ModelLoadError) as info:
        repo.load(target, isolated=False)
    message = re.sub(r"^failed to load model '[^']*'( version \d+)?: ", "", str(info.value))
    # test.sh: grep "$EX" in the server's error lines, for one of the expected files
    assert any(re.search(ex, message) for ex in expecteds), (message, expecteds)


@pytest.mark.parametrize("target", SUCCEEDING)
def test_l0_model_config_ensemble_successes(tmp_path: Path, target: str) -> None:
    from google.protobuf import json_format, text_format

    from pb_tensor.runtime import _schema

    target_dir = MODEL_CONFIG / "autofill_noplatform_success" / "ensemble" / target
    _lay_out(target_dir, tmp_path)
    with ModelRepository(tmp_path) as repo:
        model = repo.load(target, isolated=False)
        # compare_status.py: the model's configuration equals an expected one (HTTP: as JSON)
        got = json.loads(json.dumps(model.config))
        matched = False
        for expected_file in sorted((tmp_path / target).glob("expected*")):
            expected = text_format.Parse(expected_file.read_text(), _schema.new_config())
            if expected == _schema.config_from_dict(got, where=target):
                matched = True
            as_json = json.loads(json_format.MessageToJson(expected,
                                                           preserving_proto_field_name=True))
            assert as_json["name"] == got["name"]
        assert matched, got
        # The identity steps give the input back, in the ensemble's output shape.
        batch = [1] if got["max_batch_size"] > 0 else []
        shapes = {i["name"]: batch + [1 if d == -1 else int(d) for d in i["dims"]]
                  for i in got["input"]}  # fmt: skip
        inputs = {n: np.arange(np.prod(s), dtype=np.float32).reshape(s)
                  for n, s in shapes.items()}  # fmt: skip
        out = model.infer(inputs)
        assert set(out) == {o["name"] for o in got["output"]}
        for name, value in out.items():
            np.testing.assert_array_equal(value.ravel(), np.arange(value.size), err_msg=name)


# -- qa/L0_decoupled: decoupled steps inside ensembles ------------------------------------------
L0_DECOUPLED = UPSTREAM / "server" / "qa" / "L0_decoupled"
DECOUPLED_EXAMPLES = UPSTREAM / "python_backend" / "examples" / "decoupled"

# test.sh copies qa's libtorch_nobatch_int32_int32_int32 with its dims set to [ 1 ]; fan_repeat
# reads its OUTPUT__1, which decoupled_test.py's _fan_validate expects to be 2 * IN for
# INPUT0 == INPUT1: the sum. The same model in Python:
LIBTORCH_NOBATCH_ADD_SUB = (
    """
    name: "libtorch_nobatch_int32_int32_int32"
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] },
            { name: "INPUT1" data_type: TYPE_INT32 dims: [ 1 ] } ]
    output [ { name: "OUTPUT__0" data_type: TYPE_INT32 dims: [ 1 ] },
             { name: "OUTPUT__1" data_type: TYPE_INT32 dims: [ 1 ] } ]
    """,
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT__0", a - b),
                                                   pb_utils.Tensor("OUTPUT__1", a + b)]))
        return out
""",
)


@pytest.fixture(scope="module")
def decoupled_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test.sh's python trial: the ensembles of qa/L0_decoupled/models, repeat_int32 and
    square_int32 from python_backend's decoupled examples (as their README names them),
    identity_int32 with a Python identity model."""
    import textwrap

    root = tmp_path_factory.mktemp("decoupled")
    for model in (L0_DECOUPLED / "models").iterdir():
        shutil.copytree(model, root / model.name)
        (root / model.name / "1").mkdir()
    identity = root / "identity_int32" / "config.pbtxt"
    identity.write_text(identity.read_text().replace('backend: "identity"',
                                                     'backend: "python"'))  # fmt: skip
    (root / "identity_int32" / "1" / "model.py").write_text(IDENTITY)
    for name, stem in (("repeat_int32", "repeat"), ("square_int32", "square")):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(DECOUPLED_EXAMPLES / f"{stem}_model.py", root / name / "1" / "model.py")
        shutil.copy(DECOUPLED_EXAMPLES / f"{stem}_config.pbtxt", root / name / "config.pbtxt")
    config, code = LIBTORCH_NOBATCH_ADD_SUB
    (root / "libtorch_nobatch_int32_int32_int32" / "1").mkdir(parents=True)
    (root / "libtorch_nobatch_int32_int32_int32" / "config.pbtxt").write_text(
        textwrap.dedent(config))
    (root / "libtorch_nobatch_int32_int32_int32" / "1" / "model.py").write_text(code)
    return root


def _fan_validate(result_list: list[dict[str, Any]], data_offset: int, repeat_count: int) -> None:
    # fan_repeat returns "2 * data_offset" as result
    assert len(result_list) == repeat_count
    expected_data = 2 * data_offset
    for j in range(len(result_list)):
        this_data = result_list[j]["OUT"]
        assert len(this_data) == 1
        assert this_data[0] == expected_data
        expected_data += 2


def _nested_validate(result_list: list[dict[str, Any]], data_offset: int,
                     repeat_count: int) -> None:  # fmt: skip
    # if repeat model returns repeat result n, repeat_square-like model
    # will return the same result n times
    expected_len = sum(x for x in range(data_offset, data_offset + repeat_count))
    assert len(result_list) == expected_len
    expected_data = data_offset
    expected_count = expected_data
    for j in range(len(result_list)):
        this_data = result_list[j]["OUT"]
        assert len(this_data) == 1
        assert this_data[0] == expected_data
        expected_count -= 1
        if expected_count == 0:
            expected_data += 1
            expected_count = expected_data


TRIALS = [
    ("repeat_int32", None),
    ("simple_repeat", None),
    ("sequence_repeat", None),
    ("fan_repeat", _fan_validate),
    ("repeat_square", _nested_validate),
    ("nested_square", _nested_validate),
]


@pytest.mark.parametrize(("model_name", "validate_fn"), TRIALS)
@pytest.mark.parametrize("repeat_count", [0, 1, 4])
def test_l0_decoupled_one_to_many(
    decoupled_repository: Path, model_name: str, validate_fn: Any, repeat_count: int
) -> None:
    # decoupled_test.py _decoupled_infer (test_one_to_none / one_to_one / one_to_many with
    # request_count=1), its delays and waits 0 and a data_offset small enough for the square
    # models' sum(range(offset, offset + n)) responses to stay quick.
    data_offset = 5
    input_data = np.arange(start=data_offset, stop=data_offset + repeat_count, dtype=np.int32)
    delay_data = np.ones([repeat_count], dtype=np.uint32) * 0
    wait_data = np.array([0], dtype=np.uint32)
    requested = ["OUT", "IDX"] if validate_fn is None else ["OUT"]
    with ModelRepository(decoupled_repository) as repo:
        model = repo.load(model_name, isolated=False)
        assert model.decoupled
        result_list = list(model.stream({"IN": input_data, "DELAY": delay_data,
                                         "WAIT": wait_data}, requested_outputs=requested))
        if validate_fn is None:
            assert len(result_list) == repeat_count
            expected_data = data_offset
            for j in range(len(result_list)):
                this_data = result_list[j]["OUT"]
                assert len(this_data) == 1
                assert this_data[0] == expected_data
                this_idx = result_list[j]["IDX"]
                assert len(this_idx) == 1
                assert this_idx[0] == j
                expected_data += 1
        else:
            validate_fn(result_list, data_offset, repeat_count)


def test_l0_decoupled_trials_in_stub_processes(decoupled_repository: Path) -> None:
    # The same trials with every model in its stub process (one repository for all).
    data_offset, repeat_count = 5, 3
    inputs = {"IN": np.arange(data_offset, data_offset + repeat_count, dtype=np.int32),
              "DELAY": np.zeros([repeat_count], np.uint32), "WAIT": np.zeros([1], np.uint32)}
    with ModelRepository(decoupled_repository) as repo:
        for model_name, validate_fn in TRIALS:
            requested = ["OUT", "IDX"] if validate_fn is None else ["OUT"]
            result_list = list(repo.load(model_name).stream(inputs, requested_outputs=requested))
            if validate_fn is None:
                assert [r["OUT"].tolist() for r in result_list] == [[5], [6], [7]]
                assert [r["IDX"].tolist() for r in result_list] == [[0], [1], [2]]
            else:
                validate_fn(result_list, data_offset, repeat_count)


# -- qa/L0_optional_input: optional inputs through ensembles -------------------------------------
L0_OPTIONAL_INPUT = UPSTREAM / "server" / "qa" / "L0_optional_input"

# identity_2_float32 runs Triton's identity backend: each provided input comes back as its
# output. The same in Python (its dynamic batching, which the test times, left as configured).
IDENTITY_OPTIONAL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            out = []
            for tidx in ("0", "1"):
                t = pb_utils.get_input_tensor_by_name(r, "INPUT" + tidx)
                if t is not None:
                    out.append(pb_utils.Tensor("OUTPUT" + tidx, t.as_numpy()))
            responses.append(pb_utils.InferenceResponse(out))
        return responses
'''


@pytest.fixture(scope="module")
def optional_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test.sh's layout: every model of qa/L0_optional_input/models with a version folder."""
    root = tmp_path_factory.mktemp("optional")
    for model in (L0_OPTIONAL_INPUT / "models").iterdir():
        shutil.copytree(model, root / model.name, dirs_exist_ok=True)
        (root / model.name / "1").mkdir(exist_ok=True)
    identity = root / "identity_2_float32" / "config.pbtxt"
    identity.write_text(identity.read_text().replace('backend: "identity"',
                                                     'backend: "python"'))  # fmt: skip
    (root / "identity_2_float32" / "1" / "model.py").write_text(IDENTITY_OPTIONAL)
    return root


INPUT_DATA = {"INPUT0": np.ones(shape=(1, 1), dtype=np.float32),
              "INPUT1": np.zeros(shape=(1, 1), dtype=np.float32)}  # fmt: skip
OUTPUTS = {"INPUT0": "OUTPUT0", "INPUT1": "OUTPUT1"}


@pytest.mark.parametrize("provided_inputs", [("INPUT0", "INPUT1"), ("INPUT1",), ("INPUT0",)])
def test_l0_optional_input_ensemble_wrapper(
    optional_repository: Path, provided_inputs: tuple[str, ...]
) -> None:
    # optional_input_test.py test_ensemble_all_inputs / optional_same_input / mix_inputs:
    # check_response's value checks (its timing thresholds and statistics are the dynamic
    # batcher's).
    with ModelRepository(optional_repository) as repo:
        model = repo.load("ensemble_identity_2_float32", isolated=False)
        results = model.infer({n: INPUT_DATA[n] for n in provided_inputs},
                              requested_outputs=[OUTPUTS[n] for n in provided_inputs])
        for provided_input in provided_inputs:
            output_data = results[OUTPUTS[provided_input]]
            assert np.array_equal(output_data, INPUT_DATA[provided_input])


def test_l0_optional_input_ensemble_optional_connecting_tensor(
    optional_repository: Path,
) -> None:
    # optional_input_test.py test_ensemble_optional_connecting_tensor: the request gives only
    # INPUT0, so the first optional_identity step produces no internal_output1, and the
    # second step runs without its optional INPUT1.
    with ModelRepository(optional_repository) as repo:
        model = repo.load("optional_connecting_tensor")
        results = model.infer({"INPUT0": INPUT_DATA["INPUT0"]}, requested_outputs=["OUTPUT0"])
        expected = INPUT_DATA["INPUT0"]
        output_data = results["OUTPUT0"]
        assert np.array_equal(output_data, expected)


# -- qa/L0_parameters: request parameters reach every step ---------------------------------------
L0_PARAMETERS = UPSTREAM / "server" / "qa" / "L0_parameters"


@pytest.mark.parametrize("parameters", [
    {"key1": "value1", "key2": "value2"},
    {"key1": 1, "key2": 2},
    {"key1": 123.123, "key2": 321.321},
    {"key1": True, "key2": "value2"},
])  # fmt: skip
def test_l0_parameters_through_an_ensemble(tmp_path: Path, parameters: dict[str, Any]) -> None:
    # parameters_test.py test_params, its ensemble row (send_request_and_verify with
    # model_name="ensemble", then verify_outputs). test.sh gives identity and ensemble a
    # version folder; identity runs Triton's identity backend, here the Python identity.
    shutil.copytree(L0_PARAMETERS / "model_repository", tmp_path / "models")
    root = tmp_path / "models"
    for name in ("identity", "ensemble"):
        (root / name / "1").mkdir(parents=True, exist_ok=True)
    identity = root / "identity" / "config.pbtxt"
    identity.write_text(identity.read_text().replace('backend: "identity"',
                                                     'backend: "python"'))  # fmt: skip
    (root / "identity" / "1" / "model.py").write_text(IDENTITY)
    with ModelRepository(root) as repo:
        result = repo.load("ensemble", isolated=False).infer(
            {"INPUT0": np.array([1.0], np.float32)}, parameters=parameters)
    expected_headers: dict[str, str] = {}
    keys = result["key"]
    values = result["value"]
    keys = keys.astype(str).tolist()
    expected_keys = list(parameters.keys()) + list(expected_headers.keys())
    assert set(keys) == set(expected_keys)
    # We have to convert the parameter values to string
    expected_values = []
    for expected_value in list(parameters.values()):
        expected_values.append(str(expected_value))
    for value in expected_headers.values():
        expected_values.append(value)
    assert set(values.astype(str).tolist()) == set(expected_values)
