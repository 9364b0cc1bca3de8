"""How much of the machine a measurement had: the share of CPU time during which this
machine's CPUs were ready to run but the hypervisor had not scheduled them (Linux's
``steal`` in ``/proc/stat``).

On a virtual machine, a CPU that went idle comes back only when the hypervisor schedules it
again, and the wait counts as steal. Work that hands requests between threads and processes
(the runtime's batcher, the stub processes, serve) lets CPUs go idle and wakes them thousands
of times a second, so it collects far more steal than a busy loop on the same machine at the
same moment (15-18% in the batching rows of ``bench_runtime.py`` against 2% for two busy
loops and 1% for the rows of a model that sleeps), and more the busier the hypervisor's
other guests keep it. Rates then read low, and ratios between rows measured at different
moments move with it. The benchmarks print the steal share next to what they measured so that
such a run can be recognised.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STEAL_NOTICEABLE", "Meter", "Share", "contended_note"]

STEAL_NOTICEABLE = 0.05
"""Steal above this share of CPU time: wake-ups waited noticeably for the hypervisor."""

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
    return (f"note: steal reached {max(steals) * 100:.0f}% of this machine's CPU time (above "
            f"{STEAL_NOTICEABLE * 100:.0f}% in {sum(s > STEAL_NOTICEABLE for s in steals)} of "
            f"{len(steals)} measurements): its CPUs waited for the hypervisor after going idle, "
            "so hand-overs between threads and processes were slow, rates read low and ratios "
            "between rows measured at different moments are unreliable")
