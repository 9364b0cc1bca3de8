"""Where a loaded model's instance runs: in this process (``_inprocess``), or in a stub
process (:class:`StubEngine`).

Both engines turn a batch of requests into a stream of :class:`Reply` objects, one or more
per request, the last one of each request carrying the final flag. ``_tracker.Tracker`` holds
the rules for when a batch is finished (every request got its final flag and ``execute``
returned), shared by both.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

import pb_tensor
from pb_tensor import Tensor
from pb_tensor.runtime._channel import Channel, ChannelClosed
from pb_tensor.runtime._demux import READINESS, Demux, NoAnswer
from pb_tensor.runtime._errors import InferenceError
from pb_tensor.runtime._host import HostInfo, RequestData
from pb_tensor.runtime._readiness import ReadyState
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._stub_report import emit_record, how_it_ended, wanted_log_level
from pb_tensor.runtime._tracker import Cancellation, Reply, Tracker
from pb_tensor.shm import SharedMemoryPool

__all__ = ["Cancels", "Engine", "Handler", "StubEngine", "StubFailure"]

log = logging.getLogger("pb_tensor.runtime")

_STARTUP_TIMEOUT = 120.0
_FINALIZE_TIMEOUT = 30.0
_ACK_BYTES = 1 << 20


class Engine(Protocol):
    """What :class:`~pb_tensor.runtime.LoadedModel` runs requests on."""

    def run(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancels = None,
        returned: Callable[[], None] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> Iterable[Reply]:
        """The replies of one ``execute`` call on ``batch``. ``returned``: called once a
        decoupled model's ``execute`` returned while replies may still come (the instance
        may take its next batch then, as in Triton). ``on_sent``: called once the batch is
        on its way to the model, before waiting for its replies."""
        ...

    def metrics(self) -> dict[str, Any]: ...
    def health(self) -> str | None: ...
    @property
    def user_readiness(self) -> bool: ...
    def ask_ready(
        self, timeout: float, later: Callable[[ReadyState], None]
    ) -> ReadyState | None: ...
    def stop(self) -> str | None: ...
    @property
    def pid(self) -> int | None: ...


class StubFailure(Exception):
    """The stub could not load or initialize the model; ``str()`` is Triton's message."""


def _kill(proc: subprocess.Popen[bytes], channel: Channel) -> None:
    """Last resort at garbage collection or exit: no stub outlives its runtime."""
    with contextlib.suppress(OSError):
        channel.close()
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(5)


Cancels = Cancellation | Sequence[Cancellation | None] | None
"""A run's cancellation: one for the whole batch, or one per request (the dynamic
batcher's batches hold requests of different callers)."""


Handler = Callable[["StubEngine", str, list[Tensor], Any], None]


