"""Unloads that go on after the call that started them returned, as Triton's model unload
does (``ModelLifeCycle::AsyncUnload``; the model object is destroyed in a detached thread):
the model's requests in flight end and its ``finalize`` runs in a thread of its own, so that
a model may unload (or reload) the model its own request runs on."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["BackgroundUnloads"]


class BackgroundUnloads:
    """Runs unloads in threads of their own and waits for them (a repository's or a
    server's close waits for every one started)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def start(self, name: str, unload: Callable[[], None]) -> None:
        """Run ``unload()`` (the unload of model ``name``) in a daemon thread of its own."""

        def run() -> None:
            try:
                unload()
            finally:
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=run, name=f"pb-tensor-unload-{name}", daemon=True)
        # Started under the lock: a wait() in another thread must not find it unstarted
        # (joining a thread before it started raises). The thread takes the lock only once
        # its unload ended, and start() returns once the thread began.
        with self._lock:
            self._threads.add(thread)
            thread.start()

    def wait(self) -> None:
        """Wait until every unload started (those started meanwhile included) has ended."""
        while True:
            with self._lock:
                running = list(self._threads)
            if not running:
                return
            for thread in running:
                thread.join()
