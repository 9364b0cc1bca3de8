"""The stub process: runs one model instance, as Triton's ``triton_python_backend_stub`` does.

Started as ``python -m pb_tensor.runtime._stub FD POOL``: ``FD`` is this end of the control
socket, ``POOL`` the shared-memory pool tensors travel through. Messages are read by the
thread that waits for one (loading the tensors they carry at once, see :mod:`._channel`); the
main thread runs the commands one at a time. The stub exits when the runtime closes the
channel or asks it to finalize.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from pb_tensor import Tensor
from pb_tensor.errors import TritonModelException
from pb_tensor.extras_policy import set_extras_default
from pb_tensor.numpy_policy import set_bf16_numpy_default
from pb_tensor.runtime._channel import Channel, ChannelClosed, Message
from pb_tensor.runtime._host import (
    HostInfo,
    ModelHost,
    RequestData,
)
from pb_tensor.runtime._host_policy import HostPolicyError, bind_this_process
from pb_tensor.runtime._model_import import (
    UserModelError,
    load_model_module,
    model_class,
    run_auto_complete,
)
from pb_tensor.runtime._placement import gpu_refusal
from pb_tensor.runtime._reshape import renamed
from pb_tensor.runtime._running import RunningBatch
from pb_tensor.runtime._seam import (
    BLS_OUTSIDE_EXECUTE_MESSAGE,
    InferenceRequest,
    InferenceResponse,
    PreferredMemory,
    TritonError,
    set_process_backend,
)
from pb_tensor.runtime._stub_bls import BlsStream, bls_response
from pb_tensor.runtime._stub_report import ForwardLogs
from pb_tensor.runtime._values import first_response
from pb_tensor.shm import SharedMemoryPool

__all__ = ["main"]

_FINAL = 1
_WATCH_INTERVAL = 0.02


class _StubBackend:
    """``pb_utils``' BLS and model-control calls, forwarded to the runtime."""

    def __init__(self, stub: _Stub) -> None:
        self._stub = stub

    def exec_request(
        self, request: InferenceRequest, *, decoupled: bool, timeout_us: int | None
    ) -> InferenceResponse | Iterator[InferenceResponse]:
        # Threads the model started reach this backend directly: the host's rule again.
        host = self._stub.host
        if host is None:
            raise TritonModelException(BLS_OUTSIDE_EXECUTE_MESSAGE)
        host.check_bls()
        responses = self._stub.bls(request, decoupled, timeout_us)
        if decoupled:
            return responses
        return first_response(responses)

    def is_model_decoupled(self) -> bool:
        info = self._stub.info
        return bool(info is not None and info.decoupled)

    def model_name(self) -> str:
        return self._stub.name

    def model_dir(self) -> str:
        info = self._stub.info
        return info.model_dir if info is not None else ""

    def _control(self, kind: str, body: Any) -> Any:
        return self._stub.call_parent(kind, body)

    def load_model(self, model_name: str, config: str, files: dict[str, bytes] | None) -> None:
        self._control("load_model", (model_name, config, files))

    def unload_model(self, model_name: str, unload_dependents: bool) -> None:
        self._control("unload_model", (model_name, unload_dependents))

    def is_model_ready(self, model_name: str, model_version: str) -> bool:
        return bool(self._control("is_model_ready", (model_name, model_version)))


