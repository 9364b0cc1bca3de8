"""How much of the machine a measurement had: the share of CPU time that the hypervisor gave
to other guests while it ran (Linux's ``steal`` in ``/proc/stat``).

On a virtual machine whose host is busy, a CPU that went idle comes back only when the
hypervisor schedules it again: every wake-up of a thread or a process on an idle CPU then
waits, for hundreds of microseconds at 20-30% steal. Work that hands requests between
threads and processes (the runtime's batcher, the stub processes, serve) slows down far more
than the steal share itself, and ratios between rows measured at different moments move with
it. The benchmarks print the steal share next to what they measured so that a run on a
contended machine can be recognised as such.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STEAL_NOTICEABLE", "Meter", "Share", "contended_note"]

STEAL_NOTICEABLE = 0.05
"""Steal above this share of CPU time makes wake-up latency, and so the ratios, unreliable."""

# /proc/stat's first line: cpu user nice system idle iowait irq softirq steal ...
_IDLE, _STEAL, _FIELDS = 3, 7, 8


def _cpu_times() -> list[int] | None:
    """The machine's CPU time counters (all CPUs), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < _FIELDS + 1 or fields[0] != "cpu":
        return None
    try:
        return [int(v) for v in fields[1 : _FIELDS + 1]]
    except ValueError:
        return None


@dataclass(frozen=True)
class Share:
    """Shares of the machine's CPU time over an interval (None where unknown)."""

    steal: float | None
    idle: float | None

    def text(self) -> str:
        """``steal 12%``, or ``steal n/a`` where the system does not report it."""
        return "steal n/a" if self.steal is None else f"steal {self.steal * 100:.0f}%"


class Meter:
    """Measures :class:`Share` from its creation (or :meth:`restart`) to :meth:`share`."""

    def __init__(self) -> None:
        self._start = _cpu_times()

    def restart(self) -> None:
        self._start = _cpu_times()

    def share(self) -> Share:
        end = _cpu_times()
        if self._start is None or end is None:
            return Share(None, None)
        spent = [b - a for a, b in zip(self._start, end)]
        total = sum(spent)
        if total <= 0:
            return Share(None, None)
        return Share(spent[_STEAL] / total, spent[_IDLE] / total)


def contended_note(shares: list[Share]) -> str | None:
    """A line for the end of a benchmark's output when any measurement ran with noticeable
    steal; None when none did (or nothing was known)."""
    steals = [s.steal for s in shares if s.steal is not None]
    if not steals or max(steals) <= STEAL_NOTICEABLE:
        return None
    return (f"note: the hypervisor took up to {max(steals) * 100:.0f}% of this machine's CPU "
            f"time during these measurements (steal above {STEAL_NOTICEABLE * 100:.0f}% in "
            f"{sum(s > STEAL_NOTICEABLE for s in steals)} of {len(steals)}): wake-ups waited "
            "for it, so rates read low and ratios between rows are unreliable; run again on "
            "a quiet machine")
