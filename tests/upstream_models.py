"""Triton's own models, copied byte-for-byte under ``tests/upstream/`` (where each file came
from is in ``tests/upstream/README.md``), and :func:`repository`, which lays them out as a
model repository the way upstream's L0 ``test.sh`` scripts do::

    mkdir -p models/<name>/1/
    cp <source>/model.py models/<name>/1/
    cp <source>/config.pbtxt models/<name>/

Upstream's copies are never edited: a test that needs a change a ``test.sh`` makes (``sed``
on a configuration, a renamed model) passes it as ``config_edit``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["EXAMPLES", "PYTHON_MODELS", "QA_BACKEND_PYTHON", "UPSTREAM", "repository"]

UPSTREAM = Path(__file__).resolve().parent / "upstream"
PYTHON_MODELS = UPSTREAM / "server" / "qa" / "python_models"
"""The server's ``qa/python_models``."""
QA_BACKEND_PYTHON = UPSTREAM / "server" / "qa" / "L0_backend_python"
"""The server's ``qa/L0_backend_python`` (its tests and the models some of them carry)."""
EXAMPLES = UPSTREAM / "python_backend" / "examples"

# qa/L0_backend_python/model_readiness/test.sh's setup_readiness_test_model calls:
# name -> (READINESS_FN_RETURN_VALUE, READINESS_FN_DELAY_SECS)
READINESS_MODELS = {
    "is_ready_fn_returns_true": ("true", "0.1"),
    "is_ready_fn_returns_false": ("false", "0.1"),
    "is_ready_fn_raises_error": ("exception", "0.1"),
    "is_ready_fn_returns_non_boolean": ("non_boolean", "0.1"),
    "is_ready_fn_timeout": ("true", "8"),
    "is_ready_fn_coroutine_returns_true": ("coroutine", "0.1"),
}
"""python_backend's ``examples``."""


def repository(
    dest: Path,
    models: Mapping[str, Path],
    *,
    config_edit: Mapping[str, Callable[[str], str]] | None = None,
    files: Mapping[str, tuple[Path, Path | None]] | None = None,
    model_file: Mapping[str, str] | None = None,
) -> Path:
    """Lay out ``models`` (model name -> upstream folder holding ``model.py`` and, usually,
    ``config.pbtxt``) as a Triton model repository under ``dest``; returns ``dest``.

    Every other file of the folder (a sibling module, as in qa ``multi_file``) goes next to
    ``model.py``, as the copies in upstream's scripts put them. ``config_edit[name]`` rewrites
    that model's configuration text (what a ``sed`` in ``test.sh`` does). A folder laid out
    as a repository entry already (``config.pbtxt`` and ``1/model.py``, as L0 tests carry
    their models) is copied as it is. ``model_file[name]`` names the file of the folder
    that becomes ``model.py`` (``cp model_async.py models/<name>/1/model.py``).

    ``files`` lays out models whose upstream files have other names, as the examples' READMEs
    copy them (``cp examples/bls/sync_model.py models/bls_sync/1/model.py``): model name ->
    (the Python file, copied as ``model.py``; the configuration, copied as ``config.pbtxt``,
    or None for a model that completes its own).

    Raises:
        FileNotFoundError: a source folder or its ``model.py`` is missing, or a file of
            ``files``.
    """
    edits = config_edit or {}
    for name, (py_file, config_file) in (files or {}).items():
        version = dest / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        shutil.copy(py_file, version / "model.py")
        if config_file is not None:
            text = config_file.read_text()
            if name in edits:
                text = edits[name](text)
            (dest / name / "config.pbtxt").write_text(text)
    renames = model_file or {}
    for name, source in models.items():
        if (source / "1" / "model.py").is_file() and not (source / "model.py").is_file():
            shutil.copytree(source / "1", dest / name / "1", dirs_exist_ok=True)
            text = (source / "config.pbtxt").read_text()
            (dest / name / "config.pbtxt").write_text(edits[name](text) if name in edits else text)
            continue
        if not (source / "model.py").is_file():
            raise FileNotFoundError(f"no model.py in upstream folder {source}")
        version = dest / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        for entry in source.iterdir():
            if entry.name == "config.pbtxt":
                text = entry.read_text()
                if name in edits:
                    text = edits[name](text)
                (dest / name / "config.pbtxt").write_text(text)
            elif entry.is_file() and entry.suffix == ".py":
                shutil.copy(entry, version / entry.name)
            elif entry.is_dir() and entry.name != "__pycache__":
                shutil.copytree(entry, version / entry.name, dirs_exist_ok=True)
        if name in renames:
            shutil.copy(source / renames[name], version / "model.py")
    return dest
