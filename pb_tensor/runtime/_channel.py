"""The control channel between the runtime and a stub process.

Small control messages travel pickled over a local socket pair; tensors never do. Each
message is ``(kind, handles, body)``: ``handles`` are records the sender saved in the shared
``SharedMemoryPool`` (Triton's record layout), which the receiver loads zero-copy as
``Tensor`` objects before anything else reads the message.

Small host tensors (numeric, at most ``PACK_TENSOR_MAX`` bytes each) travel together: the
sender copies them into one ``uint8`` record, the *pack* of the message (each at a 64-byte
aligned offset), and the message names each one's place in it; the receiver loads the pack
once and views each tensor in it. Every record costs several operations under the pool's
cross-process lock on each side (save, load, and the give-back of each reference), which
for a batch of small requests cost more than the model itself; a pack costs the same few
whatever the number of tensors, and the copies it adds are small. Larger tensors, BYTES
and BF16 tensors (serialized, or kept through DLPack) and GPU tensors keep a record each,
so that large data is never copied on the way.

Record lifetime: the sender keeps the saving tensors alive until the receiver has loaded them.
Every message carries the sequence number of the last message its sender received (and so
loaded); the peer drops what it held for messages up to that number. This is correct whether
a loaded record takes over the saver's reference or holds one of its own. A pack needs no
holding: the pending message of its record keeps it until the receiver's load takes it over.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pb_tensor import MemoryType, Tensor, TritonDtype
from pb_tensor.dtypes import numpy_dtype_of
from pb_tensor.errors import TritonModelException
from pb_tensor.shm import SharedMemoryPool, save_record

__all__ = ["PACK_MAX", "PACK_TENSOR_MAX", "Channel", "ChannelClosed", "Message"]

PACK_TENSOR_MAX = 64 << 10
"""The largest tensor (bytes) that travels in its message's pack rather than a record."""
PACK_MAX = 1 << 20
"""The most bytes of tensors one pack holds (the rest of a message's go as records): the
receiver's tensors keep their whole pack alive."""
_ALIGN = 64
_PADS = [bytes(n) for n in range(_ALIGN)]
_CPU = MemoryType.CPU
_UINT8 = int(TritonDtype.TYPE_UINT8)
_ndarray = np.ndarray  # a view of the pack at a tensor's offset: it keeps the pack alive
# The numpy element type of each dtype that travels in packs (by its TritonDtype value);
# BYTES (serialized) and BF16 (kept through DLPack) keep their records.
_PACKED: dict[int, np.dtype[Any]] = {
    int(t): np.dtype(numpy_dtype_of(t)) for t in TritonDtype
    if t not in (TritonDtype.TYPE_BYTES, TritonDtype.TYPE_BF16, TritonDtype.TYPE_INVALID)
}  # fmt: skip
# A tensor's place in its message: a record's handle, or (name, dtype, shape, offset) in
# the pack (the record at the message's pack handle; dtype: the TritonDtype value).
_Place = int | tuple[str, int, tuple[int, ...], int]

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
        places, keep, pack = self._places(tensors) if tensors else ((), (), 0)
        with self._send_lock:
            self._out_seq += 1
            if keep:
                self._held.append((self._out_seq, keep))
            try:
                self.conn.send((self._out_seq, self._in_seq, kind, places, body, pack))
            except (OSError, EOFError, ValueError) as exc:
                _reraise_foreign(exc)
                raise ChannelClosed(str(exc)) from None

    def _places(self, tensors: Sequence[Tensor]) -> tuple[list[_Place], list[Tensor], int]:
        """Save ``tensors`` for a message: where each one travels, what the sender keeps
        alive until the peer loaded them, and the pack's handle (0: no pack).

        Raises:
            TritonModelException: the pool cannot hold them.
        """
        pool = self.pool
        places: list[_Place] = []
        chunks: list[bytes] = []
        total = 0
        for t in tensors:
            nbytes = t.byte_size
            dtype = t.dtype
            if (nbytes <= PACK_TENSOR_MAX and total + nbytes <= PACK_MAX
                    and t.memory_type is _CPU and dtype in _PACKED):
                array = t.as_numpy()
                places.append((t.name(), int(dtype), array.shape, total))
                # tobytes: C order, in the array's byte order (a tensor's is the native one)
                chunks.append(array.tobytes())
                pad = -nbytes % _ALIGN
                if pad:
                    chunks.append(_PADS[pad])
                total += nbytes + pad
            else:
                places.append(-1)
        keep = [t for t, place in zip(tensors, places) if place == -1]
        if len(keep) > len(tensors) - 2:  # a pack of one saves nothing: a record each
            keep = list(tensors)
            return [t.save_to_shared_memory(pool) for t in tensors], keep, 0
        # The pack's record carries one message, which keeps it alive until the receiver's
        # load takes it over: the sender holds nothing for it.
        pack = save_record(pool, name="pack", dtype=_UINT8, dims=(total,), memory_type=0,
                           memory_type_id=0, payload=b"".join(chunks), byte_size=total)
        records = iter(keep)
        for i, place in enumerate(places):
            if place == -1:
                places[i] = next(records).save_to_shared_memory(pool)
        return places, keep, pack

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
            seq, acked, kind, places, body, pack = self.conn.recv()
        except (OSError, EOFError, ValueError) as exc:
            _reraise_foreign(exc)
            raise ChannelClosed(str(exc) or "end of stream") from None
        pool = self.pool
        if pack:
            buffer = Tensor.load_from_shared_memory(pool, pack).as_numpy()
            tensors = [
                Tensor.load_from_shared_memory(pool, p) if isinstance(p, int) else
                Tensor(p[0], _ndarray(p[2], _PACKED[p[1]], buffer, p[3])) for p in places
            ]  # fmt: skip
        else:
            tensors = [Tensor.load_from_shared_memory(pool, p) for p in places]
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
