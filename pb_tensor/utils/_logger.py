"""``pb_utils.Logger``: model logging, routed to Python :mod:`logging`."""

from __future__ import annotations

import enum
import logging
from typing import Final

from pb_tensor.utils._backend import get_backend_or_none

__all__ = ["LOGGER_NAME", "LogLevel", "Logger", "model_logger"]

LOGGER_NAME: Final = "pb_tensor.runtime.model"
"""The parent of every model logger; a model's records go to ``LOGGER_NAME + "." + name``
while a runtime serves it, to this logger otherwise."""


class LogLevel(enum.IntEnum):
    """``pb_utils.Logger.LogLevel`` (upstream's values)."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3

    def __str__(self) -> str:
        return self.name


_Level = LogLevel  # annotations inside Logger would otherwise name the class attribute

_TO_LOGGING: Final = {
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    # Triton prints verbose records only with --log-verbose: DEBUG is the counterpart.
    LogLevel.VERBOSE: logging.DEBUG,
}


def model_logger() -> logging.Logger:
    """The logger model records go to now (a child per served model)."""
    backend = get_backend_or_none()
    if backend is None:
        return logging.getLogger(LOGGER_NAME)
    return logging.getLogger(f"{LOGGER_NAME}.{backend.model_name()}")


class Logger:
    """``pb_utils.Logger``: static methods, as upstream (``Logger.log_info("...")``).

    Records carry the caller's file and line (upstream reads them with ``inspect``), go to
    :func:`model_logger` with ``INFO``/``WARNING``/``ERROR``/``DEBUG`` for
    ``INFO``/``WARNING``/``ERROR``/``VERBOSE``, and carry ``triton_log_level`` (the
    ``LogLevel``) so handlers can tell ``VERBOSE`` from other debug records.
    """

    LogLevel = LogLevel
    INFO: Final = LogLevel.INFO
    WARNING: Final = LogLevel.WARNING
    ERROR: Final = LogLevel.ERROR
    VERBOSE: Final = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: _Level = _Level.INFO) -> None:
        """Log ``message`` at ``level``.

        Raises:
            TypeError: ``message`` is not a str or ``level`` not a ``LogLevel``.
        """
        _emit(message, level, "log")

    @staticmethod
    def log_info(message: str) -> None:
        """Log at ``INFO``. Raises TypeError when ``message`` is not a str."""
        _emit(message, LogLevel.INFO, "log_info")

    @staticmethod
    def log_warn(message: str) -> None:
        """Log at ``WARNING``. Raises TypeError when ``message`` is not a str."""
        _emit(message, LogLevel.WARNING, "log_warn")

    @staticmethod
    def log_error(message: str) -> None:
        """Log at ``ERROR``. Raises TypeError when ``message`` is not a str."""
        _emit(message, LogLevel.ERROR, "log_error")

    @staticmethod
    def log_verbose(message: str) -> None:
        """Log at ``VERBOSE`` (``logging.DEBUG``). Raises TypeError when ``message`` is not a
        str."""
        _emit(message, LogLevel.VERBOSE, "log_verbose")


def _emit(message: object, level: object, where: str) -> None:
    if not isinstance(message, str):
        raise TypeError(f"Logger.{where}(): message must be a str, got {type(message).__name__}")
    if not isinstance(level, LogLevel):
        raise TypeError(f"Logger.{where}(): level must be a Logger.LogLevel, got {level!r}")
    logger = model_logger()
    py_level = _TO_LOGGING[level]
    if logger.isEnabledFor(py_level):
        # stacklevel 3: skip _emit and the Logger method, so the record names the model's line.
        logger.log(py_level, message, stacklevel=3, extra={"triton_log_level": level})
