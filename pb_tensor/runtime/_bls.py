"""A stub's BLS requests, served by the runtime (isolated mode).

Each reply goes back to the stub as it comes. A decoupled request streams in a thread of its
own, so that the thread reading the caller's stub keeps reading it: the stub's
``ResponseIterator.cancel()`` (a ``bls_cancel`` message) arrives meanwhile and reaches the
called model.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pb_tensor import Tensor
from pb_tensor.runtime._channel import ChannelClosed
from pb_tensor.runtime._engines import StubEngine
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._tracker import Cancellation, Reply, acting_as, acting_for, serving_bls

__all__ = ["Route", "StubBls"]

Route = Callable[[str, int, RequestData, int | None, bool, Cancellation | None], Iterator[Reply]]
"""``route(model_name, version, data, timeout_us, decoupled, cancel)``: the replies of the
target model (``LoadedModel.bls_data_replies``)."""


class StubBls:
    """The BLS requests of one model's stub: serves them and cancels them on request."""

    def __init__(self, route: Route) -> None:
        self._route = route
        # The decoupled requests in flight, by the stub's call id.
        self._calls: dict[int, Cancellation] = {}
        self._lock = threading.Lock()

    def serve(self, engine: StubEngine, tensors: list[Tensor], body: Any) -> None:
        """Run a ``bls`` message's request; its replies go back as ``bls_reply`` messages
        (a decoupled request's from a thread of its own)."""
        (call_id, model_name, version, requested, request_id, correlation_id, flags,
         parameters, timeout_us, decoupled) = body  # fmt: skip
        data = RequestData(tensors, requested, request_id, correlation_id, flags, parameters,
                           timeout_us)  # fmt: skip
        if not decoupled:
            with serving_bls():
                replies = self._route(model_name, version, data, timeout_us, False, None)
            self._forward(engine, call_id, replies)
            return
        cancellation = Cancellation()
        with self._lock:
            self._calls[call_id] = cancellation
        with serving_bls():
            replies = self._route(model_name, version, data, timeout_us, True, cancellation)
        caller = acting_for()

        def forward() -> None:
            with acting_as(caller):
                try:
                    self._forward(engine, call_id, replies)
                finally:
                    with self._lock:
                        self._calls.pop(call_id, None)

        threading.Thread(target=forward, name=f"pb-tensor-bls-{model_name}",
                         daemon=True).start()  # fmt: skip

    def cancel(self, call_id: int) -> None:
        """A ``bls_cancel`` message: cancel that request (nothing once it ended)."""
        with self._lock:
            found = self._calls.get(call_id)
        if found is not None:
            found.cancel()

    @staticmethod
    def _forward(engine: StubEngine, call_id: int, replies: Iterator[Reply]) -> None:
        with contextlib.suppress(ChannelClosed):  # the caller's stub went away
            for r in replies:
                err = None if r.error is None else (r.error.message(), int(r.error.code()))
                engine.send("bls_reply", (call_id, err, r.parameters, r.flags, r.has_response),
                            r.tensors)  # fmt: skip
