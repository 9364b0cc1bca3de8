"""The server's ``qa`` models that need Triton's schedulers (ensembles, instances, dynamic
batching), byte-for-byte under ``tests/upstream``, run in both modes with the inputs and
assertions of the upstream test that drives each:

* ``qa/L0_backend_python/io`` (``io_test.py``' ``test_ensemble_io``, ``test.sh``' ``default``
  trial): ``ensemble_io`` over three copies of ``dlpack_io_identity`` (the later two call
  the first through BLS), with the one combination of ``GPU_OUTPUT`` flags a CPU runs
  (every model's output on the host); the combinations that move a tensor to a GPU need
  CUDA and are skipped without one.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from upstream_models import PYTHON_MODELS, QA_BACKEND_PYTHON, repository

from pb_tensor.runtime import ModelRepository

pytest.importorskip("google.protobuf")


def _sed_name(name: str) -> Callable[[str], str]:
    """test.sh's ``sed -i "s/^name:.*/name: \"<name>\"/" config.pbtxt``"""

    def edit(text: str) -> str:
        return "\n".join(f'name: "{name}"' if line.startswith("name:") else line
                         for line in text.split("\n"))  # fmt: skip

    return edit


def _cuda_visible() -> bool:
    torch = pytest.importorskip("torch")
    return bool(torch.cuda.is_available())


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_upstream_ensemble_io(tmp_path: Path, isolated: bool) -> None:
    # qa/L0_backend_python/io/test.sh, trial "default": dlpack_io_identity_{1,2,3} (the name
    # sed into each config) and ensemble_io; io_test.py's _run_ensemble_test("ensemble_io").
    pytest.importorskip("torch")
    names = [f"dlpack_io_identity_{i}" for i in (1, 2, 3)]
    root = repository(tmp_path / "models", dict.fromkeys(names, PYTHON_MODELS / "dlpack_io_identity"),
                      config_edit={n: _sed_name(n) for n in names})  # fmt: skip
    (root / "ensemble_io" / "1").mkdir(parents=True)
    shutil.copy(PYTHON_MODELS / "ensemble_io" / "config.pbtxt", root / "ensemble_io")
    assert (QA_BACKEND_PYTHON / "io" / "io_test.py").is_file()
    gpu_flags = [(True, False), (True, False), (True, False)]
    combinations = list(itertools.product(*gpu_flags))
    if not _cuda_visible():
        combinations = [c for c in combinations if not any(c)]
    with ModelRepository(root) as repo:
        for name in names:
            repo.load(name, isolated=isolated)
        model = repo.load("ensemble_io", isolated=isolated)
        input0 = np.random.random([1000]).astype(np.float32)
        for model_1_in_gpu, model_2_in_gpu, model_3_in_gpu in combinations:
            gpu_output = np.asarray([model_1_in_gpu, model_2_in_gpu, model_3_in_gpu], dtype=bool)
            result = model.infer({"INPUT0": input0, "GPU_OUTPUT": gpu_output})
            output0 = result["OUTPUT0"]
            assert output0 is not None
            assert np.all(output0 == input0)
