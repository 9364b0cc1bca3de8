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

A message whose pack would hold at most ``INLINE_MAX`` bytes carries the pack's bytes itself
instead (the receiver copies it to 64-byte aligned memory of its own: its views are writable
and aligned, as views of a record are, which JAX needs to import them without a copy): the
record would cost a save, a load and a give-back under the pool's lock (with two ``flock``
calls each) where copying a few kilobytes through the socket costs less. A small request or
response (add_sub's (16,) FP32 tensors) then needs no pool operation at all: an isolated
``infer`` of add_sub with 4 KiB inputs took 364 / 1,044 us against 1,428 / 1,262 us with a
record per pack (two alternated runs of ``bench_runtime.py``).

A tensor that is a view of a pack this process received (a step's output that an ensemble
passes on, an input a model returns as an output) is not copied again: the message names its
place in that pack, and the pack's record gets one more message for the receiver (the
registry of received packs below finds it by address). So data already in the pool stays
there, from stub to stub, as tensors with records of their own always did.

Record lifetime: the sender keeps the saving tensors alive until the receiver has loaded them.
Every message carries the sequence number of the last message its sender received (and so
loaded); the peer drops what it held for messages up to that number. This is correct whether
a loaded record takes over the saver's reference or holds one of its own. A pack needs no
holding: the pending message of its record keeps it until the receiver's load takes it over.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pickle import PickleBuffer
from pickle import dumps as _dumps
from pickle import loads as _loads
from typing import Any

import numpy as np

from dlpack_ctypes import data_pointer
from pb_tensor import MemoryType, Tensor, TritonDtype
from pb_tensor.dtypes import numpy_dtype_of
from pb_tensor.errors import TritonModelException
from pb_tensor.shm import SharedMemoryPool, save_record

__all__ = ["INLINE_MAX", "PACK_MAX", "PACK_TENSOR_MAX", "Channel", "ChannelClosed", "Message"]

PACK_TENSOR_MAX = 64 << 10
"""The largest tensor (bytes) that travels in its message's pack rather than a record."""
INLINE_MAX = 8 << 10
"""The largest pack (bytes) that travels inside its message rather than as a record."""
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
# The same, keyed by the TritonDtype member (what Tensor.dtype gives): its integer value.
_CODES: dict[TritonDtype, int] = {TritonDtype(code): code for code in _PACKED}
# A tensor's place in its message: a record's handle, or (name, dtype, shape, offset, k):
# at ``offset`` in the message's k-th pack (k 0: the pack made for it, if any; others:
# packs received earlier that the tensor is a view of); dtype: the TritonDtype value.
# A message's packs: a record handle each (0: no new pack), or for the new one its bytes.
_Place = int | tuple[str, int, tuple[int, ...], int, int]


