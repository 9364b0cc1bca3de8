"""Where ``pb_utils`` calls that need a running model (BLS, model control) go.

The runtime installs a :class:`ModelBackend` for the model it runs; the ``InferenceRequest``
methods and the model-control functions reach it through :func:`get_backend`.

Lookup order: the backend set in the current :mod:`contextvars` context (:func:`set_backend`,
what the runtime uses around each ``execute`` of an in-process model, so that several models
in one process each reach their own), then the process-wide one
(:func:`set_process_backend`, what a stub process running one model uses, so that threads the
model starts itself reach it too). Threads do not inherit context variables, so a thread
started by an in-process model sees only the process-wide backend.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from pb_tensor.errors import TritonModelException

if TYPE_CHECKING:
    from pb_tensor.utils._request import InferenceRequest
    from pb_tensor.utils._response import InferenceResponse

__all__ = [
    "BLS_OUTSIDE_EXECUTE_MESSAGE",
    "NO_BACKEND_MESSAGE",
    "ModelBackend",
    "get_backend",
    "get_backend_or_none",
    "set_backend",
    "set_process_backend",
]

BLS_OUTSIDE_EXECUTE_MESSAGE = "BLS is only supported during the 'execute' function."
"""Triton's error for BLS in ``initialize``/``finalize``: a backend raises it (as a
``TritonModelException``) from ``exec_request`` outside ``execute``."""

NO_BACKEND_MESSAGE = (
    BLS_OUTSIDE_EXECUTE_MESSAGE + " "
    "(No pb_tensor runtime is serving a model here: load the model with "
    "pb_tensor.runtime.ModelRepository to use this outside Triton.)"
)


class ModelBackend(Protocol):
    """What a running model's ``pb_utils`` calls reach. The runtime implements it.

    Every method may raise :class:`~pb_tensor.errors.TritonModelException` with Triton's message
    (an unknown model, BLS outside ``execute`` ...); ``pb_utils`` lets it propagate unchanged.
    """

    def exec_request(
        self, request: InferenceRequest, *, decoupled: bool, timeout_us: int | None
    ) -> InferenceResponse | Iterator[InferenceResponse]:
        """Run a BLS request: one response, or (``decoupled``) an iterator of responses that
        ends after the response carrying the final flag (Triton yields that one too, often
        empty). An iterator with a callable ``cancel()`` gets it called by
        ``ResponseIterator.cancel()``. ``timeout_us`` is ``request.timeout()`` (None for 0)."""
        ...

    def is_model_decoupled(self) -> bool:
        """Whether the model being served uses the decoupled transaction policy."""
        ...

    def model_name(self) -> str:
        """The name of the model being served (the logger's child name)."""
        ...

    def model_dir(self) -> str:
        """``pb_utils.get_model_dir()``: the folder of the served ``model.py``, as Triton
        gives it: ``<repo>/<model>/<version>``."""
        ...

    def load_model(self, model_name: str, config: str, files: dict[str, bytes] | None) -> None:
        """``pb_utils.load_model``: load (or reload) a model of the repository."""
        ...

    def unload_model(self, model_name: str, unload_dependents: bool) -> None:
        """``pb_utils.unload_model``."""
        ...

    def is_model_ready(self, model_name: str, model_version: str) -> bool:
        """``pb_utils.is_model_ready`` (``model_version`` "" means the latest)."""
        ...


_process_backend: ModelBackend | None = None
_context_backend: contextvars.ContextVar[ModelBackend | None] = contextvars.ContextVar(
    "pb_tensor_utils_backend", default=None
)


def set_backend(backend: ModelBackend | None) -> ModelBackend | None:
    """Set the backend of the current context (thread / asyncio task); returns the previous
    context value (None when none was set), so callers restore it in a ``finally``."""
    previous = _context_backend.get()
    _context_backend.set(backend)
    return previous


def set_process_backend(backend: ModelBackend | None) -> ModelBackend | None:
    """Set the process-wide fallback backend (a stub process serving one model); returns the
    previous one."""
    global _process_backend
    previous = _process_backend
    _process_backend = backend
    return previous


def get_backend_or_none() -> ModelBackend | None:
    """The backend serving the current code, or None."""
    backend = _context_backend.get()
    return backend if backend is not None else _process_backend


def get_backend() -> ModelBackend:
    """The backend serving the current code.

    Raises:
        TritonModelException: no runtime serves a model here (BLS or model control called
            outside a model loaded by ``pb_tensor.runtime``).
    """
    backend = get_backend_or_none()
    if backend is None:
        raise TritonModelException(NO_BACKEND_MESSAGE)
    return backend
