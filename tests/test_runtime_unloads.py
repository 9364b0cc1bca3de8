"""``BackgroundUnloads``: a wait that runs while another thread starts an unload never finds
that unload's thread unstarted (joining it would raise), and waits for it."""

from __future__ import annotations

import threading
import time

import pytest

from pb_tensor.runtime._unloads import BackgroundUnloads


def test_a_wait_beside_a_starting_unload(monkeypatch: pytest.MonkeyPatch) -> None:
    # The race CI met (Python 3.12): the thread was registered, then started outside the
    # lock, and a close's wait() joined it in between ("cannot join thread before it is
    # started"). The start is slowed down here so that the wait comes inside that window.
    unloads = BackgroundUnloads()
    starting = threading.Event()
    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        if self.name.startswith("pb-tensor-unload-"):
            starting.set()
            time.sleep(0.2)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    done: list[str] = []
    starter = threading.Thread(target=unloads.start,
                               args=("m", lambda: done.append("unloaded")))  # fmt: skip
    starter.start()
    assert starting.wait(10)
    unloads.wait()  # (raised before: the thread was in the set, not started)
    assert done == ["unloaded"]
    starter.join(10)
