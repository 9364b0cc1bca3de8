"""tritonserver's log settings: the ``--log-*`` flags and the logging extension
(``/v2/logging``, gRPC ``LogSettings``), and its log line format.

The settings switch INFO, WARNING and ERROR records on and off one by one and set the verbose
level (records below INFO: the runtime's verbose lines and ``pb_utils.Logger.log_verbose``),
for the server's own records and those of every model, stubs included, as they change (a stub
learns the level before its next call). ``pb-tensor serve`` writes what passes as tritonserver
does: INFO records to standard output, WARNING and ERROR ones to standard error, or all of
them to ``--log-file``; each a line in tritonserver's format (``default`` or ``ISO8601``) with
the message escaped as a JSON string unless ``TRITON_SERVER_ESCAPE_LOG_MESSAGES=0``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO

from pb_tensor.serve._errors import INTERNAL, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ServeError

__all__ = ["FORMATS", "LogSettings", "TritonFormatter", "install_handlers"]

FORMATS = ("default", "ISO8601")
"""tritonserver's ``--log-format`` values."""

_FILE_REFUSED = "log file location can not be updated through network protocol"


class LogSettings(logging.Filter):
    """The server's log settings; as a ``logging.Filter``, lets through the records they
    switch on. Thread-safe: the endpoints change them while records are written."""

    def __init__(
        self, *, info: bool = True, warning: bool = True, error: bool = True,
        verbose_level: int = 0, log_format: str = "default", log_file: str = "",
    ) -> None:  # fmt: skip
        super().__init__()
        if log_format not in FORMATS:
            raise ValueError(f"invalid argument for --log-format, got: {log_format}")
        self._lock = threading.Lock()
        self.info = info
        self.warning = warning
        self.error = error
        self.verbose_level = verbose_level
        self.log_format = log_format
        self.log_file = log_file
        self._installed = False  # (install_handlers: from then on, apply() sets levels)

    # -- logging.Filter -------------------------------------------------------------------------
    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is written: a verbose one (below INFO) with a verbose level,
        the others as their switch says (ERROR's covers CRITICAL)."""
        level = record.levelno
        if level < logging.INFO:
            return self.verbose_level > 0
        if level < logging.WARNING:
            return self.info
        if level < logging.ERROR:
            return self.warning
        return self.error

    def apply(self) -> None:
        """Once :func:`install_handlers` installed them, make ``pb_tensor``'s loggers produce
        what the settings may write: verbose records only with a verbose level (a stub then
        sends them too). Before that (a ``Server`` embedded in an application) the settings
        change nothing of the application's logging."""
        if not self._installed:
            return
        logging.getLogger("pb_tensor").setLevel(
            logging.DEBUG if self.verbose_level > 0 else logging.INFO
        )

    # -- the logging extension ------------------------------------------------------------------
    def as_json(self) -> dict[str, Any]:
        """The settings as the HTTP endpoint answers them."""
        with self._lock:
            return {
                "log_file": self.log_file,
                "log_info": self.info,
                "log_warning": self.warning,
                "log_error": self.error,
                "log_verbose_level": self.verbose_level,
                "log_format": self.log_format,
            }

    def update_json(self, request: Any) -> None:
        """``POST /v2/logging``: apply the settings a JSON object gives (a null one changes
        nothing), in tritonserver's order, each as it comes (a refused one leaves those
        before it changed, as there).

        Raises:
            ServeError: tritonserver's message for a ``log_file`` (refused), a value of the
                wrong type or an unknown format.
        """
        if not isinstance(request, dict):
            return  # (TritonJson finds no member in a document that is no object)

        def given(name: str) -> Any:
            return request.get(name)

        if given("log_file") is not None:
            raise ServeError(_FILE_REFUSED, UNSUPPORTED)
        with self._lock:
            for name in ("log_info", "log_warning", "log_error"):
                value = given(name)
                if value is None:
                    continue
                if not isinstance(value, bool):
                    raise ServeError("attempt to access JSON non-boolean as boolean", INTERNAL)
                setattr(self, name.removeprefix("log_"), value)
            level = given("log_verbose_level")
            if level is not None:
                if type(level) is not int or level < 0:
                    raise ServeError("attempt to access JSON non-unsigned-integer as "
                                     "unsigned-integer", INTERNAL)  # fmt: skip
                self.verbose_level = min(level, 2**31 - 1)
            log_format = given("log_format")
            if log_format is not None:
                if not isinstance(log_format, str):
                    raise ServeError("attempt to access JSON non-string as string", INTERNAL)
                if log_format not in FORMATS:
                    raise ServeError(f"invalid argument for --log_format, got: {log_format}",
                                     UNAVAILABLE)  # fmt: skip
                self.log_format = log_format
        self.apply()

    def update_grpc(self, settings: Mapping[str, tuple[str | None, Any]]) -> None:
        """gRPC ``LogSettings``: apply the settings of a request (name -> (which of
        ``bool_param`` / ``uint32_param`` / ``string_param`` is set, its value)).

        Raises:
            ServeError: tritonserver's message for a ``log_file`` (refused), a value of the
                wrong kind or an unknown format.
        """
        if "log_file" in settings:
            raise ServeError(_FILE_REFUSED, UNSUPPORTED)
        with self._lock:
            for name in ("log_info", "log_warning", "log_error"):
                if name in settings:
                    kind, value = settings[name]
                    if kind != "bool_param":
                        raise ServeError(f"expect boolean for '{name}'", INVALID_ARG)
                    setattr(self, name.removeprefix("log_"), bool(value))
            if "log_verbose_level" in settings:
                kind, value = settings["log_verbose_level"]
                if kind != "uint32_param":
                    raise ServeError("expect int32 for 'log_verbose_level'", INVALID_ARG)
                self.verbose_level = min(int(value), 2**31 - 1)
            if "log_format" in settings:
                kind, value = settings["log_format"]
                if kind != "string_param":
                    raise ServeError("expect string for 'log_format'", INVALID_ARG)
                if value not in FORMATS:
                    raise ServeError(f"invalid argument for log_format, got: {value}",
                                     INVALID_ARG)  # fmt: skip
                self.log_format = str(value)
        self.apply()


class TritonFormatter(logging.Formatter):
    """tritonserver's log line: ``I1205 09:30:00.123456 <pid> <file>:<line>] <message>``
    (``default``) or ``2026-12-05T09:30:00Z I <pid> <file>:<line>] <message>`` (``ISO8601``),
    as ``settings`` say at each record; the level letter is E, W or I (verbose records
    too); the message (with its traceback) as a JSON string unless
    ``TRITON_SERVER_ESCAPE_LOG_MESSAGES`` is ``0``, as tritonserver escapes it."""

    def __init__(self, settings: LogSettings) -> None:
        super().__init__()
        self._settings = settings
        self._escape = os.environ.get("TRITON_SERVER_ESCAPE_LOG_MESSAGES") != "0"
        self._pid = os.getpid()

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if self._escape:
            message = json.dumps(message, ensure_ascii=False)
        level = "E" if record.levelno >= logging.ERROR else (
            "W" if record.levelno >= logging.WARNING else "I")
        stamp = record.created
        where = f"{self._pid} {os.path.basename(record.pathname)}:{record.lineno}]"
        if self._settings.log_format == "ISO8601":
            iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp))
            return f"{iso} {level} {where} {message}"
        local = time.localtime(stamp)
        micros = int((stamp % 1) * 1_000_000)
        return f"{level}{time.strftime('%m%d %H:%M:%S', local)}.{micros:06d} {where} {message}"


class _Below(logging.Filter):
    """Records below ``level`` only (INFO goes to standard output, the rest to standard
    error, as tritonserver writes them)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self._level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self._level


def install_handlers(settings: LogSettings, out: TextIO | None = None,
                     err: TextIO | None = None) -> list[logging.Handler]:
    """Handlers on the ``pb_tensor`` logger that write what ``settings`` let through, as
    tritonserver writes it (see the module's text); returns them, for removal.

    Raises:
        OSError: ``settings.log_file`` cannot be opened for appending.
    """
    formatter = TritonFormatter(settings)
    handlers: list[logging.Handler] = []
    if settings.log_file:
        handlers.append(logging.FileHandler(settings.log_file, encoding="utf-8"))
    else:
        below = logging.StreamHandler(out if out is not None else sys.stdout)
        below.addFilter(_Below(logging.WARNING))
        above = logging.StreamHandler(err if err is not None else sys.stderr)
        above.setLevel(logging.WARNING)
        handlers += [below, above]
    logger = logging.getLogger("pb_tensor")
    for handler in handlers:
        handler.addFilter(settings)
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    settings._installed = True
    settings.apply()
    return handlers