class StubEngine:
    """The model runs in its own process, as Triton runs every Python model instance."""

    def __init__(
        self,
        pool: SharedMemoryPool,
        model_path: str,
        name: str,
        handler: Handler,
    ) -> None:
        self.pool = pool
        self.model_path = model_path
        self.name = name
        self._handler = handler
        self.info: HostInfo | None = None
        self.channel: Channel | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        # typeshed's finalize takes the callback's ParamSpec and return type, which a stored
        # finalizer of any callback cannot name.
        self._finalizer: weakref.finalize | None = None  # type: ignore[type-arg]
        self._log_level = logging.NOTSET
        self.demux: Demux | None = None
        self._batch_ids = itertools.count(1)
        self._user_readiness = False  # (the stub says after initialize)

    # -- process ------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, config: dict[str, Any] | None) -> dict[str, Any] | None:
        """Start a stub, import the model and run ``auto_complete_config`` on ``config``
        (None: skip it); the completed configuration.

        Raises:
            StubFailure: the model cannot be imported, or the stub died or did not answer.
        """
        ours, theirs = socket.socketpair()
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(pb_tensor.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p
        )
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pb_tensor.runtime._stub", str(theirs.fileno()),
                 self.pool.name],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            theirs.close()
        self.channel = Channel(Connection(ours.detach()), self.pool)
        self.demux = Demux(self.channel, self._serve)
        threading.Thread(target=_watch_idle, args=(self.demux,), daemon=True,
                         name=f"pb-tensor-stub-watch-{self.name}").start()  # fmt: skip
        self._finalizer = weakref.finalize(self, _kill, self.proc, self.channel)
        self._log_level = wanted_log_level(self.name)
        body = {
            "name": self.name, "model_path": self.model_path, "config": config,
            "sys_path": list(sys.path), "log_level": self._log_level,
        }  # fmt: skip
        self.channel.send("load", body)
        kind, _, result = self._expect(("loaded", "failed"), _STARTUP_TIMEOUT)
        if kind == "failed":
            self.kill()
            raise StubFailure(result)
        loaded: dict[str, Any] = result
        return loaded

    def _sync_log_level(self, channel: Channel) -> None:
        # A level changed while the model is loaded (Triton's logging endpoint) reaches the
        # stub before its next call: the stub drops records below its level unsent.
        level = wanted_log_level(self.name)
        if level != self._log_level:
            channel.send("log_level", level)
            self._log_level = level

    def initialize(self, info: HostInfo) -> None:
        """Send ``initialize(args)`` to a spawned stub.

        Raises:
            StubFailure: ``initialize`` raised (Triton's text), or the stub died.
        """
        self.info = info
        if self.channel is None:
            raise StubFailure("the stub process is not running")
        self.channel.send("init", info.__dict__)
        kind, _, result = self._expect(("ready", "failed"), _STARTUP_TIMEOUT)
        if kind == "failed":
            self.kill()
            raise StubFailure(result)
        self._user_readiness = bool(result)

    def restart(self) -> None:
        """A fresh stub for the same model (after a crash or a timeout)."""
        if self.info is None:
            raise StubFailure("the model was never initialized")
        self.kill()
        self.spawn(None)
        self.initialize(self.info)

    def _expect(self, kinds: tuple[str, ...], timeout: float) -> tuple[str, list[Tensor], Any]:
        deadline = time.monotonic() + timeout
        try:
            while True:
                kind, tensors, body = self._next(deadline)
                if kind in kinds:
                    return kind, tensors, body
                self._handler(self, kind, tensors, body)
        except (ChannelClosed, NoAnswer) as exc:
            if self.info is not None and isinstance(exc, ChannelClosed):
                # The stub died in initialize (Triton's launcher: the stub is not healthy).
                ended = how_it_ended(self.proc)
                self.kill()
                raise StubFailure(
                    f"Stub process '{self.info.instance_name}' is not healthy.{ended}"
                ) from None
            self.kill()
            raise StubFailure(
                f"Stub process for model '{self.name}' failed to start: {exc}"
            ) from None

    def _serve(self, kind: str, tensors: list[Tensor], body: Any) -> None:
        """A message of the stub's own (a log record, BLS, model control)."""
        if kind == "log":
            emit_record(body, self.pid)
        else:
            self._handler(self, kind, tensors, body)

    def _next(self, deadline: float | None) -> tuple[str, list[Tensor], Any]:
        """The stub's answer to the runtime's call."""
        demux = self.demux
        if demux is None:
            raise ChannelClosed("the stub process is not running")
        return demux.next(None, deadline)

    def kill(self) -> None:
        """Kill the stub (if running) and forget it."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.proc = None
        self.channel = None
        self.demux = None

    # -- requests -----------------------------------------------------------------------------
    def run(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancels = None,
        returned: Callable[[], None] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> Iterator[Reply]:
        info = self.info
        if info is None:
            raise StubFailure("the model was never initialized")
        if not self.alive:
            log.warning("restarting the stub process of model instance '%s'",
                        info.instance_name)
            self.restart()
        channel, demux = self.channel, self.demux
        if channel is None or demux is None:  # restart raised or gave nothing
            raise StubFailure("the stub process is not running")
        batch_id = next(self._batch_ids)
        tracker = Tracker(len(batch), info.decoupled, info.instance_name)
        deadline = None if timeout is None else time.monotonic() + timeout
        tensors: list[Tensor] = []
        body = []
        for r in batch:
            names = None if r.pooled is None else [t.name() for t in r.inputs]
            tensors.extend(r.inputs if r.pooled is None else r.pooled)
            body.append((len(r.inputs), r.requested_outputs, r.request_id, r.correlation_id,
                         r.flags, r.parameters, r.timeout_us, names))
        unsubscribe: list[Callable[[], None]] = []
        demux.open(batch_id)
        try:
            self._sync_log_level(channel)
            channel.send("execute", (batch_id, body), tensors)
            if on_sent is not None:
                on_sent()
            if isinstance(cancel, Cancellation):
                unsubscribe.append(cancel.subscribe(
                    lambda: _send_cancel(channel, batch_id, len(batch))
                ))  # fmt: skip
            elif cancel is not None:
                for index, c in enumerate(cancel):
                    if c is not None:
                        unsubscribe.append(c.subscribe(
                            functools.partial(_send_cancel, channel, batch_id, 1, index)
                        ))  # fmt: skip
            received = 0
            while not tracker.finished:
                kind, out, msg = demux.next(batch_id, deadline)
                for t in out:
                    received += t.byte_size
                if kind == "response":
                    index, error, parameters, flags, has_response, _ = msg
                    err = None if error is None else InferenceError(error[0], error[1])
                    yield from tracker.reply(
                        Reply(index, out, err, parameters, flags, has_response)
                    )
                elif kind == "done":
                    for reply in _batched(msg[1], out):
                        yield from tracker.reply(reply)
                    finished = tracker.done(msg[0], msg[2], msg[3])
                    if returned is not None and info.decoupled and not tracker.finished:
                        returned()  # before the caller sees a reply: the instance is free
                    yield from finished
            if received >= _ACK_BYTES:
                # The stub holds what it sent until told it was loaded; say so now rather than
                # with the next request, so large responses do not stay pinned while idle.
                channel.send("ack")
        except ChannelClosed:
            ended = ""
            if self.channel is channel:  # (another batch's reader may have restarted it)
                ended = how_it_ended(self.proc)
                self.kill()
            yield from tracker.fail(
                InferenceError(
                    f"Failed to process the request(s) for model instance "
                    f"'{info.instance_name}', message: Stub process '{info.instance_name}' is "
                    f"not healthy.{ended}",
                    TritonError.INTERNAL,
                )
            )
        except NoAnswer:
            if self.channel is channel:
                self.kill()
            yield from tracker.fail(
                InferenceError(
                    f"Failed to process the request(s) for model instance "
                    f"'{info.instance_name}', message: Stub process '{info.instance_name}' did "
                    f"not respond within the timeout of {timeout} s and was killed.",
                    TritonError.UNAVAILABLE,
                )
            )
        finally:
            for undo in unsubscribe:
                undo()
            if not tracker.finished and self.channel is channel:
                # The caller stopped reading early: cancel and wait for the model to end
                # the batch; a stub that does not finish in time is killed.
                self._drain(channel, demux, batch_id, tracker, min(timeout or 10.0, 10.0))
            demux.close(batch_id)

    def _drain(self, channel: Channel, demux: Demux, batch_id: int, tracker: Tracker,
               timeout: float) -> None:  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            for index in sorted(tracker.pending):
                channel.send("cancel", (batch_id, index))
            while not tracker.finished:
                kind, out, msg = demux.next(batch_id, deadline)
                if kind == "response":
                    tracker.reply(Reply(msg[0], out, None, msg[2], msg[3], msg[4]))
                elif kind == "done":
                    for reply in _batched(msg[1], out):
                        tracker.reply(reply)
                    tracker.done(msg[0], msg[2], msg[3])
        except (ChannelClosed, NoAnswer):
            if self.channel is channel:
                self.kill()

    def send(self, kind: str, body: Any, tensors: list[Tensor] | None = None) -> None:
        """Answer the stub (BLS replies, model-control replies)."""
        if self.channel is not None:
            self.channel.send(kind, body, tensors or ())

    # -- readiness (ReadinessCheck's probe) ----------------------------------------------------
    def health(self) -> str | None:
        if self.channel is None or not self.alive:
            name = self.info.instance_name if self.info is not None else self.name
            return f"Stub process '{name}' is not healthy.{how_it_ended(self.proc)}"
        return None

    @property
    def user_readiness(self) -> bool:
        return self._user_readiness

    def ask_ready(
        self, timeout: float, later: Callable[[ReadyState], None]
    ) -> ReadyState | None:
        """Ask the stub, which answers on a thread of its own (beside ``execute``); the
        answer comes to the readiness box of the demux, whoever reads the channel."""
        channel, demux = self.channel, self.demux
        if channel is None or demux is None:
            return False, _READINESS_UNHEALTHY
        try:
            channel.send("is_ready")
            return _ready_state(demux, time.monotonic() + timeout)
        except NoAnswer:
            pass
        except ChannelClosed:
            return False, _READINESS_UNHEALTHY

        def wait() -> None:
            try:
                state = _ready_state(demux, None)
            except ChannelClosed:  # (NoAnswer needs a deadline)
                state = (False, "Stub process is not healthy during readiness cleanup")
            later(state)

        threading.Thread(target=wait, name=f"pb-tensor-readiness-{self.name}",
                         daemon=True).start()  # fmt: skip
        return None

    def metrics(self) -> dict[str, Any]:
        if self.channel is None or not self.alive:
            return {}
        try:
            self.channel.send("metrics")
            _, _, snapshot = self._expect(("metrics",), 30.0)
        except (StubFailure, ChannelClosed):
            return {}
        values: dict[str, Any] = snapshot
        return values

    def stop(self) -> str | None:
        """``finalize`` in the stub, then let it exit (killed if it does not in time)."""
        error = None
        proc, channel = self.proc, self.channel
        if proc is not None and channel is not None and proc.poll() is None:
            try:
                self._sync_log_level(channel)
                channel.send("finalize")
                deadline = time.monotonic() + _FINALIZE_TIMEOUT
                while True:
                    kind, out, msg = self._next(deadline)
                    if kind == "finalized":
                        error = msg
                        break
                    if kind not in ("response", "done"):
                        self._handler(self, kind, out, msg)
                proc.wait(_FINALIZE_TIMEOUT)
            except (ChannelClosed, NoAnswer, subprocess.TimeoutExpired):
                pass
        self.kill()
        return error


# How often a stub's idle watcher looks for messages nobody reads (seconds).
_IDLE_WATCH = 0.05


def _watch_idle(demux: Demux) -> None:
    """While nobody reads a stub's channel (no batch in flight, no call waiting), read what
    the stub sends anyway: the log records of its background threads (python_backend's
    parent reads its stub's messages on a thread of its own, and they show as they come).
    Ends with the stub."""
    while True:
        time.sleep(_IDLE_WATCH)
        try:
            while demux.idle() and demux.pump():
                pass
        except ChannelClosed:
            return


_READINESS_UNHEALTHY = (
    "Stub process is not healthy while waiting for user-defined is_ready() response"
)


def _ready_state(demux: Demux, deadline: float | None) -> ReadyState:
    """The stub's answer to ``is_ready`` (raises as :meth:`Demux.next`)."""
    _, _, (ready, error) = demux.next(READINESS, deadline)
    return bool(ready), error


def _send_cancel(channel: Channel, batch_id: int, size: int, first: int = 0) -> None:
    """Tell the stub the caller cancelled requests ``first .. first + size - 1`` of batch
    ``batch_id``."""
    with contextlib.suppress(ChannelClosed):
        for index in range(first, first + size):
            channel.send("cancel", (batch_id, index))


def _batched(replies: list[tuple[Any, ...]], tensors: list[Tensor]) -> Iterator[Reply]:
    """The responses a "done" message carries, each with its share of the tensors."""
    at = 0
    for index, error, parameters, flags, has_response, count in replies:
        err = None if error is None else InferenceError(error[0], error[1])
        yield Reply(index, tensors[at : at + count], err, parameters, flags, has_response)
        at += count
