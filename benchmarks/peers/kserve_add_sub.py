"""add_sub for KServe's Python ``ModelServer``: the same numpy computation as the example
repository's add_sub model (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1).

Usage (in an environment with ``kserve``): ``python kserve_add_sub.py HTTP_PORT GRPC_PORT``.
Run by ``benchmarks/bench_serve.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import kserve
from kserve import InferOutput, InferRequest, InferResponse, Model


class AddSub(Model):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.load()

    def load(self) -> bool:
        self.ready = True
        return True

    async def predict(self, payload: InferRequest, headers: Any = None,
                      response_headers: Any = None) -> InferResponse:
        a = payload.inputs[0].as_numpy()
        b = payload.inputs[1].as_numpy()
        binary = bool(payload.from_grpc) is False
        outputs = []
        for name, value in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
            out = InferOutput(name=name, shape=list(value.shape), datatype="FP32")
            out.set_data_from_numpy(value, binary_data=binary)
            outputs.append(out)
        return InferResponse(model_name=self.name, infer_outputs=outputs,
                             response_id=payload.id, use_binary_outputs=binary)


if __name__ == "__main__":
    http_port, grpc_port = int(sys.argv[1]), int(sys.argv[2])
    kserve.ModelServer(http_port=http_port, grpc_port=grpc_port, workers=1).start(
        [AddSub("add_sub")])
