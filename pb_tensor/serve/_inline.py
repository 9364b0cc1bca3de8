"""Which in-process requests run on the event loop's own thread.

Handing a request to a worker thread and its answer back to the event loop costs two thread
wake-ups (measured on 2 cores: ~70 us of CPU and a quarter of the throughput of a
16-element add_sub over HTTP). A model that has shown it is quick skips them: with
``--in-process --inline-quick-models`` (an opt-in: a model that turns slow holds up every
client while it runs), a request runs on the event loop's thread when its model

- has no scheduler that waits for other requests (no ``dynamic_batching``, no
  ``sequence_batching``, not an ensemble) and is not decoupled,
- has no other request in flight (its instance is free: nothing to wait for), and
- ran its last :data:`WARMUP` requests, on worker threads, each within :data:`FAST_NS`.

A request that runs on the loop's thread and takes longer than :data:`SLOW_NS` (wall time:
a model that waits holds up the loop as one that computes; the bar is well above
:data:`FAST_NS` because a thread waits for the GIL up to 5 ms under load) sends the model's
requests back to the worker threads and through the warm-up again; the
:data:`STRIKES`-th such request, for good. The first run of a model on each thread does
not count (measured, it can take ~0.3 ms where the next takes 0.04). A model that turns
slow holds up the event loop (other clients, health checks) at most that many times.

While such a request runs, the loop is hidden (:func:`run_outside_loop`): the model finds no
running asyncio loop, as in Triton's stub, so ``asyncio.run`` inside ``execute`` works.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pb_tensor.runtime import LoadedModel

__all__ = ["FAST_NS", "SLOW_NS", "STRIKES", "WARMUP", "InlinePolicy", "run_outside_loop",
           "waits_for_others"]

_T = TypeVar("_T")

FAST_NS = 500_000
"""Longest run (nanoseconds, from the request's start to its response) that counts as
quick."""

SLOW_NS = 20_000_000
"""A run on the loop's thread longer than this (nanoseconds) is a strike against the model."""

WARMUP = 16
"""Quick runs on worker threads before a model's requests may run on the loop's thread."""

STRIKES = 2
"""Slow runs on the loop's thread after which a loaded model's requests never run there."""


def run_outside_loop(fn: Callable[[], _T]) -> _T:
    """Call ``fn`` on the event loop's thread with no running loop set, then set it back:
    a model's ``execute`` sees what it sees in Triton's stub (``asyncio.get_running_loop()``
    raises, ``asyncio.run`` works). Raises what ``fn`` raises."""
    loop = asyncio.events._get_running_loop()
    asyncio.events._set_running_loop(None)
    try:
        return fn()
    finally:
        asyncio.events._set_running_loop(loop)


def waits_for_others(config: dict[str, Any]) -> bool:
    """Whether a model with this configuration may hold a request back for others (a
    batcher, a sequence, an ensemble's steps)."""
    return ("dynamic_batching" in config or "sequence_batching" in config
            or "ensemble_scheduling" in config or config.get("platform") == "ensemble")


class _Record:
    __slots__ = ("model", "quick", "strikes", "threads")

    def __init__(self, model: LoadedModel, strikes: int) -> None:
        self.model = model
        self.quick = 0  # quick runs in a row
        self.strikes = strikes  # slow runs on a loop's thread
        self.threads: set[int] = set()  # threads that ran it once already


class InlinePolicy:
    """Per loaded model: how many quick runs in a row it has had, and how many of its runs
    on the loop's thread were slow."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, _Record] = {}

    def allowed(self, model: LoadedModel, alone: bool) -> bool:
        """Whether a request of ``model`` may run on the loop's thread now (``alone``: no
        other request of it is in flight)."""
        if not alone:
            return False
        record = self._models.get(model.name)
        if record is None or record.model is not model:
            return False
        return record.strikes < STRIKES and record.quick >= WARMUP

    def record(self, model: LoadedModel, elapsed_ns: int, inline: bool) -> None:
        """One run of ``model`` took ``elapsed_ns``; ``inline``: on the loop's thread."""
        thread = threading.get_ident()
        with self._lock:
            record = self._models.get(model.name)
            if record is None or record.model is not model:
                barred = model.decoupled or waits_for_others(model.config)
                record = self._models[model.name] = _Record(model, STRIKES if barred else 0)
            first = thread not in record.threads
            if first:
                record.threads.add(thread)
            if elapsed_ns <= FAST_NS:
                record.quick = min(record.quick + 1, WARMUP)
            elif not first:
                record.quick = 0
                if inline and elapsed_ns > SLOW_NS:
                    record.strikes += 1
