"""pytest plugin (entry point ``pytest11``): the ``triton_repository`` fixture.

::

    def test_add_sub(triton_repository):
        model = triton_repository("model_repository").load("add_sub")
        assert model.infer({"INPUT0": [1.0], "INPUT1": [2.0]})["OUTPUT0"].tolist() == [3.0]

Without the installed entry point, enable it with ``-p pb_tensor.runtime.pytest_plugin`` or
``pytest_plugins = ["pb_tensor.runtime.pytest_plugin"]`` in a ``conftest.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

__all__ = ["triton_repository"]


@pytest.fixture
def triton_repository() -> Iterator[Callable[[str | os.PathLike[str]], object]]:
    """A factory ``triton_repository(path) -> ModelRepository``; every repository it opened
    is closed at teardown (its models unloaded, their stub processes stopped)."""
    from pb_tensor.runtime import ModelRepository

    opened: list[ModelRepository] = []

    def factory(path: str | os.PathLike[str]) -> ModelRepository:
        repo = ModelRepository(path)
        opened.append(repo)
        return repo

    yield factory
    for repo in reversed(opened):
        repo.close()
