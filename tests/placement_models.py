"""Models for the tests of where BLS outputs land (GPU / CPU placement): a model whose output is
in GPU memory, an identity model on CPU, and a BLS caller reporting where its BLS output was.

The models reach CUDA through ``pb_tensor.cuda``; where none is usable (a stub process of a
machine without a GPU) they install the recording fake of ``tests/cuda_fake.py``, which the stub
finds on the ``sys.path`` it inherits from the test process.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

CALLER_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "WHERE" data_type: TYPE_INT32 dims: [ 2 ] }
]
"""

HEADER = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils
import dlpack_ctypes as dl
from pb_tensor import cuda


def ensure_cuda():
    if not cuda.is_available():
        import cuda_fake

        cuda.set_runtime(cuda_fake.FakeCudaRuntime(devices=2))


def value(request):
    return pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()


def gpu_tensor(name, host, device):
    # INT32 data in a fresh device allocation, wrapped from a raw DLPack capsule.
    host = np.ascontiguousarray(host, dtype=np.int32)
    buffer = cuda.DeviceBuffer(host.nbytes, device=device)
    if host.nbytes:
        cuda.memcpy(buffer.ptr, host.ctypes.data, host.nbytes, cuda.MemcpyKind.HOST_TO_DEVICE,
                    device=device)
    capsule = dl.export_buffer(buffer, buffer.ptr, host.shape, None, dl.DataType(0, 32, 1),
                               (2, device))
    return pb_utils.Tensor.from_dlpack(name, capsule)
"""

MODELS = {
    # OUT = IN, in the memory of GPU parameters["device"] (default 1).
    "gpu_out": """
        class TritonPythonModel:
            def initialize(self, args):
                ensure_cuda()

            def execute(self, requests):
                responses = []
                for r in requests:
                    device = int(json.loads(r.parameters()).get("device", 1))
                    responses.append(
                        pb_utils.InferenceResponse([gpu_tensor("OUT", value(r), device)]))
                return responses
    """,
    # OUT = IN, on the CPU.
    "cpu_out": """
        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value(r))])
                        for r in requests]
    """,
    # BLS to parameters["target"] with the preference parameters["pref"] ("cpu", "gpu" with
    # parameters["device"], or none); OUT = the BLS output copied to the host, WHERE =
    # [is_cpu(), memory_type_id] of the BLS output. parameters["gpu_input"]: send IN from GPU 0.
    "bls_caller": """
        class TritonPythonModel:
            def initialize(self, args):
                ensure_cuda()

            def execute(self, requests):
                responses = []
                for r in requests:
                    p = json.loads(r.parameters())
                    kw = {}
                    if p.get("pref") == "cpu":
                        kw["preferred_memory"] = pb_utils.PreferredMemory(
                            pb_utils.TRITONSERVER_MEMORY_CPU)
                    elif p.get("pref") == "gpu":
                        kw["preferred_memory"] = pb_utils.PreferredMemory(
                            pb_utils.TRITONSERVER_MEMORY_GPU, int(p.get("device", 0)))
                    if p.get("gpu_input"):
                        inputs = [gpu_tensor("IN", value(r), 0)]
                    else:
                        inputs = [pb_utils.get_input_tensor_by_name(r, "IN")]
                    bls = pb_utils.InferenceRequest(
                        model_name=p["target"], inputs=inputs, requested_output_names=["OUT"],
                        parameters={"device": int(p.get("source_device", 1))}, **kw).exec()
                    if bls.has_error():
                        responses.append(pb_utils.InferenceResponse(error=bls.error()))
                        continue
                    out = pb_utils.get_output_tensor_by_name(bls, "OUT")
                    where = np.array([int(out.is_cpu()), out.memory_type_id], np.int32)
                    responses.append(pb_utils.InferenceResponse([
                        pb_utils.Tensor("OUT", out.to_host().as_numpy()),
                        pb_utils.Tensor("WHERE", where)]))
                    del out, bls
                return responses
    """,
    # OUT = IN through torch on cuda:0 (the real-GPU tests only).
    "torch_gpu_out": """
        import torch

        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(
                            "OUT", torch.from_numpy(value(r).copy()).to("cuda:0"))])
                        for r in requests]
    """,
}


def build_repository(root: Path) -> Path:
    """Write the placement test models under ``root``; returns ``root``."""
    for name, code in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(HEADER + textwrap.dedent(code))
        config = CALLER_CONFIG if name == "bls_caller" else CONFIG
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n' + config)
    return root
