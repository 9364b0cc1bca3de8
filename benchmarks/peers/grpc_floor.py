"""The floor of a grpcio-based server: grpcio's asyncio server (on uvloop where installed, as
``pb-tensor serve`` runs it) answering every ``ModelInfer`` call with the same prebuilt
bytes, the add_sub answer to ``bench_serve.py``'s request: no parsing, no model. What any
server built on grpcio's asyncio server spends per call at least.

Usage: ``python grpc_floor.py GRPC_PORT`` (from the project root, with the serve extra).
Run by ``benchmarks/bench_serve.py``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc
import numpy as np

from pb_tensor.serve._protos import message


def _answer(n: int = 16) -> bytes:
    a = np.arange(n, dtype=np.float32)
    response = message("ModelInferResponse")(model_name="add_sub", model_version="1", id="1")
    for name, value in (("OUTPUT0", a + a), ("OUTPUT1", a - a)):
        response.outputs.add(name=name, datatype="FP32", shape=[n])
        response.raw_output_contents.append(value.tobytes())
    return bytes(response.SerializeToString())


async def _serve(port: int) -> None:
    answer = _answer()

    async def infer(request: bytes, context: Any) -> bytes:
        return answer

    handler = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(infer)})  # fmt: skip
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(_serve(int(sys.argv[1])))
    except ImportError:
        asyncio.run(_serve(int(sys.argv[1])))
