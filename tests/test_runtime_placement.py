"""Where BLS outputs land, as Triton places them, without a GPU: the recording CUDA fake stands
in for the device (tests/cuda_fake.py). In-process, GPU outputs pass through and
``preferred_memory`` copies them where asked; in isolated mode a GPU tensor that would cross
between processes gives a clear error instead.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cuda_fake import FakeCudaRuntime
from placement_models import build_repository

from pb_tensor import MemoryType, Tensor, cuda
from pb_tensor.errors import TritonModelException
from pb_tensor.runtime import InferenceError, LoadedModel, ModelRepository
from pb_tensor.utils import TritonError

pytest.importorskip("google.protobuf", reason="the runtime needs protobuf (the runtime extra)")

IN = {"IN": np.array([3, 1, 4, 1, 5], dtype=np.int32)}
H2D, D2H = int(cuda.MemcpyKind.HOST_TO_DEVICE), int(cuda.MemcpyKind.DEVICE_TO_HOST)
NBYTES = IN["IN"].nbytes


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture
def repo(repo_dir: Path, fake: FakeCudaRuntime) -> Iterator[ModelRepository]:
    with ModelRepository(repo_dir) as r:
        yield r
    gc.collect()
    assert fake.allocations == {}  # every device buffer was freed


def _copies(fake: FakeCudaRuntime) -> list[tuple[Any, ...]]:
    """The allocations, copies and synchronisations recorded since the last call, with the
    device each allocation landed on."""
    out: list[tuple[Any, ...]] = []
    for call in fake.take():
        if call[0] == "cudaMemcpy":
            out.append(("cudaMemcpy", call[3], call[4]))  # bytes, kind
        elif call[0] == "cudaMalloc":
            out.append(("cudaMalloc", call[1]))
        elif call[0] == "cudaStreamSynchronize":
            out.append(("cudaStreamSynchronize", call[1]))
    return out


def _bls(model: LoadedModel, **params: Any) -> tuple[list[int], list[int]]:
    out = model.infer(IN, parameters=params)
    return out["OUT"].tolist(), out["WHERE"].tolist()


def test_gpu_output_passes_through_without_preference(
    repo: ModelRepository, fake: FakeCudaRuntime
) -> None:
    with repo.load("bls_caller", isolated=False) as model:
        values, where = _bls(model, target="gpu_out", source_device=1)
        assert values == IN["IN"].tolist()
        assert where == [0, 1]  # is_cpu() False, on the device the callee produced it
        values, where = _bls(model, target="cpu_out")
        assert where == [1, 0]
        fake.take()
        _bls(model, target="gpu_out", source_device=1)
        # The callee's allocation and upload, then only the caller's own to_host(): the
        # BLS output itself was not copied.
        assert _copies(fake) == [
            ("cudaMalloc", NBYTES), ("cudaMemcpy", NBYTES, H2D), ("cudaMemcpy", NBYTES, D2H)]


def test_preferred_cpu_brings_gpu_outputs_to_the_host(
    repo: ModelRepository, fake: FakeCudaRuntime
) -> None:
    with repo.load("bls_caller", isolated=False) as model:
        _bls(model, target="gpu_out")  # loads the target
        fake.take()
        values, where = _bls(model, target="gpu_out", pref="cpu")
        assert values == IN["IN"].tolist()
        assert where == [1, 0]
        # Callee upload, then the BLS copy to the host; the caller's to_host() is free.
        assert _copies(fake) == [
            ("cudaMalloc", NBYTES), ("cudaMemcpy", NBYTES, H2D), ("cudaMemcpy", NBYTES, D2H)]
        assert _bls(model, target="cpu_out", pref="cpu")[1] == [1, 0]


def test_preferred_gpu_copies_onto_that_device(
    repo: ModelRepository, fake: FakeCudaRuntime
) -> None:
    with repo.load("bls_caller", isolated=False) as model:
        _bls(model, target="cpu_out")
        _bls(model, target="gpu_out")
        fake.take()
        values, where = _bls(model, target="cpu_out", pref="gpu", device=1)
        assert values == IN["IN"].tolist()
        assert where == [0, 1]
        assert _copies(fake) == [
            ("cudaMalloc", NBYTES), ("cudaMemcpy", NBYTES, H2D),
            ("cudaStreamSynchronize", 0),     # the BLS output is complete on the device
            ("cudaMemcpy", NBYTES, D2H),      # the caller's to_host()
        ]  # fmt: skip
        # A GPU output on another device: through the host, onto the preferred one.
        values, where = _bls(model, target="gpu_out", source_device=1, pref="gpu", device=0)
        assert values == IN["IN"].tolist()
        assert where == [0, 0]
        assert _copies(fake) == [
            ("cudaMalloc", NBYTES), ("cudaMemcpy", NBYTES, H2D),   # the callee's output
            ("cudaMemcpy", NBYTES, D2H),                           # to the host
            ("cudaMalloc", NBYTES), ("cudaMemcpy", NBYTES, H2D),   # onto device 0
            ("cudaStreamSynchronize", 0),
            ("cudaMemcpy", NBYTES, D2H),                           # the caller's to_host()
        ]  # fmt: skip
        # Already on the preferred device: passed through.
        values, where = _bls(model, target="gpu_out", source_device=1, pref="gpu", device=1)
        assert where == [0, 1]
        assert _copies(fake) == [
            ("cudaMalloc", NBYTES), ("cudaMemcpy", NBYTES, H2D), ("cudaMemcpy", NBYTES, D2H)]


def test_failed_copy_is_an_error_response(repo: ModelRepository, fake: FakeCudaRuntime) -> None:
    with repo.load("bls_caller", isolated=False) as model:
        _bls(model, target="cpu_out")
        fake.fail("cudaMalloc", 2)
        with pytest.raises(InferenceError) as info:
            _bls(model, target="cpu_out", pref="gpu", device=1)
        assert info.value.message() == (
            "Failed to allocate 20 bytes of CUDA memory on device 1. error: "
            "cudaErrorMemoryAllocation: out of memory"
        )
        assert info.value.code() == TritonError.INTERNAL


def test_infer_returns_gpu_outputs_as_host_arrays(
    repo: ModelRepository, fake: FakeCudaRuntime
) -> None:
    with repo.load("gpu_out", isolated=False) as model:
        out = model.infer(IN)
        assert out["OUT"].tolist() == IN["IN"].tolist()
        assert out["OUT"].flags.writeable


# -- isolated mode: no GPU memory crosses between processes -------------------------------

GPU_RULE = (
    "is in GPU memory (device {device}): a model loaded with isolated=True exchanges tensors "
    "through the shared-memory pool, which carries host memory only (CUDA IPC is not "
    "supported); copy the tensor to the host first (Tensor.to_host()), or load the model with "
    "isolated=False"
)


def test_isolated_gpu_output_is_refused(repo: ModelRepository) -> None:
    with repo.load("gpu_out", timeout=60) as model:
        with pytest.raises(InferenceError) as info:
            model.infer(IN)
        assert info.value.message() == "output 'OUT' of model 'gpu_out' " + GPU_RULE.format(
            device=1)
        assert info.value.code() == TritonError.UNSUPPORTED
        pid = model.pid
        with pytest.raises(InferenceError) as info:  # an empty GPU tensor is refused too
            model.infer({"IN": np.array([], np.int32)}, parameters={"device": 0})
        assert info.value.message() == "output 'OUT' of model 'gpu_out' " + GPU_RULE.format(
            device=0)
        assert model.pid == pid  # the stub keeps serving


def test_isolated_bls_gpu_output_is_refused(repo: ModelRepository) -> None:
    with repo.load("bls_caller", timeout=60) as model:
        with pytest.raises(InferenceError) as info:
            _bls(model, target="gpu_out", source_device=0)
        assert info.value.message() == "output 'OUT' of model 'gpu_out' " + GPU_RULE.format(
            device=0)
        assert info.value.code() == TritonError.UNSUPPORTED


def test_isolated_bls_gpu_input_is_refused(repo: ModelRepository) -> None:
    with repo.load("bls_caller", timeout=60) as model:
        with pytest.raises(InferenceError) as info:
            _bls(model, target="cpu_out", gpu_input=True)
        assert info.value.message() == (
            "input 'IN' of the BLS request to model 'cpu_out' " + GPU_RULE.format(device=0))


def test_isolated_preferred_gpu_is_honoured_in_the_caller(repo: ModelRepository) -> None:
    # The copy onto the GPU happens in the caller's own process: no memory crosses.
    with repo.load("bls_caller", timeout=60) as model:
        values, where = _bls(model, target="cpu_out", pref="gpu", device=1)
        assert values == IN["IN"].tolist()
        assert where == [0, 1]
        assert _bls(model, target="cpu_out")[1] == [1, 0]


def _gpu_input(fake: FakeCudaRuntime) -> Tensor:
    host = IN["IN"]
    buffer = cuda.DeviceBuffer(host.nbytes, device=1)
    cuda.memcpy(buffer.ptr, host.ctypes.data, host.nbytes, cuda.MemcpyKind.HOST_TO_DEVICE,
                device=1)  # fmt: skip
    import dlpack_ctypes as dl

    capsule = dl.export_buffer(buffer, buffer.ptr, host.shape, None, dl.DataType(0, 32, 1),
                               (2, 1))  # fmt: skip
    return Tensor.from_dlpack("IN", capsule)


def test_isolated_gpu_input_is_refused_before_the_stub(
    repo: ModelRepository, fake: FakeCudaRuntime
) -> None:
    with repo.load("cpu_out", timeout=60) as model:
        tensor = _gpu_input(fake)
        assert tensor.memory_type == MemoryType.GPU
        with pytest.raises(InferenceError) as info:
            model.infer({"IN": tensor})
        assert info.value.message() == "input 'IN' of model 'cpu_out' " + GPU_RULE.format(
            device=1)
        assert info.value.code() == TritonError.UNSUPPORTED
        # In-process, the same input reaches the model (and its CPU output comes back).
        with repo.load("cpu_out", isolated=False) as local:
            with pytest.raises(InferenceError) as info:
                local.infer({"IN": tensor})
            assert "Tensor is stored in GPU and cannot be converted to NumPy." in (
                info.value.message())
        del tensor


def test_channel_refuses_gpu_tensors(repo: ModelRepository, fake: FakeCudaRuntime) -> None:
    from multiprocessing import Pipe

    from pb_tensor.runtime._channel import Channel

    ours, theirs = Pipe()
    channel = Channel(ours, repo.pool)
    tensor = _gpu_input(fake)
    with pytest.raises(TritonModelException) as info:
        channel.send("x", None, [tensor])
    assert str(info.value) == (
        "tensor 'IN' is in GPU memory: tensors cross between the runtime and its stub "
        "processes in host memory only"
    )
    assert not theirs.poll(0)
    ours.close()
    theirs.close()
    del tensor


def test_renamed_gpu_and_bf16_inputs_keep_their_memory(fake: FakeCudaRuntime) -> None:
    # infer() renames a Tensor given under another input's name: the same memory under the new
    # name, also for tensors that have no numpy view (GPU, BF16); BYTES goes through numpy.
    import dlpack_ctypes as dl
    from pb_tensor.runtime._values import to_tensor

    host = np.arange(6, dtype=np.int32)
    buffer = cuda.DeviceBuffer(host.nbytes, device=1)
    capsule = dl.export_buffer(buffer, buffer.ptr, host.shape, None, dl.DataType(0, 32, 1),
                               (2, 1))
    gpu = Tensor.from_dlpack("OTHER", capsule)
    renamed = to_tensor("IN", gpu)
    assert (renamed.name(), renamed.is_cpu(), renamed.memory_type_id) == ("IN", False, 1)
    assert renamed.data_ptr == gpu.data_ptr == buffer.ptr
    strings = Tensor("OTHER", np.array([b"a", b"bc"], dtype=object))
    assert to_tensor("IN", strings).as_numpy().tolist() == [b"a", b"bc"]
    torch = pytest.importorskip("torch")
    bf16 = Tensor.from_dlpack("OTHER", torch.arange(4, dtype=torch.bfloat16))
    renamed = to_tensor("IN", bf16)
    assert (renamed.name(), renamed.triton_dtype().name) == ("IN", "TYPE_BF16")
    assert renamed.data_ptr == bf16.data_ptr
    del gpu, renamed, bf16, capsule, buffer
    gc.collect()
