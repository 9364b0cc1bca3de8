"""``python -m pb_tensor check [--smoke]``: load (and run once) every model of a repository,
one row per model, each model's own output captured and shown under its row when it fails."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["check", "input_value", "looks_like_model_folder", "smoke_inputs"]

# A short string for BYTES inputs: models that parse numbers out of text still get one.
_SMOKE_TEXT = b"1"


def input_value(spec: str, config: dict[str, Any]) -> tuple[str, Any]:
    """``NAME=FILE.npy`` or ``NAME=JSON`` as ``(name, value)``; a JSON value takes the dtype
    the model configuration gives input NAME.

    Raises:
        ValueError: malformed, no such file, an object-dtype ``.npy`` (never unpickled), or a
            value that does not convert to the input's dtype (the message names the input).
    """
    from pb_tensor.utils import triton_string_to_numpy

    name, sep, text = spec.partition("=")
    if not sep or not name:
        raise ValueError(f"--input {spec!r}: expected NAME=FILE.npy or NAME=JSON")
    if text.endswith(".npy"):
        if not os.path.isfile(text):
            raise ValueError(f"--input {spec!r}: no such file {text!r}")
        try:
            return name, np.load(text, allow_pickle=False)
        except ValueError as exc:
            if "allow_pickle" not in str(exc):
                raise ValueError(f"--input {spec!r}: {exc}") from None
            raise ValueError(
                f"--input {spec!r}: the file holds an object array, which .npy stores as a "
                "pickle (never loaded here); save BYTES as a fixed-width array "
                "(np.save(path, np.array(values, dtype='S'))) or pass JSON strings "
                f"({name}='[\"a\", \"b\"]')"
            ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--input {spec!r}: not JSON ({exc}) and not a .npy file name"
        ) from None
    types = {i["name"]: i["data_type"] for i in config.get("input", [])}
    if name not in types:
        return name, value
    dtype = triton_string_to_numpy(types[name])
    if dtype is np.object_:
        # BYTES: numbers and booleans become their JSON text, as a client would send them.
        texts = np.asarray(value, dtype=object)
        return name, np.frompyfunc(_as_text, 1, 1)(texts) if texts.ndim else texts
    try:
        return name, np.asarray(value, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(
            f"--input {spec!r}: input '{name}' is {types[name]} in the model configuration: "
            f"{exc}"
        ) from None


def _as_text(value: object) -> object:
    return value if isinstance(value, str) else json.dumps(value)


def smoke_inputs(config: dict[str, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """Inputs for one request built from a model configuration: each required input with its
    dtype and dims (-1 as 1), a batch dimension of 1 when ``max_batch_size`` > 0, ones for
    numbers, ``b"1"`` for BYTES, False for BOOL; optional inputs are left out."""
    from pb_tensor.utils import triton_string_to_numpy

    batch = [1] if int(config.get("max_batch_size", 0)) > 0 else []
    inputs: dict[str, np.ndarray[Any, Any]] = {}
    for spec in config.get("input", []):
        if spec.get("optional"):
            continue
        shape = batch + [1 if int(d) < 0 else int(d) for d in spec.get("dims", [])]
        dtype = triton_string_to_numpy(spec["data_type"])
        if dtype is np.object_:
            inputs[spec["name"]] = np.full(shape, _SMOKE_TEXT, dtype=object)
        elif dtype is np.bool_:
            inputs[spec["name"]] = np.zeros(shape, dtype=np.bool_)
        else:
            inputs[spec["name"]] = np.ones(shape, dtype=dtype)
    return inputs


def looks_like_model_folder(path: str) -> bool:
    """Whether ``path`` holds a ``config.pbtxt`` or a ``model.py`` itself (a model folder,
    not a repository of them)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("config.pbtxt", "model.py")) or (
        any(e.isdigit() and os.path.isfile(os.path.join(path, e, "model.py"))
            for e in os.listdir(path))
    )  # fmt: skip


