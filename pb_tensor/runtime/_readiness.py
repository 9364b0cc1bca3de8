"""A model instance's readiness, as python_backend's ``TRITONBACKEND_ModelInstanceReady``
checks it: the stub healthy, then the model's own ``is_ready()`` when it defines one.

That check runs beside the model's requests (the stub answers it on a thread of its own,
never waiting for ``execute``), waits at most five seconds for the model's answer
(``kUserModelReadinessTimeoutMs``), and a check asked for while one is in flight waits for
that one's answer instead of asking again (``RunUserModelReadinessCheck``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeAlias

__all__ = [
    "READINESS_TIMEOUT",
    "ReadinessCheck",
    "ReadinessProbe",
    "ReadyState",
    "not_ready_text",
]

READINESS_TIMEOUT = 5.0
"""Seconds a readiness check waits for the model's ``is_ready()`` (python_backend's
``kUserModelReadinessTimeoutMs``)."""

ReadyState: TypeAlias = tuple[bool, str | None]
"""What a model's ``is_ready()`` gave: whether it is ready, and the error text when it raised
or returned something else than a bool (then it is not ready)."""

_TIMED_OUT = "Timed out waiting for user-defined is_ready() response"
_IN_FLIGHT_TIMED_OUT = "Timed out waiting for in-flight is_ready() response"


class ReadinessProbe(Protocol):
    """What :class:`ReadinessCheck` asks an instance's engine."""

    def health(self) -> str | None:
        """None while the instance can run requests, else Triton's text for why not (a
        stub process that is gone)."""
        ...

    @property
    def user_readiness(self) -> bool:
        """Whether the model defines ``is_ready()`` (python_backend looks once, after
        ``initialize``; without one a check asks the model nothing)."""
        ...

    def ask_ready(self, timeout: float, later: Callable[[ReadyState], None]) -> ReadyState | None:
        """The model's ``is_ready()`` answer within ``timeout`` seconds; None when it took
        longer, in which case ``later`` gets the answer once it comes (from another
        thread)."""
        ...


def not_ready_text(instance_name: str, state: ReadyState) -> str | None:
    """None for a ready ``state``, else the error Triton's check gives: the model's error
    text, or ``Model '<instance>' is not ready (user-defined check failed).``."""
    ready, error = state
    if error is not None:
        return error
    if ready:
        return None
    return f"Model '{instance_name}' is not ready (user-defined check failed)."


class ReadinessCheck:
    """The readiness checks of one instance, one model ``is_ready()`` call at a time."""

    __slots__ = ("_cond", "_in_flight", "_last", "timeout")

    def __init__(self, timeout: float = READINESS_TIMEOUT) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._in_flight = False
        self._last: str | None = None
        self.timeout = timeout

    def check(self, probe: ReadinessProbe, instance_name: str) -> str | None:
        """None when the instance is ready, else why not (Triton's text).

        A check that finds another one waiting for the model's answer waits for that
        answer (at most :attr:`timeout` seconds) instead of asking again; a check whose own
        question took longer than :attr:`timeout` says so, and the answer, when it comes,
        goes to the checks waiting for it then.
        """
        unhealthy = probe.health()
        if unhealthy is not None:
            return unhealthy
        if not probe.user_readiness:
            return None
        with self._cond:
            if self._in_flight:
                return self._await_in_flight()
            self._in_flight = True

        def later(state: ReadyState) -> None:
            self._finish(not_ready_text(instance_name, state))

        try:
            state = probe.ask_ready(self.timeout, later)
        except BaseException:
            self._finish("User-defined is_ready() failed with unknown error")
            raise
        if state is None:
            return _TIMED_OUT
        why = not_ready_text(instance_name, state)
        self._finish(why)
        return why

    def _await_in_flight(self) -> str | None:
        """The answer of the check in flight (condition held), or the timeout's text."""
        deadline = time.monotonic() + self.timeout
        while self._in_flight:
            left = deadline - time.monotonic()
            if left <= 0:
                return _IN_FLIGHT_TIMED_OUT
            self._cond.wait(left)
        return self._last

    def _finish(self, why: str | None) -> None:
        with self._cond:
            self._last = why
            self._in_flight = False
            self._cond.notify_all()
