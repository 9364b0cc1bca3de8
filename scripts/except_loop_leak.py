"""Reproduce, without pb-tensor, the CPython 3.13.0 reference leak that keeps frames alive
under a dense storm of asynchronous exceptions (docs/guarantees.md, "The shared-memory pool
under repeated asynchronous exceptions").

A ``SIGALRM`` timer re-armed every 10-25 us raises ``KeyboardInterrupt`` from its handler
whenever the interrupted frame is one of this script's "library" functions below, around a
loop of calls to ``operation()``: an ``except`` clause that runs a loop and then re-raises.
Every object that an ``operation()`` frame refers to should be gone once the calls have ended
and ``gc.collect()`` has run. On CPython 3.13.0 some are not: a ``KeyboardInterrupt`` keeps a
reference that no object accounts for (``sys.getrefcount`` one higher than its referrers),
and with it its traceback, the frames on it and their locals. Measured on a 2-core machine,
120 s a run: 3.13.0 left 3-4 objects within its first 20,000 calls (about 1,000 interrupts)
in each run; 3.12.1 none in 24,980,000 calls (1,004,226 interrupts), 3.11.7 none in
26,260,000 (782,552). On 3.13.0 the same loop placed after the ``except`` clause (not inside
it), or an ``except`` clause that only re-raises, left none in 13-29 million calls.

Usage: ``python scripts/except_loop_leak.py [SECONDS]`` (default 20); prints the version,
the calls made, the interrupts and the objects left; exit status 1 when some are left.
"""

from __future__ import annotations

import gc
import random
import signal
import sys
import time


class Resource:
    """Stands for whatever a library frame refers to (pb-tensor: a pool allocation)."""


def step(box: list[Resource]) -> int:
    return len(box)  # a Python call: a point where CPython runs signal handlers


def operation() -> None:
    box = [Resource()]
    try:
        step(box)
    except BaseException:
        n = 0
        while n < 3:  # its backward jump: another such point, inside the except clause
            n += 1
        raise


_LIBRARY = {operation.__code__, step.__code__}


def main() -> int:
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    rng = random.Random(5)
    delays = [rng.uniform(10e-6, 25e-6) for _ in range(1009)]
    ticks = [0]
    armed = [False]

    def handler(signum: int, frame: object) -> None:
        if not armed[0]:  # a signal still pending after the timer was stopped
            return
        ticks[0] += 1
        signal.setitimer(signal.ITIMER_REAL, delays[ticks[0] % len(delays)])
        if getattr(frame, "f_code", None) in _LIBRARY:
            raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, handler)

    calls, left = 0, 0
    end = time.monotonic() + budget
    while time.monotonic() < end and not left:
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, delays[0])
        for _ in range(20_000):
            try:
                # Plain clauses, not contextlib.suppress: no Python-level __exit__ in the loop.
                try:  # noqa: SIM105
                    operation()
                except KeyboardInterrupt:
                    pass
            except KeyboardInterrupt:  # raised in this frame: not by the handler's rule
                pass
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        calls += 20_000
        for _ in range(3):
            gc.collect()
        left = sum(isinstance(o, Resource) for o in gc.get_objects())
    print(
        f"Python {sys.version.split()[0]}: {calls:,} calls, {ticks[0]:,} interrupts, "
        f"{left} Resource objects left after gc.collect()"
    )
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