@contextlib.contextmanager
def _captured() -> Iterator[io.StringIO]:
    """Everything written to stdout and stderr within the block, by this process (Python and
    C level) and by the stub processes started in it (they inherit the descriptors)."""
    text = io.StringIO()
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="backslashreplace") as sink:
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield text
        finally:
            sink.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            text.write(sink.read())


def _overrides(specs: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for spec in specs:
        model, sep, rest = spec.partition(":")
        if not sep or not model or "=" not in rest:
            raise ValueError(f"--input {spec!r}: expected MODEL:NAME=VALUE")
        out.setdefault(model, []).append(rest)
    return out


def _smoke(model: Any, overrides: list[str]) -> str:
    inputs: dict[str, Any] = dict(smoke_inputs(model.config))
    for spec in overrides:
        name, value = input_value(spec, model.config)
        inputs[name] = value
    if model.decoupled:
        return f"{sum(1 for _ in model.stream(inputs))} response(s)"
    outputs = model.infer(inputs)
    return "outputs " + ", ".join(f"{n} {list(a.shape)}" for n, a in outputs.items())


def _one(repo: Any, name: str, args: argparse.Namespace, overrides: list[str]) -> str:
    with repo.load(name, isolated=not args.in_process, timeout=args.timeout) as model:
        config = model.config
        if args.smoke:
            return _smoke(model, overrides)
        ins = ", ".join(i["name"] for i in config.get("input", []))
        outs = ", ".join(o["name"] for o in config.get("output", []))
        mode = "decoupled, " if model.decoupled else ""
        return (f"version {model.version}, {mode}max_batch_size "
                f"{config.get('max_batch_size', 0)}, inputs [{ins}], outputs [{outs}]")  # fmt: skip


def _indented(text: str, by: int, first: bool = False) -> str:
    """``text``'s lines indented by ``by`` spaces (but the first unless ``first``), blank
    lines left empty."""
    lines = text.rstrip().splitlines()
    pad = " " * by
    return "".join(
        (pad if (first or n) and line.strip() else "") + line.rstrip() + "\n"
        for n, line in enumerate(lines)
    )


def check(args: argparse.Namespace) -> int:
    """Run a parsed ``check``; its exit status (1: a model failed or none was found, 2: a
    malformed ``--input``)."""
    from pb_tensor.runtime import InferenceError, ModelLoadError, ModelRepository

    try:
        overrides = _overrides(args.input)
        repo = ModelRepository(args.repository)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except ModelLoadError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    failed = 0
    with repo:
        names = repo.models()
        width = max((len(n) for n in names), default=5)
        for i, name in enumerate(names, 1):
            row = f"[{i}/{len(names)}] {name:<{width}}  "
            sys.stdout.write(row)
            sys.stdout.flush()
            start = time.monotonic()
            error = None
            with _captured() as output:
                try:
                    detail = _one(repo, name, args, overrides.get(name, []))
                except (ModelLoadError, InferenceError, ValueError, TypeError) as exc:
                    error = str(exc)
                finally:
                    # BLS targets this model loaded finalize now, their output in its capture.
                    for target in names:
                        repo.control("unload_model", (target, False), False)
                    repo.wait_for_unloads()
            took = f"({time.monotonic() - start:.1f} s)"
            if error is None:
                sys.stdout.write(f"ok      {took} {detail}\n")
                continue
            failed += 1
            sys.stdout.write(_indented(f"FAILED  {took} {error}", len(row)))
            if output.getvalue().strip():
                sys.stdout.write(_indented("the model's output:", len(row), first=True))
                sys.stdout.write(_indented(output.getvalue(), len(row) + 2, first=True))
        if names:
            sys.stdout.write(f"{len(names)} model(s), {failed} with problems\n")
        elif looks_like_model_folder(repo.path):
            sys.stdout.write(
                f"no models in {repo.path}: it looks like a model folder; pass the repository "
                f"that holds it ({os.path.dirname(repo.path)})\n"
            )
        else:
            sys.stdout.write(f"no models in {repo.path}\n")
    return 1 if failed or not names else 0