class _Received:
    """The packs this process received and still views, by address: a tensor whose data lies
    in one of them is passed on by reference (one more message on that pack's record).

    An entry lives as long as the pack's buffer (the views' common base): its weak
    reference's callback (``list.append``, C code: safe in any thread, inside any lock)
    queues it, and the next registration or lookup drops it under the lock. A queued entry
    is never used (its reference is dead), so a pack freed meanwhile cannot be named.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted
        # start -> (weak reference to the buffer, end, pool, record handle)
        self._entries: dict[int, tuple[weakref.ref[PickleBuffer], int, SharedMemoryPool, int]] = {}
        self._by_ref: dict[int, int] = {}  # id of an entry's weak reference -> its start
        self._dead: list[weakref.ref[PickleBuffer]] = []
        # (lowest start, highest end) of the entries, read without the lock: an address
        # outside cannot be in a pack, which spares most tensors (the model's own arrays)
        # the locked lookup. A pack is registered before any view of it exists, and later
        # values only drop dead packs, so a stale tuple still covers every live pack.
        self.bounds = (0, 0)

    def add(self, buffer: PickleBuffer, start: int, pool: SharedMemoryPool, nbytes: int,
            handle: int) -> None:
        ref = weakref.ref(buffer, self._dead.append)
        with self._lock:
            self._purge()
            old = self._entries.get(start)
            if old is None:
                insort(self._starts, start)
            else:  # its buffer died and its queued reference is not purged yet
                self._by_ref.pop(id(old[0]), None)
            self._entries[start] = (ref, start + nbytes, pool, handle)
            self._by_ref[id(ref)] = start
            self._bound()

    def find(self, address: int, nbytes: int, pool: SharedMemoryPool) -> tuple[int, int] | None:
        """The record handle and offset of the live pack of ``pool`` holding ``nbytes`` at
        ``address``, or None."""
        with self._lock:
            if self._dead:
                self._purge()
            starts = self._starts
            i = bisect_right(starts, address) - 1
            if i < 0:
                return None
            start = starts[i]
            ref, end, owner, handle = self._entries[start]
            if address + nbytes > end or owner is not pool or ref() is None:
                return None
            return handle, address - start

    def _purge(self) -> None:
        dead = self._dead
        if not dead:
            return
        while dead:
            ref = dead.pop()
            start = self._by_ref.pop(id(ref), None)
            if start is not None:
                del self._entries[start]
                self._starts.remove(start)
        self._bound()

    def _bound(self) -> None:
        starts = self._starts
        if starts:
            self.bounds = (starts[0], max(entry[1] for entry in self._entries.values()))
        else:
            self.bounds = (0, 0)

    def __len__(self) -> int:
        return len(self._entries)


_received = _Received()

Message = tuple[str, list[Tensor], Any]
"""A received message: kind, the tensors it carried (loaded), and its body."""


class ChannelClosed(Exception):
    """The peer process went away (exited, crashed or closed its end)."""


class Channel:
    """One end of a stub's control channel (thread-safe for senders; one reader).

    ``inline_max``: the largest pack (bytes) this end sends inside its messages (0: every
    pack as a record).
    """

    def __init__(
        self, conn: Connection, pool: SharedMemoryPool, *, inline_max: int = INLINE_MAX,
    ) -> None:  # fmt: skip
        self.conn = conn
        self.pool = pool
        self.inline_max = inline_max
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
        places, keep, packs = self._places(tensors) if tensors else ((), (), None)
        with self._send_lock:
            self._out_seq += 1
            if keep:
                self._held.append((self._out_seq, keep))
            try:
                # pickle itself rather than Connection.send's ForkingPickler (2.3 against 11
                # us a message: nothing here needs its reducers).
                self.conn.send_bytes(
                    _dumps((self._out_seq, self._in_seq, kind, places, body, packs), 5))
            except (OSError, EOFError, ValueError) as exc:
                _reraise_foreign(exc)
                raise ChannelClosed(str(exc)) from None

    def _places(
        self, tensors: Sequence[Tensor],
    ) -> tuple[list[_Place], list[Tensor], list[int | bytes]]:  # fmt: skip
        """Save ``tensors`` for a message: where each one travels, what the sender keeps
        alive until the peer loaded them, and its packs: their handles (the first 0 when
        nothing was copied into a new pack), the first one the new pack's bytes when it
        travels inside the message.

        Raises:
            TritonModelException: the pool cannot hold them.
        """
        pool = self.pool
        places: list[_Place] = []
        chunks: list[bytes] = []
        keep: list[Tensor] = []  # the tensors that keep records of their own
        total = 0
        packed = 0  # tensors copied into the new pack
        shared: dict[int, int] = {}  # record handle of a received pack -> its index in packs
        # Per tensor, this loop runs for every message both ways (for a batch of small
        # requests, most of the channel's cost): hoisted look-ups, and the address checked
        # against the received packs' bounds before the locked look-up.
        lo, hi = _received.bounds
        codes = _CODES
        for t in tensors:
            code = codes.get(t.dtype)
            if code is None or t.memory_type is not _CPU:
                places.append(-1)
                keep.append(t)
                continue
            array = t.as_numpy()  # a host numeric tensor's: no copy, cannot fail
            nbytes = array.nbytes
            # An array that owns its memory (base None: the model's fresh outputs) is no
            # view of a pack.
            if hi and array.base is not None:
                address = data_pointer(array)
                if lo <= address < hi:
                    found = _received.find(address, nbytes, pool)
                    if found is not None and array.flags.c_contiguous:
                        k = shared.setdefault(found[0], len(shared) + 1)
                        places.append((t.name(), code, array.shape, found[1], k))
                        continue
            if nbytes <= PACK_TENSOR_MAX and total + nbytes <= PACK_MAX:
                places.append((t.name(), code, array.shape, total, 0))
                # tobytes: C order, in the array's byte order (a tensor's is the native one)
                chunks.append(array.tobytes())
                pad = -nbytes % _ALIGN
                if pad:
                    chunks.append(_PADS[pad])
                total += nbytes + pad
                packed += 1
            else:
                places.append(-1)
                keep.append(t)
        inline = packed and total <= self.inline_max
        if not shared and packed < 2 and not inline:  # a pack of one saves nothing
            keep = list(tensors)
            return [t.save_to_shared_memory(pool) for t in tensors], keep, [0]
        packs: list[int | bytes] = [0] * (len(shared) + 1)
        saved: list[int] = []  # handed out so far: given back if a later save fails
        try:
            for handle, k in shared.items():
                packs[k] = added = pool.add_message(handle)
                saved.append(added)
            if inline:
                packs[0] = b"".join(chunks)
            elif packed:
                # The pack's record carries one message, which keeps it alive until the
                # receiver's load takes it over: the sender holds nothing for it.
                packs[0] = record = save_record(
                    pool, name="pack", dtype=_UINT8, dims=(total,), memory_type=0,
                    memory_type_id=0, payload=b"".join(chunks), byte_size=total,
                )  # fmt: skip
                saved.append(record)
            records = iter(keep)
            for i, place in enumerate(places):
                if place == -1:
                    handle = next(records).save_to_shared_memory(pool)
                    places[i] = handle
                    saved.append(handle)
        except BaseException:
            for handle in saved:
                with contextlib.suppress(TritonModelException):
                    pool.release(handle)
            raise
        return places, keep, packs

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
            seq, acked, kind, places, body, packs = _loads(self.conn.recv_bytes())
        except (OSError, EOFError, ValueError) as exc:
            _reraise_foreign(exc)
            raise ChannelClosed(str(exc) or "end of stream") from None
        pool = self.pool
        # (packs[0]: a handle, 0 if no new pack, or the new pack's bytes, maybe empty)
        if packs is not None and (packs[0] != 0 or len(packs) > 1):
            buffers = [_aligned(h) if type(h) is bytes else _load_pack(pool, h) if h else None
                       for h in packs]  # fmt: skip
            tensors = [
                Tensor.load_from_shared_memory(pool, p) if isinstance(p, int) else
                Tensor(p[0], _ndarray(p[2], _PACKED[p[1]], buffers[p[4]], p[3])) for p in places
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


def _aligned(data: bytes) -> np.ndarray[Any, Any]:
    """A pack that came inside its message, copied to 64-byte aligned memory of this process
    (the unpickled bytes are read-only and only 16-byte aligned): its tensors' views are
    writable and aligned, as views of a record are."""
    size = len(data)
    block = np.empty(size + _ALIGN, np.uint8)
    start = -data_pointer(block) % _ALIGN
    aligned = block[start : start + size]
    aligned[:] = np.frombuffer(data, np.uint8)
    return aligned


def _load_pack(pool: SharedMemoryPool, handle: int) -> PickleBuffer:
    """Load the pack at ``handle``: the buffer its tensors view (each view keeps it, and so
    the record, alive), registered so that a view passed on is sent by reference."""
    array = Tensor.load_from_shared_memory(pool, handle).as_numpy()
    # The views' base: numpy keeps a PickleBuffer as it is (an ndarray or a memoryview would
    # be collapsed to the loaded array), and it can be watched by a weak reference.
    buffer = PickleBuffer(array.data)
    _received.add(buffer, data_pointer(array), pool, array.nbytes, handle)
    return buffer


def _reraise_foreign(exc: BaseException) -> None:
    """Raise ``exc`` again when it is not the socket's: an ``OSError`` subclass without an
    errno (a ``TimeoutError`` a signal handler raised while this thread waited) belongs to
    the caller and must reach it; the peer did not go away. (``multiprocessing`` raises
    plain ``OSError`` texts, a broken stream's, without one.)"""
    if isinstance(exc, OSError) and exc.errno is None and type(exc) is not OSError:
        raise exc
