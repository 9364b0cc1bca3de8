"""The benchmarks' steal meter (``benchmarks/machine_load.py``): the shares it computes from
``/proc/stat``'s counters, what it says where they are missing, and the note the benchmarks
print when a measurement ran with noticeable steal."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import machine_load
from machine_load import Meter, Share, contended_note


def _counters(values: list[list[int] | None]) -> Iterator[list[int] | None]:
    yield from values


def test_share_is_each_counter_over_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    # user nice system idle iowait irq softirq steal
    readings = _counters([[100, 0, 10, 500, 0, 0, 0, 40],
                          [160, 0, 20, 700, 0, 0, 0, 140]])  # fmt: skip
    monkeypatch.setattr(machine_load, "_cpu_times", lambda: next(readings))
    share = Meter().share()
    # spent: user 60, system 10, idle 200, steal 100 -> 370
    assert share == Share(steal=100 / 370, idle=200 / 370)
    assert share.text() == "steal 27%"


def test_restart_measures_from_then(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = _counters([[0] * 8, [50, 0, 0, 50, 0, 0, 0, 0], [50, 0, 0, 50, 0, 0, 0, 0],
                          [60, 0, 0, 60, 0, 0, 0, 80]])  # fmt: skip
    monkeypatch.setattr(machine_load, "_cpu_times", lambda: next(readings))
    meter = Meter()
    assert meter.share() == Share(steal=0.0, idle=0.5)
    meter.restart()
    assert meter.share() == Share(steal=0.8, idle=0.1)


@pytest.mark.parametrize("readings", [[None, None], [[0] * 8, None], [[5] * 8, [5] * 8]])
def test_unknown_without_counters_or_time(
    monkeypatch: pytest.MonkeyPatch, readings: list[list[int] | None]
) -> None:
    values = _counters(readings)
    monkeypatch.setattr(machine_load, "_cpu_times", lambda: next(values))
    share = Meter().share()
    assert share == Share(None, None)
    assert share.text() == "steal n/a"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc/stat")
def test_real_counters_give_fractions() -> None:
    meter = Meter()
    share = meter.share()
    for _ in range(10_000):  # the counters move once a clock tick (10 ms or less) has passed
        if share.steal is not None:
            break
        sum(range(20_000))
        share = meter.share()
    assert share.steal is not None
    assert share.idle is not None
    assert 0.0 <= share.steal <= 1.0
    assert 0.0 <= share.idle <= 1.0


def test_note_only_past_the_threshold() -> None:
    assert contended_note([]) is None
    assert contended_note([Share(None, None)]) is None
    assert contended_note([Share(0.01, 0.5), Share(0.05, 0.5)]) is None
    note = contended_note([Share(0.01, 0.5), Share(0.18, 0.4), Share(None, None),
                           Share(0.06, 0.3)])  # fmt: skip
    assert note is not None
    assert note.startswith("note: steal reached 18% of this machine's CPU time (above 5% in 2 "
                           "of 3 measurements)")  # fmt: skip
