"""pytest plugin (entry point ``pytest11``): the ``triton_repository`` and ``triton_server``
fixtures.

::

    def test_add_sub(triton_repository):
        model = triton_repository("model_repository").load("add_sub")
        assert model.infer({"INPUT0": [1.0], "INPUT1": [2.0]})["OUTPUT0"].tolist() == [3.0]

A relative path is taken from the folder of the test file that asks for the fixture (not the
working directory), so ``triton_repository("models")`` finds ``models/`` next to the test file
wherever pytest is started.

``triton_server(path, **options)`` starts ``pb-tensor serve`` for a repository on free ports
of 127.0.0.1 (in this process, models in stub processes) and returns the running server, whose
``http_url``, ``grpc_url`` and ``metrics_url`` Triton's clients take; it is stopped at
teardown. It needs the ``serve`` extra (the test is skipped without it)::

    def test_over_http(triton_server):
        import tritonclient.http as httpclient

        server = triton_server("model_repository")
        assert httpclient.InferenceServerClient(server.http_url).is_model_ready("add_sub")

Without the installed entry point, enable it with ``-p pb_tensor.runtime.pytest_plugin`` or
``pytest_plugins = ["pb_tensor.runtime.pytest_plugin"]`` in a ``conftest.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pb_tensor.serve import Server

__all__ = ["triton_repository", "triton_server"]


@pytest.fixture
def triton_repository(
    request: pytest.FixtureRequest,
) -> Iterator[Callable[[str | os.PathLike[str]], object]]:
    """A factory ``triton_repository(path) -> ModelRepository``; a relative ``path`` is
    resolved against the requesting test file's folder. Every repository it opened is closed
    at teardown (its models unloaded, their stub processes stopped).

    Raises (from the factory):
        ModelLoadError: ``path`` is not a directory.
    """
    from pb_tensor.runtime import ModelRepository

    opened: list[ModelRepository] = []

    def factory(path: str | os.PathLike[str]) -> ModelRepository:
        repo = ModelRepository(os.path.join(request.path.parent, os.fspath(path)))
        opened.append(repo)
        return repo

    yield factory
    for repo in reversed(opened):
        repo.close()


@pytest.fixture
def triton_server(request: pytest.FixtureRequest) -> Iterator[Callable[..., Server]]:
    """A factory ``triton_server(path, **options) -> pb_tensor.serve.Server``: ``pb-tensor
    serve`` for the repository at ``path`` (relative to the requesting test file's folder),
    started on free ports of 127.0.0.1. ``options`` are :class:`pb_tensor.serve.Options`
    fields (``model_control_mode="explicit"``, ``load_models=[...]``, ``in_process=True``,
    ...). Every server it started is stopped at teardown (requests drained, models
    finalized, stubs stopped, shared memory removed). The test is skipped when the ``serve``
    extra is not installed.

    Raises (from the factory):
        ServeError: a model failed to load (with ``exit_on_error``, the default).
    """
    try:  # imported here: the runtime never imports the front door at import time
        import grpc  # noqa: F401
        import uvicorn  # noqa: F401

        from pb_tensor.serve import Options, Server
    except ImportError as exc:
        pytest.skip(f"triton_server needs the serve extra (pip install 'pb-tensor[serve]'): {exc}")

    started: list[Server] = []

    def factory(path: str | os.PathLike[str], **options: object) -> Server:
        settings: dict[str, Any] = {
            "http_port": 0, "grpc_port": 0, "metrics_port": 0, **options,
        }
        server = Server(Options([os.path.join(request.path.parent, os.fspath(path))],
                                **settings))
        server.start()
        started.append(server)
        return server

    yield factory
    for server in reversed(started):
        server.stop()
