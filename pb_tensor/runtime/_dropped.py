"""Response senders the model let go of before they were closed.

Upstream's ``ResponseSender`` destructor deletes the request's response factory: no
response and no final flag come for the request after that. The runtime hears of it from the
sender's ``on_drop`` (which may run inside the garbage collector, in any thread, where no
lock may be taken) through a queue, and a thread of its own tells the request's sink, with
the flags ``FINAL | SENDER_DROPPED``: the request ends (its caller gets
``ResponseSenderDropped``) and its instance is not waited for.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable

from pb_tensor.runtime._seam import InferenceResponse
from pb_tensor.runtime._tracker import FINAL, SENDER_DROPPED

__all__ = ["drop_notice"]

log = logging.getLogger("pb_tensor.runtime")

_Sink = Callable[[int, InferenceResponse | None, int], None]

_drops: queue.SimpleQueue[tuple[_Sink, int]] = queue.SimpleQueue()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def drop_notice(sink: _Sink, index: int) -> Callable[[], None]:
    """The ``on_drop`` of request ``index``'s sender: a reentrant put (``SimpleQueue``), safe
    in a finaliser; the thread that passes it on to ``sink`` runs from now on."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():  # (none yet, or a forked child)
            _thread = threading.Thread(target=_deliver, name="pb-tensor-dropped-senders",
                                       daemon=True)  # fmt: skip
            _thread.start()
    return functools.partial(_drops.put, (sink, index))


def _deliver() -> None:
    while True:
        sink, index = _drops.get()
        try:
            sink(index, None, FINAL | SENDER_DROPPED)
        except Exception:  # the instance is gone (its stub exited): nobody waits any more
            log.debug("the news of a dropped response sender found no listener", exc_info=True)
        del sink  # not kept alive until the next drop