class _Stub:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.commands: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self.waiters: dict[int, queue.SimpleQueue[Message | None]] = {}
        self.waiters_lock = threading.Lock()
        self.call_ids = itertools.count(1)
        # The batches whose requests may still be answered, by the runtime's batch id: a
        # decoupled ``async def execute`` leaves its batch running on the model's event loop
        # while the next one starts (as Triton's stub returns to its message loop).
        self.batches: dict[int, RunningBatch] = {}
        self.batches_lock = threading.Lock()
        self.reader = threading.Lock()
        self.execute_started = 0.0  # time.monotonic() when the running execute began, or 0
        self.closed = False
        self.name = ""
        self.cls: type | None = None
        self.info: HostInfo | None = None
        self.host: ModelHost | None = None
        self.backend = _StubBackend(self)
        self.ready_checks: queue.SimpleQueue[None] | None = None  # (see _readiness)

    # -- receiving ----------------------------------------------------------------------------
    # Whoever waits for a message reads the channel itself (one reader at a time) and hands
    # what is not for it to its addressee: the common case (the main thread waiting for the
    # next command) costs no thread switch. While a long ``execute`` runs, a watcher thread
    # reads the messages nobody waits for (cancellations).
    def _dispatch(self, message: Message | None) -> None:
        if message is None:
            self.closed = True
            self.commands.put(None)
            with self.waiters_lock:
                for waiter in self.waiters.values():
                    waiter.put(None)
            return
        kind = message[0]
        if kind in ("bls_reply", "control_reply"):
            with self.waiters_lock:
                box = self.waiters.get(message[2][0])
            if box is not None:
                box.put(message)
        elif kind == "cancel":
            batch_id, index = message[2]
            with self.batches_lock:
                running = self.batches.get(batch_id)
            if running is not None:
                running.cancelled.add(int(index))
        elif kind == "ack":
            pass  # Channel.recv already released what the runtime acknowledged
        elif kind == "is_ready":
            self._readiness().put(None)
        else:
            self.commands.put(message)

    def _readiness(self) -> queue.SimpleQueue[None]:
        """The queue of the thread that answers readiness checks (started on first use):
        python_backend's stub answers them on its parent-to-stub monitor thread, beside a
        running ``execute`` (which may be the one asking, through
        ``pb_utils.is_model_ready``), never on the thread that runs ``execute``."""
        with self.waiters_lock:
            if self.ready_checks is None:
                self.ready_checks = queue.SimpleQueue()
                threading.Thread(target=self._answer_readiness, args=(self.ready_checks,),
                                 name="pb-tensor-readiness", daemon=True).start()  # fmt: skip
            return self.ready_checks

    def _answer_readiness(self, checks: queue.SimpleQueue[None]) -> None:
        while True:
            checks.get()
            host = self.host
            state = host.is_ready() if host is not None else (False, None)
            try:
                self.channel.send("ready_state", state)
            except ChannelClosed:
                return

    def _read_one(self) -> None:
        """Read one message (the caller holds the reader role) and dispatch it."""
        try:
            message: Message | None = self.channel.recv()
        except ChannelClosed:
            message = None
        self._dispatch(message)

    def receive(self, box: queue.SimpleQueue[Message | None]) -> Message | None:
        """The next message for ``box`` (None once the runtime is gone)."""
        while True:
            try:
                return box.get_nowait()
            except queue.Empty:
                pass
            if self.closed:
                return None
            if self.reader.acquire(blocking=False):
                try:
                    try:
                        return box.get_nowait()
                    except queue.Empty:
                        pass
                    self._read_one()
                finally:
                    self.reader.release()
            else:
                try:
                    return box.get(timeout=0.05)
                except queue.Empty:
                    pass

    def is_closed(self) -> bool:
        """Whether the runtime went away (set by another thread)."""
        return self.closed

    def watch(self) -> None:
        """Watcher thread: while an ``execute`` runs longer than a moment, read the messages
        that arrive (cancellations). It only looks at a timestamp the main thread writes, so
        short requests never wake it."""
        while not self.is_closed():
            time.sleep(_WATCH_INTERVAL)
            started = self.execute_started
            if not started or time.monotonic() - started < _WATCH_INTERVAL:
                continue
            if not self.channel.poll(_WATCH_INTERVAL) or not self.execute_started:
                continue
            if self.reader.acquire(blocking=False):
                try:
                    if self.execute_started and self.channel.poll(0):
                        self._read_one()
                finally:
                    self.reader.release()

    # -- calls to the runtime -----------------------------------------------------------------
    def _waiter(self) -> tuple[int, queue.SimpleQueue[Message | None]]:
        call_id = next(self.call_ids)
        waiter: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        with self.waiters_lock:
            self.waiters[call_id] = waiter
        return call_id, waiter

    def _done(self, call_id: int) -> None:
        with self.waiters_lock:
            self.waiters.pop(call_id, None)

    def call_parent(self, kind: str, body: Any) -> Any:
        call_id, waiter = self._waiter()
        try:
            self.channel.send(kind, (call_id, body))
            message = self.receive(waiter)
        finally:
            self._done(call_id)
        if message is None:
            raise ChannelClosed("the runtime went away")
        _, ok, result = message[2]
        if not ok:
            raise TritonModelException(result)
        return result

    def bls(
        self, request: InferenceRequest, decoupled: bool, timeout_us: int | None
    ) -> Iterator[InferenceResponse]:
        refusal = gpu_refusal(request.inputs(), "input",
                              f"of the BLS request to model '{request.model_name()}'")
        if refusal is not None:
            return iter([InferenceResponse(error=TritonError(refusal, TritonError.UNSUPPORTED))])
        call_id, waiter = self._waiter()
        body = (
            call_id, request.model_name(), request.model_version(),
            sorted(request.requested_output_names()), request.request_id(),
            request.correlation_id(), request.flags(), request.parameters(),
            timeout_us or 0, decoupled,
        )  # fmt: skip
        try:
            self.channel.send("bls", body, request.inputs())
        except BaseException:
            self._done(call_id)
            raise
        responses = self._bls_responses(call_id, waiter, request.preferred_memory())
        return BlsStream(responses, lambda: self.channel.send("bls_cancel", call_id))

    def _bls_responses(
        self, call_id: int, waiter: queue.SimpleQueue[Message | None], preferred: PreferredMemory
    ) -> Iterator[InferenceResponse]:
        try:
            while True:
                message = self.receive(waiter)
                if message is None:
                    yield InferenceResponse(
                        error=TritonError("the runtime went away during a BLS request")
                    )
                    return
                _, tensors, (_, error, parameters, flags, has_response) = message
                if has_response or error is not None or flags & _FINAL:
                    yield bls_response(tensors, error, parameters, preferred)
                if flags & _FINAL:
                    return
        finally:
            self._done(call_id)

    # -- commands ------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            message = self.receive(self.commands)
            if message is None:
                return
            kind, tensors, body = message
            if kind == "load":
                self.load(body)
            elif kind == "init":
                self.init(body)
            elif kind == "execute":
                self.execute(tensors, body)
            elif kind == "log_level":
                logging.getLogger("pb_tensor.runtime").setLevel(body)
            elif kind == "metrics":
                from pb_tensor.runtime._seam import metric_snapshot

                self.channel.send("metrics", metric_snapshot())
            elif kind == "finalize":
                error = self.host.finalize() if self.host is not None else None
                self.channel.send("finalized", error)
                return

    def load(self, body: dict[str, Any]) -> None:
        self.name = body["name"]
        for entry in body["sys_path"]:
            if entry not in sys.path:
                sys.path.append(entry)
        logging.getLogger("pb_tensor.runtime").setLevel(body["log_level"])
        try:
            self.cls = model_class(load_model_module(body["model_path"], self.name))
            config = body["config"]
            if config is not None:
                config = run_auto_complete(self.cls, self.name, config)
        except UserModelError as exc:
            self.channel.send("failed", str(exc))
            return
        self.channel.send("loaded", config)

    def init(self, body: dict[str, Any]) -> None:
        self.info = HostInfo(**body)
        # The whole process is the model's: its own threads follow the repository's choice.
        set_bf16_numpy_default(self.info.bf16_as_numpy)
        set_extras_default(self.info.pb_tensor_extras)
        if self.cls is None:
            self.channel.send("failed", "the model was not loaded")
            return
        if self.info.cpus:  # the instance's host policy: before initialize, as in Triton
            try:
                bind_this_process(self.info.cpus)
            except HostPolicyError as exc:
                self.channel.send("failed", str(exc))
                return
        self.host = ModelHost(self.info, self.cls, self.backend)
        try:
            self.host.initialize()
        except UserModelError as exc:
            self.channel.send("failed", str(exc))
            return
        # Whether the model defines is_ready() (python_backend caches it here): readiness
        # checks of a model without one ask the stub nothing.
        self.channel.send("ready", self.host.defines_is_ready)

    def execute(self, tensors: list[Tensor], message: tuple[int, list[tuple[Any, ...]]]) -> None:
        batch_id, body = message
        host = self.host
        if host is None:
            self.channel.send("done", ("the model is not initialized", [], [], [], batch_id))
            return
        batch = []
        at = 0
        for count, requested, request_id, correlation_id, flags, parameters, timeout, names in body:
            inputs = tensors[at : at + count]
            if names is not None:  # tensors of the pool sent as they are: name them here
                inputs = [renamed(t, n) for t, n in zip(inputs, names)]
            batch.append(
                RequestData(inputs, requested, request_id, correlation_id, flags, parameters,
                            timeout)
            )  # fmt: skip
            at += count
        running = RunningBatch(len(batch))
        with self.batches_lock:
            self.batches[batch_id] = running
        decoupled = host.info.decoupled
        # A non-decoupled model's responses all exist when execute returns: they travel with
        # the "done" message (one message per batch instead of one per response).
        # A response sent after execute returned (a sender used from another thread) goes
        # out on its own.
        held: list[tuple[int, InferenceResponse | None, int]] | None = []
        hold = threading.Lock()

        def send(index: int, response: InferenceResponse | None, flags: int) -> None:
            self.send_response(batch_id, index, response, flags)
            if flags & _FINAL and running.finished(index):
                self._forget(batch_id)

        def keep(index: int, response: InferenceResponse | None, flags: int) -> None:
            with hold:
                if held is not None:
                    held.append((index, response, flags))
                    return
            send(index, response, flags)

        requests = host.build_requests(
            batch, send if decoupled else keep, running.cancelled.__contains__
        )
        self.execute_started = time.monotonic()
        try:
            error = host.execute(requests)
        finally:
            self.execute_started = 0.0
        with hold:
            returned, held = held, None
        waiting = requests.waiting() if error is None and not decoupled else []
        replies: list[tuple[int, tuple[str, int] | None, str, int, bool, int]] = []
        outputs: list[Tensor] = []
        for index, response, flags in returned or ():
            if flags & _FINAL:
                running.finished(index)
            if response is None:
                replies.append((index, None, "{}", flags, False, 0))
                continue
            error_out, tensors_out = self.outgoing(response)
            replies.append((index, error_out, response.parameters(), flags, True,
                            len(tensors_out)))  # fmt: skip
            outputs.extend(tensors_out)
        if error is not None or running.all_finished() or (not decoupled and not waiting):
            self._forget(batch_id)
        try:
            self.channel.send(
                "done", (error, replies, waiting, requests.rescheduled, batch_id), outputs
            )
        except TritonModelException as exc:  # the pool cannot hold the outputs
            self.channel.send("done", (f"Failed to process the request(s) for model "
                                       f"'{host.info.instance_name}', message: {exc}", [], [],
                                       [], batch_id))  # fmt: skip
        # A decoupled coroutine starts once "done" is on its way: the runtime reads that its
        # instance is free before any response the coroutine sends.
        host.start_background(requests)

    def _forget(self, batch_id: int) -> None:
        with self.batches_lock:
            self.batches.pop(batch_id, None)

    def send_response(
        self, batch_id: int, index: int, response: InferenceResponse | None, flags: int
    ) -> None:
        if response is None:
            self.channel.send("response", (index, None, "{}", flags, False, batch_id))
            return
        error, tensors = self.outgoing(response)
        self.channel.send(
            "response", (index, error, response.parameters(), flags, True, batch_id), tensors
        )  # fmt: skip

    def outgoing(
        self, response: InferenceResponse
    ) -> tuple[tuple[str, int] | None, list[Tensor]]:
        """A response's error and tensors as they cross to the runtime: a GPU output turns
        the response into an error saying why (the pool carries host memory only)."""
        tensors = response.output_tensors()
        refusal = gpu_refusal(tensors, "output", f"of model '{self.name}'")
        if refusal is not None:
            return (refusal, int(TritonError.UNSUPPORTED)), []
        err = response.error()
        return (None if err is None else (err.message(), int(err.code()))), tensors


def main(argv: list[str] | None = None) -> int:
    """Serve one model over the control socket given on the command line."""
    args = sys.argv[1:] if argv is None else argv
    fd, pool_name = int(args[0]), args[1]
    # Triton's stub embeds an interpreter started without arguments: models see [''].
    sys.argv = [""]
    # Until the repository's choice arrives (init), the model's import and
    # auto_complete_config see Triton's API only.
    set_extras_default(False)
    pool = SharedMemoryPool.attach(pool_name)
    channel = Channel(Connection(fd), pool)
    stub = _Stub(channel)
    set_process_backend(stub.backend)
    handler = ForwardLogs(channel)
    logger = logging.getLogger("pb_tensor.runtime")
    logger.addHandler(handler)
    logger.propagate = False
    watcher = threading.Thread(target=stub.watch, name="pb-tensor-stub-watcher", daemon=True)
    watcher.start()
    try:
        stub.run()
    except ChannelClosed:
        pass
    finally:
        stub.closed = True
        logger.removeHandler(handler)
        channel.release_all()
        sys.stdout.flush()
        sys.stderr.flush()
    # Threads the model started must not keep the stub alive once the runtime let it go.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
