"""``python -m pb_tensor run`` and ``python -m pb_tensor check``: run a model of a repository
from the command line, and lint a whole repository."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from pb_tensor.runtime._cli_check import check, input_value
from pb_tensor.runtime._cli_log import add_log_arguments, logging_to_stderr

__all__ = ["COMMANDS", "add_subcommands", "demo_rows", "main", "run_command"]

COMMANDS = ("run", "check")


def add_subcommands(subparsers: Any) -> None:
    """Add ``run`` and ``check`` to the ``pb-tensor`` command's subparsers (the object
    ``ArgumentParser.add_subparsers()`` returns); :func:`run_command` runs them."""
    run = subparsers.add_parser(
        "run", help="run one request on a model of a repository and print its outputs",
        description="Run one request on a model (in a stub process unless --in-process) and "
                    "print each output's name, datatype, shape and values.",
    )  # fmt: skip
    run.add_argument("repository", help="model repository directory")
    run.add_argument("model", help="model name")
    run.add_argument(
        "--input", "-i", action="append", default=[], metavar="NAME=VALUE",
        help="an input: NAME=FILE.npy, or NAME=JSON (a number, a list, nested lists, strings "
             "for BYTES); JSON values take the dtype of the model configuration",
    )  # fmt: skip
    run.add_argument("--output", "-o", action="append", default=[], metavar="NAME",
                     help="request only this output (repeatable; default: all)")
    run.add_argument("--param", "-p", action="append", default=[], metavar="KEY=JSON",
                     help="a request parameter (bool, int or string as JSON)")
    run.add_argument("--version", type=int, default=None, help="model version (default latest)")
    run.add_argument("--in-process", action="store_true",
                     help="run the model in this process instead of a stub process")
    run.add_argument("--timeout", type=float, default=None, help="execute timeout in seconds")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    add_log_arguments(run)
    check = subparsers.add_parser(
        "check", help="load every model of a repository and report what is wrong",
        description="Load every model of a repository (configuration, auto_complete_config, "
                    "initialize) and print one line per model; with --smoke, also run one "
                    "request on each. Exit status 1 if any fails.",
    )  # fmt: skip
    check.add_argument("repository", help="model repository directory")
    check.add_argument("--in-process", action="store_true",
                       help="load the models in this process instead of stub processes")
    check.add_argument(
        "--smoke", action="store_true",
        help="run one request on each model (a stream for decoupled ones) with inputs built "
             "from its configuration: ones for numbers, b'1' for BYTES, -1 dims as 1, a batch "
             "of 1, optional inputs left out",
    )  # fmt: skip
    check.add_argument(
        "--input", "-i", action="append", default=[], metavar="MODEL:NAME=VALUE",
        help="with --smoke, use this value for input NAME of model MODEL (VALUE as in run's "
             "--input: FILE.npy or JSON), e.g. -i 'add_sub:INPUT0=[1, 2, 3, 4]'",
    )  # fmt: skip
    check.add_argument("--timeout", type=float, default=60.0,
                       help="execute timeout in seconds of each smoke request (default 60)")
    add_log_arguments(check)


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed ``run`` or ``check`` command; its exit status."""
    try:
        with logging_to_stderr(args.log_level):
            if args.command == "run":
                return _run(args)
            return check(args)
    except ImportError as exc:  # protobuf missing: say what to install
        sys.stderr.write(f"error: {exc}\n")
        return 1


def _jsonable(array: np.ndarray[Any, Any]) -> list[Any] | Any:
    if array.dtype == object:
        return [
            v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else v
            for v in array.reshape(-1).tolist()
        ]
    return array.tolist()


def _describe(outputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
    from pb_tensor import numpy_to_triton_type

    described = {}
    for name, array in outputs.items():
        dtype = numpy_to_triton_type(array.dtype)
        described[name] = {
            "datatype": "BYTES" if array.dtype == object else (
                dtype.wire_name if dtype is not None else str(array.dtype)
            ),
            "shape": list(array.shape),
            "data": _jsonable(array),
        }  # fmt: skip
    return described


def _print_outputs(described: dict[str, Any], out: TextIO) -> None:
    for name, item in described.items():
        out.write(f"{name}  {item['datatype']}  {item['shape']}  {item['data']}\n")


def _run(args: argparse.Namespace) -> int:
    from pb_tensor.runtime import InferenceError, ModelLoadError, ModelRepository

    try:
        with ModelRepository(args.repository) as repo, repo.load(
            args.model, version=args.version, isolated=not args.in_process, timeout=args.timeout
        ) as model:
            inputs = dict(input_value(s, model.config) for s in args.input)
            params = {}
            for p in args.param:
                key, sep, text = p.partition("=")
                if not sep:
                    raise ValueError(f"--param {p!r}: expected KEY=JSON")
                params[key] = json.loads(text)
            kwargs: dict[str, Any] = {"requested_outputs": args.output or None,
                                      "parameters": params}
            if model.decoupled:
                responses = [_describe(o) for o in model.stream(inputs, **kwargs)]
            else:
                responses = [_describe(model.infer(inputs, **kwargs))]
    except (InferenceError, ModelLoadError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except (ValueError, TypeError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    if args.json:
        body: dict[str, Any] = {"model_name": args.model}
        if model.decoupled:
            body["responses"] = [{"outputs": r} for r in responses]
        else:
            body["outputs"] = responses[0]
        sys.stdout.write(json.dumps(body) + "\n")
        return 0
    for i, described in enumerate(responses):
        if model.decoupled:
            sys.stdout.write(f"response {i}\n")
        _print_outputs(described, sys.stdout)
    return 0


def main(argv: Sequence[str]) -> int:
    """``run`` / ``check`` entry point; the exit status (1: a model failed, 2: bad usage)."""
    parser = argparse.ArgumentParser(
        prog="pb-tensor", description="Run Triton Python models without a server."
    )
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(list(argv)))


def demo_rows() -> list[tuple[str, bool, str]]:
    """The example repository run in both modes: ``(step, ok, detail)`` rows for the demo.

    Raises:
        FileNotFoundError: the example repository is not next to the package (an installed
            wheel has none).
        ImportError: protobuf is not installed (the ``runtime`` extra).
    """
    from pb_tensor.runtime import ModelRepository, example_repository

    path = example_repository()
    rows: list[tuple[str, bool, str]] = []
    a = np.arange(4, dtype=np.float32)
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("add_sub", {"INPUT0": a, "INPUT1": a}, "OUTPUT0"),
        ("string_identity", {"INPUT0": ["hello"]}, "OUTPUT0"),
        ("bls_add_sub", {"INPUT0": a, "INPUT1": a}, "OUTPUT1"),
        ("auto_complete", {"INPUT0": a.reshape(1, 4)}, "OUTPUT0"),
        ("decoupled_repeat", {"N": np.array([3], np.int32)}, "OUT"),
    ]
    if importlib.util.find_spec("torch") is not None:
        cases.append(("torch_dlpack", {"INPUT0": a}, "ZERO_COPY"))
    with ModelRepository(path) as repo:
        for isolated in (True, False):
            mode = "stub process" if isolated else "in-process"
            for name, inputs, output in cases:
                try:
                    with repo.load(name, isolated=isolated, timeout=60) as model:
                        if model.decoupled:
                            got = [o[output].tolist() for o in model.stream(inputs)]
                        else:
                            got = model.infer(inputs)[output].tolist()
                    rows.append((f"{name} ({mode})", True, f"{output} = {got}"))
                except Exception as exc:  # a demo row reports, it does not abort the tour
                    rows.append((f"{name} ({mode})", False, f"{type(exc).__name__}: {exc}"))
    return rows
