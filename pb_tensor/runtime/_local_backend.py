"""The BLS and model-control calls of an in-process model, answered by its repository."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pb_tensor.errors import TritonModelException
from pb_tensor.runtime._calls import BlsResponses
from pb_tensor.runtime._errors import model_control_error
from pb_tensor.runtime._host import HostInfo
from pb_tensor.runtime._seam import InferenceRequest, InferenceResponse
from pb_tensor.runtime._tracker import Cancellation
from pb_tensor.runtime._values import first_response, response_of

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pb_tensor.runtime._model import LoadedModel

__all__ = ["LocalBackend"]


class LocalBackend:
    """``pb_utils``' BLS and model-control calls of an in-process model."""

    def __init__(self, model: LoadedModel, info: HostInfo) -> None:
        self._model = model
        self._info = info

    def exec_request(
        self, request: InferenceRequest, *, decoupled: bool, timeout_us: int | None
    ) -> InferenceResponse | Iterator[InferenceResponse]:
        cancellation = Cancellation()
        replies = self._model.bls_replies(request, timeout_us, decoupled, cancellation)
        preferred = request.preferred_memory()
        responses = (response_of(r, preferred) for r in replies)
        if decoupled:
            return BlsResponses(responses, cancellation)
        return first_response(responses)

    def is_model_decoupled(self) -> bool:
        return self._info.decoupled

    def model_name(self) -> str:
        return self._info.name

    def model_dir(self) -> str:
        return self._info.model_dir

    def _control(self, kind: str, payload: tuple[Any, ...]) -> Any:
        try:
            return self._model._repository.control(kind, payload, False)
        except TritonModelException as exc:
            # Upstream's stub gets the server's error and raises it with its own prefix.
            raise TritonModelException(
                model_control_error(kind, self._info.instance_name, str(exc))
            ) from None

    def load_model(self, model_name: str, config: str, files: dict[str, bytes] | None) -> None:
        self._control("load_model", (model_name, config, files))

    def unload_model(self, model_name: str, unload_dependents: bool) -> None:
        self._control("unload_model", (model_name, unload_dependents))

    def is_model_ready(self, model_name: str, model_version: str) -> bool:
        return bool(self._control("is_model_ready", (model_name, model_version)))
