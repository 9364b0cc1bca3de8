"""The runtime's constructors and accessors of ``InferenceRequest`` (what ``execute`` receives)."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Final

from pb_tensor.tensor import Tensor
from pb_tensor.utils._params import ParameterValue
from pb_tensor.utils._request import (
    _DELIVERED,
    _LAZY_LOCK,
    TRITONSERVER_REQUEST_RELEASE_ALL,
    InferenceRequest,
)
from pb_tensor.utils._response import (
    InferenceResponse,
    InferenceResponseSender,
    SenderSource,
    prune_output_tensors,
)
from pb_tensor.utils._types import (
    NO_PREFERENCE,
    NO_TRACE,
    UINT32_MAX,
    UINT64_MAX,
    InferenceTrace,
)

__all__ = [
    "cancel_request",
    "claim_direct_send",
    "created_senders",
    "make_request",
    "new_request",
    "release_flags",
]


def make_request(
    inputs: Sequence[Tensor],
    requested_output_names: Sequence[str],
    *,
    model_name: str,
    model_version: int = -1,
    request_id: str = "",
    correlation_id: int | str = 0,
    flags: int = 0,
    timeout: int = 0,
    parameters: Mapping[str, ParameterValue] | str | None = None,
    sender: InferenceResponseSender | None = None,
    trace: InferenceTrace | None = None,
) -> InferenceRequest:
    """Build the request ``execute`` receives (the runtime's constructor).

    ``parameters`` may be the JSON object text Triton hands over (kept as given) or a dict.
    ``sender`` is the request's response sender (the runtime makes one per request).

    Raises:
        TypeError, TritonModelException: as ``InferenceRequest()``; ``ValueError`` when
            ``parameters`` is text that is not a JSON object.
    """
    as_text: str | None = None
    if parameters == "{}":
        parameters = None  # what Triton hands over for a request without parameters
    elif isinstance(parameters, str):
        decoded = json.loads(parameters)
        if not isinstance(decoded, dict):
            raise ValueError(f"make_request(): {parameters=!r} is not a JSON object")
        as_text = parameters
        parameters = None
    request = InferenceRequest(
        model_name=model_name,
        inputs=inputs,
        requested_output_names=requested_output_names,
        request_id=request_id,
        correlation_id=correlation_id,
        model_version=model_version,
        flags=flags,
        timeout=timeout,
        trace=trace,
        parameters=parameters,
    )
    if as_text is not None:
        request._parameters = as_text
    if sender is not None:
        request._sender = sender
    return request


_new_request: Final = object.__new__
_NO_NAMES: Final[frozenset[str]] = frozenset()


def new_request(
    inputs: list[Tensor],
    requested_output_names: Collection[str],
    model_name: str,
    model_version: int,
    request_id: str,
    correlation_id: int | str,
    flags: int,
    timeout: int,
    parameters: str,
    source: SenderSource,
    index: int,
) -> InferenceRequest:
    """The request ``execute`` receives, built for the runtime: the same object as
    :func:`make_request` gives, without re-checking what the runtime already checked.

    ``inputs`` is kept (not copied): a list of ``Tensor`` the runtime owns;
    ``requested_output_names`` are non-empty names; ``model_name`` and ``model_version``
    come from the loaded model. The request's sender comes from ``source`` when the model
    first asks for it (``index``: the request's place in the batch). The caller's values
    (ids, flags, timeout, ``parameters`` as JSON object text) take the fast path only when
    they are what the public constructor accepts unchanged; anything else goes through it,
    so its errors stay the same.

    Raises:
        TypeError, TritonModelException, ValueError: as :func:`make_request`.
    """
    if not (
        type(request_id) is str
        and (type(correlation_id) is str
             or (type(correlation_id) is int and 0 <= correlation_id <= UINT64_MAX))
        and type(flags) is int and 0 <= flags <= UINT32_MAX
        and type(timeout) is int and 0 <= timeout <= UINT64_MAX
        and parameters == "{}"
    ):  # fmt: skip
        request = make_request(
            inputs, list(requested_output_names), model_name=model_name,
            model_version=model_version, request_id=request_id,
            correlation_id=correlation_id, flags=flags, timeout=timeout,
            parameters=parameters,
        )  # fmt: skip
    else:
        request = _new_request(InferenceRequest)
        request._inputs = inputs
        request._requested_output_names = set(requested_output_names)
        request._request_id = request_id
        request._correlation_id = correlation_id
        request._flags = flags
        request._timeout = timeout
        request._parameters = "{}"
        request._model_name = model_name
        request._model_version = model_version
        request._preferred_memory = NO_PREFERENCE
        request._trace = NO_TRACE
        request._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        request._cancelled = False
        request._sender = None
    request._source = source
    request._index = index
    return request


def claim_direct_send(request: InferenceRequest, response: InferenceResponse) -> bool:
    """For the ``response`` a non-decoupled ``execute`` returned: True when the model never
    took the request's sender, so the runtime delivers the response itself (its outputs are
    pruned to the requested ones here, as the sender's ``send`` does; a sender made later
    counts it as sent); False: send it through ``request.get_response_sender()``."""
    with _LAZY_LOCK:
        if request._sender is not None:
            return False
        request._sender = _DELIVERED
    prune_output_tensors(response, request._requested_output_names)
    return True


def created_senders(requests: list[InferenceRequest]) -> list[InferenceResponseSender]:
    """The senders made for ``requests`` so far (the runtime closes them when the requests
    end; one made later comes closed from its source)."""
    with _LAZY_LOCK:  # a sender being made now is seen, or sees its source closed
        senders = [r._sender for r in requests]
    return [s for s in senders if type(s) is InferenceResponseSender]


def cancel_request(request: InferenceRequest) -> None:
    """Mark ``request`` cancelled: ``is_cancelled()`` turns true (the runtime calls it when
    the client cancels)."""
    request._cancelled = True


def release_flags(request: InferenceRequest) -> int:
    """The release flags the model set (``TRITONSERVER_REQUEST_RELEASE_ALL`` unless
    ``set_release_flags`` changed them)."""
    return request._release_flags
