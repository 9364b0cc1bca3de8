"""The floor of a grpcio-based server: grpcio's asyncio server (on uvloop where installed, as
``pb-tensor serve`` runs it) answering every ``ModelInfer`` call with the same prebuilt
bytes, the add_sub answer to ``bench_serve.py``'s request: no parsing, no model. What any
server built on grpcio's asyncio server spends per call at least. With ``--pool N``,
grpcio's other server instead: handlers run in a pool of N threads (no event loop), the
floor of a server built on that one.

Usage: ``python grpc_floor.py GRPC_PORT [--pool N]`` (from the project root, with the serve
extra). Run by ``benchmarks/bench_serve.py``.
"""

from __future__ import annotations

import argparse
import asyncio
from concurrent import futures
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


def _serve_pool(port: int, threads: int) -> None:
    answer = _answer()

    def infer(request: bytes, context: Any) -> bytes:
        return answer

    handler = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(infer)})  # fmt: skip
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--pool", type=int, help="grpcio's thread-pool server, N threads")
    args = parser.parse_args()
    if args.pool:
        _serve_pool(args.port, args.pool)
    else:
        try:
            import uvloop

            uvloop.run(_serve(args.port))
        except ImportError:
            asyncio.run(_serve(args.port))
