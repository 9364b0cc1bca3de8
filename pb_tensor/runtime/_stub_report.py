"""What a stub process reports back to the runtime: its log records, the level it must send
at, and how it ended."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import Any

from pb_tensor.runtime._channel import Channel

__all__ = ["ForwardLogs", "emit_record", "how_it_ended", "wanted_log_level"]


def wanted_log_level(model_name: str) -> int:
    """The lowest level a stub must send: that of the runtime's logger or of the model's."""
    return min(
        logging.getLogger("pb_tensor.runtime").getEffectiveLevel(),
        # pb_utils.Logger's records go to this child (pb_tensor.utils' LOGGER_NAME + name).
        logging.getLogger(f"pb_tensor.runtime.model.{model_name}").getEffectiveLevel(),
    )


def how_it_ended(proc: subprocess.Popen[bytes] | None) -> str:
    """`` It exited with code N.`` / `` It was killed by signal N (SIGX).`` for a stub whose
    channel closed; empty when it is still running after a short wait."""
    if proc is None:
        return ""
    try:
        code = proc.wait(5.0)
    except subprocess.TimeoutExpired:
        return ""
    if code >= 0:
        return f" It exited with code {code}."
    try:
        name = f" ({signal.Signals(-code).name})"
    except ValueError:
        name = ""
    return f" It was killed by signal {-code}{name}."


def emit_record(body: dict[str, Any], pid: int | None) -> None:
    """Re-emit a stub's log record in this process's ``logging``."""
    logger = logging.getLogger(body["name"])
    if not logger.isEnabledFor(body["levelno"]):
        return
    pathname = body.get("pathname") or ""
    # makeLogRecord leaves filename and module empty: derive them as LogRecord does, so
    # formats such as pytest's "%(filename)s:%(lineno)d" name the model's file.
    filename = os.path.basename(pathname)
    record = logging.makeLogRecord(
        {**body, "args": None, "exc_info": None, "process": pid, "filename": filename,
         "module": os.path.splitext(filename)[0]}
    )  # fmt: skip
    logger.handle(record)


class ForwardLogs(logging.Handler):
    """Sends this process's ``pb_tensor.runtime`` records to the runtime's ``logging``."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            body = {
                "name": record.name, "levelno": record.levelno,
                "levelname": record.levelname, "msg": record.getMessage(),
                "pathname": record.pathname, "lineno": record.lineno,
                "funcName": record.funcName, "created": record.created,
                "triton_log_level": getattr(record, "triton_log_level", None),
                "reported_to_caller": getattr(record, "reported_to_caller", False),
            }  # fmt: skip
            self.channel.send("log", body)
        except Exception:
            self.handleError(record)
