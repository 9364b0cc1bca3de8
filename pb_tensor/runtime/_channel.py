"""The control channel between the runtime and a stub process.

Small control messages travel pickled over a local socket pair; tensors never do. Each
message is ``(kind, handles, body)``: ``handles`` are records the sender saved in the shared
``SharedMemoryPool`` (Triton's record layout), which the receiver loads zero-copy as
``Tensor`` objects before anything else reads the message.

Record lifetime: the sender keeps the saving tensors alive until the receiver has loaded them.
Every message carries the sequence number of the last message its sender received (and so
loaded); the peer drops what it held for messages up to that number. This is correct whether
a loaded record takes over the saver's reference or holds one of its own.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from pb_tensor import MemoryType, Tensor
from pb_tensor.errors import TritonModelException
from pb_tensor.shm import SharedMemoryPool

__all__ = ["Channel", "ChannelClosed", "Message"]

Message = tuple[str, list[Tensor], Any]
"""A received message: kind, the tensors it carried (loaded), and its body."""


class ChannelClosed(Exception):
    """The peer process went away (exited, crashed or closed its end)."""


class Channel:
    """One end of a stub's control channel (thread-safe for senders; one reader)."""

    def __init__(self, conn: Connection, pool: SharedMemoryPool) -> None:
        self.conn = conn
        self.pool = pool
        self._send_lock = threading.Lock()
        self._out_seq = 0
        self._in_seq = 0
        self._held: deque[tuple[int, object]] = deque()

    def send(self, kind: str, body: Any = None, tensors: Sequence[Tensor] = ()) -> None:
        """Save ``tensors`` into the pool (once each) and send the message.

        Raises:
            ChannelClosed: the peer is gone.
            TritonModelException: a tensor cannot be saved (pool exhausted) or is in GPU memory.
        """
        for t in tensors:
            if t.memory_type == MemoryType.GPU:
                # The runtime refuses these earlier with the model's name; this keeps any
                # other path from sharing GPU memory whose lifetime nobody would track.
                raise TritonModelException(
                    f"tensor '{t.name()}' is in GPU memory: tensors cross between the runtime "
                    "and its stub processes in host memory only"
                )
        handles = tuple(t.save_to_shared_memory(self.pool) for t in tensors)
        with self._send_lock:
            self._out_seq += 1
            if tensors:
                self._held.append((self._out_seq, list(tensors)))
            try:
                self.conn.send((self._out_seq, self._in_seq, kind, handles, body))
            except (OSError, EOFError, ValueError) as exc:
                _reraise_foreign(exc)
                raise ChannelClosed(str(exc)) from None

    def poll(self, timeout: float | None) -> bool:
        """Whether a message (or the peer's end of stream) is ready within ``timeout``."""
        try:
            return bool(self.conn.poll(timeout))
        except (OSError, EOFError, ValueError) as exc:
            _reraise_foreign(exc)
            return True

    def recv(self) -> Message:
        """The next message, its tensors loaded (blocks).

        Raises:
            ChannelClosed: the peer is gone.
        """
        try:
            seq, acked, kind, handles, body = self.conn.recv()
        except (OSError, EOFError, ValueError) as exc:
            _reraise_foreign(exc)
            raise ChannelClosed(str(exc) or "end of stream") from None
        tensors = [Tensor.load_from_shared_memory(self.pool, h) for h in handles]
        with self._send_lock:
            self._in_seq = seq
            held = self._held
            while held and held[0][0] <= acked:
                held.popleft()
        return kind, tensors, body

    def release_all(self) -> None:
        """Drop every tensor held for the peer (the peer is gone or finished)."""
        with self._send_lock:
            self._held.clear()

    def close(self) -> None:
        """Close the socket (the peer sees end of stream)."""
        self.conn.close()


def _reraise_foreign(exc: BaseException) -> None:
    """Raise ``exc`` again when it is not the socket's: an ``OSError`` subclass without an
    errno (a ``TimeoutError`` a signal handler raised while this thread waited) belongs to
    the caller and must reach it; the peer did not go away. (``multiprocessing`` raises
    plain ``OSError`` texts, a broken stream's, without one.)"""
    if isinstance(exc, OSError) and exc.errno is None and type(exc) is not OSError:
        raise exc
