"""``pb-tensor serve``: tritonserver's command line over :class:`Server`."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["add_arguments", "main", "options_from_args"]


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _host_policy(arg: str) -> tuple[str, str, str]:
    # tritonserver's ParseGenericConfigOption: the name ends at the first comma, the
    # setting at the next "=".
    name, comma, rest = arg.partition(",")
    setting, equals, value = rest.partition("=")
    if not comma or not equals or not name or not setting or not value:
        raise argparse.ArgumentTypeError(
            f"--host-policy option format is '<policy name>,<setting>=<value>'. Got {arg}"
        )
    return name, setting, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """tritonserver's flags (the subset ``serve`` implements), with its defaults except the
    addresses (127.0.0.1 here, 0.0.0.0 in tritonserver)."""
    add = parser.add_argument
    add("--model-repository", "--model-store", action="append", default=[], required=True,
        dest="model_repository", metavar="PATH", help="model repository path (repeatable)")
    add("--http-port", type=int, default=8000, help="HTTP port (default 8000; 0: any)")
    add("--grpc-port", type=int, default=8001, help="gRPC port (default 8001; 0: any)")
    add("--metrics-port", type=int, default=8002, help="metrics port (default 8002; 0: any)")
    add("--http-address", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    add("--grpc-address", default="127.0.0.1", help="gRPC address (default 127.0.0.1)")
    add("--metrics-address", default="127.0.0.1", help="metrics address (default 127.0.0.1)")
    for name in ("http", "grpc", "metrics"):
        add(f"--allow-{name}", type=_bool, nargs="?", const=True, default=True,
            metavar="BOOL", help=f"serve {name} (default true)")
    add("--model-control-mode", choices=("none", "explicit", "poll"), default="none",
        help="none: load every model at start; explicit: --load-model and the repository "
             "API; poll: not supported")
    add("--load-model", action="append", default=[], metavar="NAME",
        help="with explicit control, a model to load at start (repeatable; * for all)")
    add("--strict-model-config", type=_bool, nargs="?", const=True, default=False,
        metavar="BOOL", help="refuse models without config.pbtxt (default false)")
    add("--exit-on-error", type=_bool, nargs="?", const=True, default=True, metavar="BOOL",
        help="exit when a model fails to load at start (default true)")
    add("--strict-readiness", type=_bool, nargs="?", const=True, default=True,
        metavar="BOOL", help="the server is ready only while every model it tried to load "
        "is ready (default true)")
    add("--log-verbose", type=int, default=0, metavar="LEVEL",
        help="verbose logging level (0: off)")
    for name in ("info", "warning", "error"):
        add(f"--log-{name}", type=_bool, nargs="?", const=True, default=True, metavar="BOOL",
            help=f"write {name} records (default true)")
    add("--log-format", choices=("default", "ISO8601"), default="default",
        help="log line format (default: default)")
    add("--log-file", default="", metavar="PATH",
        help="write the log to this file (default: info records to standard output, "
             "warnings and errors to standard error)")
    add("--exit-timeout-secs", type=int, default=30, metavar="SECONDS",
        help="how long a stop waits for requests in flight (default 30)")
    for name in ("http", "grpc"):
        add(f"--{name}-header-forward-pattern", default="", metavar="REGEX",
            help=f"{name.upper()} headers whose names match (anywhere, ignoring case; "
                 "(?-i) first: minding it) become string request parameters")
    add("--http-max-input-size", type=int, default=64 * 1024 * 1024, metavar="BYTES",
        help="largest HTTP request body accepted (default 64 MiB)")
    add("--host-policy", action="append", type=_host_policy, default=[],
        metavar="<name>,<setting>=<value>",
        help="a host policy setting (repeatable): cpu-cores=<lower>-<upper>[,...] binds the "
             "stub processes of the instances using policy <name> (an instance group's "
             "host_policy, else cpu, gpu_<device> or model by its kind) to those CPUs")
    add("--in-process", action="store_true",
        help="run the models in this process instead of one stub process each")
    add("--inline-quick-models", type=_bool, nargs="?", const=True, default=False,
        metavar="BOOL",
        help="with --in-process, run a model that has shown it is quick on the event loop's "
             "thread (faster; a model that turns slow then holds up the server while it "
             "runs; default false)")


def options_from_args(args: argparse.Namespace) -> Any:
    """The :class:`Options` of parsed arguments."""
    from pb_tensor.serve._core import Options

    policies: dict[str, dict[str, str]] = {}
    for name, setting, value in args.host_policy:
        policies.setdefault(name, {})[setting] = value
    return Options(
        model_repositories=list(args.model_repository), http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        http_address=args.http_address, grpc_address=args.grpc_address,
        metrics_address=args.metrics_address, allow_http=args.allow_http,
        allow_grpc=args.allow_grpc, allow_metrics=args.allow_metrics,
        model_control_mode=args.model_control_mode, load_models=list(args.load_model),
        strict_model_config=args.strict_model_config, exit_on_error=args.exit_on_error,
        strict_readiness=args.strict_readiness,
        log_verbose=args.log_verbose, log_info=args.log_info, log_warning=args.log_warning,
        log_error=args.log_error, log_format=args.log_format, log_file=args.log_file,
        in_process=args.in_process,
        inline_quick_models=args.inline_quick_models,
        max_input_size=args.http_max_input_size, host_policies=policies,
        exit_timeout_secs=args.exit_timeout_secs,
        http_header_forward_pattern=args.http_header_forward_pattern,
        grpc_header_forward_pattern=args.grpc_header_forward_pattern,
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM or SIGINT; 0 after a clean stop, 1 when it cannot start.

    On a signal: stop accepting requests, wait for those in flight, run every model's
    ``finalize``, stop the stubs, remove the shared memory.
    """
    import importlib.util

    missing = [m for m in ("uvicorn", "grpc", "google.protobuf")
               if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        sys.stderr.write(f"error: pb-tensor serve needs the serve extra (missing: "
                         f"{', '.join(missing)}): pip install -e \".[serve]\" in a clone\n")
        return 1
    from pb_tensor.runtime import ModelLoadError
    from pb_tensor.serve._errors import ServeError
    from pb_tensor.serve._logging import install_handlers
    from pb_tensor.serve._server import Server

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server = Server(options_from_args(args), out=sys.stdout)
            try:
                install_handlers(server.core.log_settings)
            except OSError as exc:
                sys.stderr.write(f"error: creating server: cannot open --log-file "
                                 f"{args.log_file!r}: {exc}\n")
                return 1
            server.start()
        except (ServeError, ModelLoadError) as exc:
            text = exc.message if isinstance(exc, ServeError) else str(exc)
            sys.stderr.write(f"error: creating server: {text}\n")
            return 1
        try:
            while not stop.wait(0.5):
                pass
        finally:
            sys.stdout.write("Stopping: draining requests, unloading models\n")
            sys.stdout.flush()
            server.stop(drain_timeout=max(0, args.exit_timeout_secs))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    """``python -m pb_tensor.serve`` without the ``pb-tensor`` command."""
    parser = argparse.ArgumentParser(prog="pb-tensor serve")
    add_arguments(parser)
    return main(parser.parse_args(argv))
