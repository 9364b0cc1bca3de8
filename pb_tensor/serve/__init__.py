"""``pb-tensor serve``: Triton's HTTP, gRPC and metrics protocol in front of
:mod:`pb_tensor.runtime`, so that Triton's own clients (tritonclient, curl, perf_analyzer)
reach the models of a repository as they reach Triton. See ``docs/serve.md``.

::

    from pb_tensor.serve import Options, Server

    with Server(Options(["path/to/model_repository"], http_port=0, grpc_port=0)) as server:
        ...  # tritonclient.http.InferenceServerClient(server.http_url)

Needs the ``serve`` extra (uvicorn, httptools, uvloop, grpcio, protobuf); nothing else in
pb-tensor imports this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pb_tensor.serve._core import Options
    from pb_tensor.serve._errors import ServeError
    from pb_tensor.serve._server import Server

__all__ = ["Options", "ServeError", "Server"]

_WHERE = {
    "Options": "pb_tensor.serve._core",
    "ServeError": "pb_tensor.serve._errors",
    "Server": "pb_tensor.serve._server",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pb_tensor.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
