"""BLS GPU/CPU placement on a real CUDA device (marked ``gpu``; skipped without one, without
torch's CUDA build, or without protobuf, which loading a model repository needs).

A model returns a torch CUDA tensor through ``Tensor.from_dlpack``; an in-process BLS caller
sees it on the GPU without a preference, on the host with ``TRITONSERVER_MEMORY_CPU``, and a CPU
output lands on the GPU with ``TRITONSERVER_MEMORY_GPU``. In isolated mode the GPU output is
refused with the rule. Needs no hypothesis.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from placement_models import build_repository

from pb_tensor import cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("real_cuda"),
    pytest.mark.skipif(not cuda.is_available(), reason=cuda.unavailable_reason() or "no GPU"),
]

pytest.importorskip("google.protobuf", reason="the runtime needs protobuf (the runtime extra)")
torch: Any = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA here", allow_module_level=True)

from pb_tensor.runtime import InferenceError, LoadedModel, ModelRepository  # noqa: E402

IN = {"IN": np.array([3, 1, 4, 1, 5], dtype=np.int32)}


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[ModelRepository]:
    with ModelRepository(build_repository(tmp_path / "repo")) as r:
        yield r
    gc.collect()


def _bls(model: LoadedModel, **params: Any) -> tuple[list[int], list[int]]:
    out = model.infer(IN, parameters=params)
    return out["OUT"].tolist(), out["WHERE"].tolist()


def test_bls_placement_in_process(repo: ModelRepository) -> None:
    with repo.load("bls_caller", isolated=False) as model:
        assert _bls(model, target="torch_gpu_out") == (IN["IN"].tolist(), [0, 0])
        assert _bls(model, target="torch_gpu_out", pref="cpu") == (IN["IN"].tolist(), [1, 0])
        assert _bls(model, target="cpu_out", pref="gpu", device=0) == (IN["IN"].tolist(), [0, 0])
        assert _bls(model, target="cpu_out") == (IN["IN"].tolist(), [1, 0])


def test_gpu_output_of_in_process_infer_is_copied_to_the_host(repo: ModelRepository) -> None:
    with repo.load("torch_gpu_out", isolated=False) as model:
        assert model.infer(IN)["OUT"].tolist() == IN["IN"].tolist()


def test_isolated_gpu_output_is_refused(repo: ModelRepository) -> None:
    with repo.load("torch_gpu_out", timeout=120) as model:
        with pytest.raises(InferenceError) as info:
            model.infer(IN)
        assert info.value.message().startswith(
            "output 'OUT' of model 'torch_gpu_out' is in GPU memory (device 0): "
        )
    with repo.load("bls_caller", timeout=120) as model:
        assert _bls(model, target="cpu_out", pref="gpu", device=0) == (IN["IN"].tolist(), [0, 0])
