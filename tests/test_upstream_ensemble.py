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
