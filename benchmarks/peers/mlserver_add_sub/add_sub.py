"""add_sub for MLServer: the same numpy computation as the example repository's add_sub
model (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1). Served with
``mlserver start benchmarks/peers/mlserver_add_sub`` (run by ``benchmarks/bench_serve.py``)."""

from __future__ import annotations

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class AddSub(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        a = NumpyCodec.decode_input(payload.inputs[0])
        b = NumpyCodec.decode_input(payload.inputs[1])
        return InferenceResponse(
            model_name=self.name, id=payload.id,
            outputs=[NumpyCodec.encode_output("OUTPUT0", a + b),
                     NumpyCodec.encode_output("OUTPUT1", a - b)],
        )  # fmt: skip
