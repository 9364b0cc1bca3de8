"""pytest plugin (entry point ``pytest11``): the ``triton_repository`` fixture.

::

    def test_add_sub(triton_repository):
        model = triton_repository("model_repository").load("add_sub")
        assert model.infer({"INPUT0": [1.0], "INPUT1": [2.0]})["OUTPUT0"].tolist() == [3.0]

A relative path is taken from the folder of the test file that asks for the fixture (not the
working directory), so ``triton_repository("models")`` finds ``models/`` next to the test file
wherever pytest is started.

Without the installed entry point, enable it with ``-p pb_tensor.runtime.pytest_plugin`` or
``pytest_plugins = ["pb_tensor.runtime.pytest_plugin"]`` in a ``conftest.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

__all__ = ["triton_repository"]


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
