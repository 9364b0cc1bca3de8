"""What model code sees while the runtime runs it, as in Triton's stub: ``sys.argv`` of
``['']``, BF16 ``as_numpy()`` refused unless the repository opted in, and BLS only while the
model serves requests (:class:`ExecuteOnlyBls`)."""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Callable, Iterator

from pb_tensor.extras_policy import extras_context, reset_extras_context
from pb_tensor.numpy_policy import bf16_numpy_context, reset_bf16_numpy_context
from pb_tensor.runtime._seam import InferenceRequest, InferenceResponse, ModelBackend

__all__ = ["ExecuteOnlyBls", "ModelCode", "model_argv"]


class _Argv:
    """The process's ``sys.argv`` swap: how many model calls run, and the host's ``argv``
    while they do. An instance, not class attributes: assigning a class attribute
    invalidates the class's attribute caches, on every model call."""

    __slots__ = ("lock", "saved", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.saved: list[str] | None = None


_ARGV = _Argv()


class ModelCode:
    """What Triton's stub gives model code while it runs (a class, not a generator: it wraps
    every ``execute``). ``sys.argv`` is ``['']``, as in the stub's interpreter started without
    arguments: ``unittest.main("model", exit=False)`` inside a model parses no test names out
    of the host's command line; the host's ``argv`` comes back when the last model call of
    the process returns (calls may overlap in threads). With ``bf16`` given, BF16
    ``as_numpy()`` follows it in this context (:mod:`pb_tensor.numpy_policy`); with ``extras``
    given, so do pb-tensor's additions to Triton's API (:mod:`pb_tensor.extras_policy`)."""

    __slots__ = ("_bf16", "_extras", "_extras_token", "_token")

    def __init__(self, bf16: bool | None = None, extras: bool | None = None) -> None:
        self._bf16 = bf16
        self._extras = extras
        self._token: contextvars.Token[bool | None] | None = None
        self._extras_token: contextvars.Token[bool | None] | None = None

    def __enter__(self) -> None:
        argv = _ARGV
        with argv.lock:
            if argv.users == 0:
                argv.saved = getattr(sys, "argv", None)
                sys.argv = [""]
            argv.users += 1
        if self._bf16 is not None:
            self._token = bf16_numpy_context(self._bf16)
        if self._extras is not None:
            self._extras_token = extras_context(self._extras)

    def __exit__(self, *exc: object) -> None:
        if self._extras_token is not None:
            reset_extras_context(self._extras_token)
            self._extras_token = None
        if self._token is not None:
            reset_bf16_numpy_context(self._token)
            self._token = None
        argv = _ARGV
        with argv.lock:
            argv.users -= 1
            if argv.users == 0:
                if argv.saved is None:
                    del sys.argv
                else:
                    sys.argv = argv.saved
                argv.saved = None


def model_argv() -> contextlib.AbstractContextManager[None]:
    """A context in which ``sys.argv`` is ``['']``, as model code sees it in Triton's stub
    (import and ``auto_complete_config`` run in it; :class:`ModelHost` uses it for every
    other call)."""
    return ModelCode()


class ExecuteOnlyBls:
    """The backend a hosted model reaches: its host's, with BLS refused outside ``execute``
    (``check_bls`` raises Triton's error then: ``ModelHost.check_bls``); model control passes
    through."""

    def __init__(self, inner: ModelBackend, check_bls: Callable[[], None]) -> None:
        self._inner = inner
        self._check_bls = check_bls

    def exec_request(
        self, request: InferenceRequest, *, decoupled: bool, timeout_us: int | None
    ) -> InferenceResponse | Iterator[InferenceResponse]:
        self._check_bls()
        return self._inner.exec_request(request, decoupled=decoupled, timeout_us=timeout_us)

    def is_model_decoupled(self) -> bool:
        return self._inner.is_model_decoupled()

    def model_name(self) -> str:
        return self._inner.model_name()

    def model_dir(self) -> str:
        return self._inner.model_dir()

    def load_model(self, model_name: str, config: str, files: dict[str, bytes] | None) -> None:
        self._inner.load_model(model_name, config, files)

    def unload_model(self, model_name: str, unload_dependents: bool) -> None:
        self._inner.unload_model(model_name, unload_dependents)

    def is_model_ready(self, model_name: str, model_version: str) -> bool:
        return self._inner.is_model_ready(model_name, model_version)
