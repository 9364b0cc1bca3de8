"""Log levels of ``run`` and ``check``: one handler that prints the runtime's records (the
models' ``pb_utils.Logger`` records among them) on stderr, each once."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["LEVELS", "add_log_arguments", "logging_to_stderr"]

LEVELS = {
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    # pb_utils.Logger.log_verbose records are DEBUG records (Triton's --log-verbose).
    "verbose": logging.DEBUG,
}
"""``--log-level`` values and the ``logging`` level each stands for."""

_RUNTIME = "pb_tensor.runtime"
_MODELS = "pb_tensor.runtime.model."


def add_log_arguments(parser: Any) -> None:
    """Add ``-v/--verbose`` and ``--log-level`` to a subcommand's parser."""
    parser.add_argument(
        "--log-level", choices=list(LEVELS), default="info",
        help="print the models' pb_utils.Logger records and the runtime's at this level and "
             "above on stderr (default: info, as Triton's default log settings)",
    )  # fmt: skip
    parser.add_argument("-v", "--verbose", dest="log_level", action="store_const",
                        const="verbose", help="same as --log-level verbose")


class _StderrHandler(logging.Handler):
    """Writes to ``sys.stderr`` as it is at each record (``check`` redirects it per model)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "VERBOSE" if record.levelno < logging.INFO else record.levelname
        text = record.getMessage()
        if record.name.startswith(_MODELS):
            where = f"{record.filename}:{record.lineno}" if record.filename else "?"
            return f"{level} model '{record.name[len(_MODELS):]}' ({where}): {text}"
        return f"{level} {text}"


def _not_reported(record: logging.LogRecord) -> bool:
    # Errors the caller also receives as an exception: the command prints those itself.
    return not getattr(record, "reported_to_caller", False)


@contextlib.contextmanager
def logging_to_stderr(level_name: str) -> Iterator[None]:
    """Within the block, the runtime's records at ``level_name`` and above print on stderr as
    ``LEVEL message`` (``LEVEL model 'NAME' (FILE:LINE): message`` for a model's records)."""
    logger = logging.getLogger(_RUNTIME)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter())
    handler.addFilter(_not_reported)
    previous = logger.level
    logger.setLevel(LEVELS[level_name])
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
