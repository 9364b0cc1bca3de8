"""``ModelRepository``: Triton's model repository layout, loading models from it."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pb_tensor import Tensor
from pb_tensor.runtime import _schema
from pb_tensor.runtime._engines import Handler, StubEngine, StubFailure
from pb_tensor.runtime._ensemble import EnsembleModel
from pb_tensor.runtime._ensemble_load import check_ensemble_config, is_ensemble, load_ensemble
from pb_tensor.runtime._errors import InferenceError, ModelLoadError
from pb_tensor.runtime._host import (
    HostInfo,
)
from pb_tensor.runtime._host_policy import (
    HostPolicyError,
    check_binding,
    check_host_policies,
)
from pb_tensor.runtime._inprocess import InProcessEngine
from pb_tensor.runtime._instance_infos import host_infos
from pb_tensor.runtime._local_backend import LocalBackend
from pb_tensor.runtime._model import LoadedModel
from pb_tensor.runtime._model_import import (
    UserModelError,
    load_model_module,
    model_class,
    run_auto_complete,
)
from pb_tensor.runtime._scheduling import Instance
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._validate import ModelSpec
from pb_tensor.shm import SharedMemoryPool

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["ModelRepository", "example_repository"]

_POOL_SIZE = 8 << 20
_POOL_GROWTH = 64 << 20


def example_repository() -> str:
    """Path of the example model repository (``examples/model_repository``) of a source
    checkout of pb-tensor: add_sub, string_identity, torch_dlpack, decoupled_repeat,
    bls_add_sub, auto_complete.

    Raises:
        FileNotFoundError: pb-tensor was installed from a wheel, which does not ship it.
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "examples", "model_repository")
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"no example model repository at {path!r}: it comes with a clone of the project"
        )
    return path


class ModelRepository:
    """A Triton model repository on disk: ``<path>/<model>/config.pbtxt`` and
    ``<path>/<model>/<version>/model.py``.

    A context manager: closing it unloads every model it loaded (BLS targets included) and
    removes the shared-memory pool the stubs use.

    Three opt-ins relax what the models it serves may do, where pb-tensor is more permissive
    than Triton (all off by default, so that a model passing here passes in Triton):
    ``bf16_as_numpy`` lets ``as_numpy()`` of a BF16 tensor inside a model give an
    ``ml_dtypes.bfloat16`` view (Triton raises); ``share_inputs`` hands in-process models
    the caller's host arrays without copying them (a model writing into an input then
    changes the caller's array; Triton's models write into a copy); ``pb_tensor_extras``
    gives models pb-tensor's additions to Triton's API (``triton_dtype()``, ``__dlpack__``'s
    DLPack 1.x keywords, pickling tensors, plain ``int`` codes for ``TritonError``, every
    C-contiguous empty DLPack tensor: :mod:`pb_tensor.extras_policy`).

    ``host_policies`` are tritonserver's ``--host-policy`` settings, ``{policy name:
    {"cpu-cores": "<lower>-<upper>[,...]"}}``: each stub process runs on the CPUs of its
    instance's policy (the instance group's ``host_policy``, else ``cpu``, ``gpu_<device>``
    or ``model`` by its kind), bound before the model's ``initialize`` as Triton binds the
    instance's thread. In-process instances run on the caller's threads and are not bound
    (a set the kernel refuses still fails their load, as in Triton); ``numa-node`` is
    refused (no NUMA memory binding here).

    Raises:
        ModelLoadError: ``path`` is not a directory, or ``host_policies`` holds a setting
            Triton or this runtime refuses (Triton's message).
        TypeError: ``host_policies`` is not a mapping of mappings of strings.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        bf16_as_numpy: bool = False,
        share_inputs: bool = False,
        pb_tensor_extras: bool = False,
        host_policies: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        try:
            self._host_policies = check_host_policies(host_policies)
        except HostPolicyError as exc:
            raise ModelLoadError(str(exc)) from None
        self._bf16_as_numpy = bool(bf16_as_numpy)
        self._pb_tensor_extras = bool(pb_tensor_extras)
        self._share_inputs = bool(share_inputs)
        self._path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(self._path):
            raise ModelLoadError(f"model repository {self._path!r} is not a directory")
        self._pool: SharedMemoryPool | None = None
        self._lock = threading.RLock()
        self._models: list[LoadedModel] = []
        self._bls: dict[tuple[str, int, bool], LoadedModel] = {}
        self._closed = False

    @property
    def path(self) -> str:
        """The repository's absolute path."""
        return self._path

    def models(self) -> list[str]:
        """Names of the model directories (with a ``config.pbtxt`` or a version directory),
        sorted."""
        names = []
        for entry in sorted(os.listdir(self._path)):
            d = os.path.join(self._path, entry)
            if os.path.isdir(d) and (
                os.path.isfile(os.path.join(d, "config.pbtxt")) or self._version_dirs(d)
            ):
                names.append(entry)
        return names

    @staticmethod
    def _version_dirs(model_dir: str) -> list[int]:
        out = []
        for entry in os.listdir(model_dir):
            if entry.isdigit() and os.path.isdir(os.path.join(model_dir, entry)):
                out.append(int(entry))
        return sorted(out)

    def versions(self, name: str) -> list[int]:
        """The version numbers of model ``name`` (its numeric subdirectories), ascending."""
        d = os.path.join(self._path, name)
        return self._version_dirs(d) if os.path.isdir(d) else []

    @property
    def pool(self) -> SharedMemoryPool:
        """The shared-memory pool the stubs of this repository exchange tensors through."""
        with self._lock:
            if self._pool is None:
                self._pool = SharedMemoryPool.create(_POOL_SIZE, growth=_POOL_GROWTH)
            return self._pool

    # -- loading ------------------------------------------------------------------------------
    def load(
        self,
        name: str,
        *,
        version: int | None = None,
        isolated: bool = True,
        timeout: float | None = None,
    ) -> LoadedModel:
        """Load model ``name`` (the latest version unless ``version`` is given).

        Reads ``config.pbtxt`` (optional when the model completes its configuration with
        ``auto_complete_config``), imports ``model.py``, runs ``auto_complete_config`` and
        ``initialize(args)`` with Triton's arguments. With ``isolated`` (the default) the
        model runs in its own stub process; otherwise in this process. ``timeout`` (seconds)
        limits each ``execute``.

        Raises:
            ModelLoadError: no such model or version, a malformed or invalid configuration, a
                missing ``model.py``, no ``TritonPythonModel``, or ``auto_complete_config`` /
                ``initialize`` raised (the message names the model, the file and Triton's
                message).
            TritonModelException: the repository is closed.
        """
        __tracebackhide__ = True  # pytest shows the test's line, not the runtime's frames
        if self._closed:
            raise ModelLoadError(f"model repository {self._path!r} is closed")
        if isinstance(version, bool) or (version is not None and not isinstance(version, int)):
            raise TypeError(f"version must be an int or None, not {type(version).__name__}")
        model_dir = os.path.join(self._path, name)
        if not name or os.sep in name or not os.path.isdir(model_dir):
            raise ModelLoadError(
                f"failed to load model '{name}': no model directory {model_dir!r}"
            )
        config_path = os.path.join(model_dir, "config.pbtxt")
        try:
            config = (
                _schema.parse_config_file(config_path)
                if os.path.isfile(config_path)
                else _schema.new_config()
            )
        except _schema.ConfigError as exc:
            raise ModelLoadError(f"failed to load model '{name}': {exc}") from None
        _schema.normalize(config, name)
        if is_ensemble(config):
            check_ensemble_config(config, name, model_dir)
        versions = self._version_dirs(model_dir)
        if not versions:
            hint = ""
            if os.path.isfile(os.path.join(model_dir, _schema.PYTHON_FILENAME)):
                hint = (f" ({_schema.PYTHON_FILENAME} is in the model folder; Triton's layout is "
                        f"<model>/<version>/{_schema.PYTHON_FILENAME}: move it to "
                        f"{os.path.join(model_dir, '1', _schema.PYTHON_FILENAME)!r})")
            raise ModelLoadError(
                f"failed to load model '{name}': at least one version must be available under "
                f"the version policy of model '{name}'{hint}"
            )
        if version is None:
            version = versions[-1]
        elif version not in versions:
            raise ModelLoadError(
                f"failed to load model '{name}' version {version}: no directory "
                f"{os.path.join(model_dir, str(version))!r} (versions: {versions})"
            )
        model_path = os.path.join(
            model_dir, str(version), config.default_model_filename or _schema.PYTHON_FILENAME
        )
        where = f"model '{name}' version {version} ({model_path})"
        if is_ensemble(config):
            ensemble = load_ensemble(self, config, name=name, version=version,
                                     model_dir=model_dir, isolated=isolated, timeout=timeout)
            with self._lock:
                self._models.append(ensemble)
            return ensemble
        if config.backend != _schema.PYTHON_BACKEND:
            raise ModelLoadError(
                f"failed to load {where}: backend {config.backend!r}: only Python models run "
                "here"
            )
        holder: list[LoadedModel] = []

        def on_stub_message(e: StubEngine, kind: str, tensors: list[Tensor], body: Any) -> None:
            # The model object exists only once the configuration is complete.
            holder[0].on_stub_message(e, kind, tensors, body)

        engines: list[StubEngine] = []
        cls: type | None = None
        try:
            if isolated:
                engines.append(StubEngine(self.pool, model_path, name, on_stub_message))
                completed = engines[0].spawn(_schema.config_to_dict(config))
            else:
                cls = model_class(load_model_module(model_path, name))
                completed = run_auto_complete(cls, name, _schema.config_to_dict(config))
            final = _schema.config_from_dict(completed or {}, where=where)
            _schema.normalize(final, name)
            _schema.normalize_instance_groups(final, _gpu_count)
            _schema.validate(final, model_dir)
            infos = [
                dataclasses.replace(
                    info, bf16_as_numpy=self._bf16_as_numpy, share_inputs=self._share_inputs,
                    pb_tensor_extras=self._pb_tensor_extras,
                )
                for info in host_infos(final, name, version, model_dir, model_path,
                                        self._host_policies)
            ]
            if not isolated:  # not bound, but refused where Triton's binding would fail
                for cpus in {info.cpus for info in infos if info.cpus}:
                    check_binding(cpus)
            model = LoadedModel(
                self, name=name, version=version, config=_schema.config_to_dict(final),
                spec=ModelSpec.from_config(final), isolated=isolated,
                decoupled=infos[0].decoupled, instance_name=infos[0].instance_name,
                timeout=timeout,
            )  # fmt: skip
            holder.append(model)
            if isolated:
                model._attach(self._start_stubs(engines, infos, model_path, name,
                                                on_stub_message))  # fmt: skip
            else:
                if cls is None:  # unreachable: set on the in-process path above
                    raise UserModelError("the model class was not loaded")
                model._attach([
                    Instance(InProcessEngine(info, cls, LocalBackend(model, info)),
                             info.instance_name)
                    for info in infos
                ])  # fmt: skip
        except (StubFailure, UserModelError, _schema.ConfigError, HostPolicyError) as exc:
            for engine in engines:
                engine.kill()
            raise ModelLoadError(f"failed to load {where}: {exc}") from None
        except BaseException:
            for engine in engines:
                engine.kill()
            raise
        with self._lock:
            self._models.append(model)
        return model

    def _start_stubs(
        self, engines: list[StubEngine], infos: list[HostInfo], model_path: str, name: str,
        handler: Handler,
    ) -> list[Instance]:
        """Initialize the first stub (``engines[0]``, spawned for ``auto_complete_config``)
        and start one more per further instance, in parallel, as Triton loads instances;
        ``engines`` collects every stub started (for killing on failure).

        Raises:
            StubFailure: a stub failed to start or its ``initialize`` raised (the first
                failure, by instance order).
        """
        for _ in infos[1:]:
            engines.append(StubEngine(self.pool, model_path, name, handler))
        failures: list[StubFailure | None] = [None] * len(infos)

        def start(index: int) -> None:
            try:
                if index:
                    engines[index].spawn(None)
                engines[index].initialize(infos[index])
            except StubFailure as exc:
                failures[index] = exc

        threads = [threading.Thread(target=start, args=(i,), daemon=True)
                   for i in range(1, len(infos))]  # fmt: skip
        for thread in threads:
            thread.start()
        start(0)
        for thread in threads:
            thread.join()
        for failure in failures:
            if failure is not None:
                raise failure
        return [Instance(e, info.instance_name) for e, info in zip(engines, infos)]

    def shared_model(
        self, name: str, version: int, isolated: bool, timeout: float | None = None
    ) -> LoadedModel:
        """Model ``name`` (``version``, or the latest when it is not positive) as BLS requests
        and ensembles share it: loaded on first use in ``isolated`` mode, then reused.

        Raises:
            ModelLoadError: as :meth:`load`.
        """
        key = (name, version if version > 0 else -1, isolated)
        with self._lock:
            model = self._bls.get(key)
            if model is not None and model.loaded:
                return model
            model = self.load(name, version=version if version > 0 else None,
                              isolated=isolated, timeout=timeout)
            self._bls[key] = model
            return model

    def bls_target(
        self, name: str, version: int, isolated: bool, timeout: float | None = None
    ) -> LoadedModel:
        """The model a BLS request addresses: the one loaded already in ``isolated`` mode
        (the latest loaded version unless ``version`` > 0 names one; a model calling itself
        reaches its own instances), else loaded on first use (with the caller's
        ``timeout``).

        Raises:
            InferenceError: Triton's ``Request for unknown model`` error when the repository
                has no such model (or it fails to load: the load error follows).
        """
        key = (name, version if version > 0 else -1, isolated)
        with self._lock:
            model = self._bls.get(key)
            if model is not None and model.loaded:
                return model
            loaded = [m for m in self._models
                      if m.loaded and m.name == name and m.isolated == isolated
                      and (version <= 0 or m.version == version)]  # fmt: skip
            if loaded:
                return max(loaded, key=lambda m: m.version)
            if name not in self.models():
                raise InferenceError(
                    f"Request for unknown model: '{name}' is not found", TritonError.INVALID_ARG
                )
            try:
                return self.shared_model(name, version, isolated, timeout)
            except ModelLoadError as exc:
                raise InferenceError(
                    f"Request for unknown model: '{name}' is not found ({exc})",
                    TritonError.INVALID_ARG,
                ) from None

    def control(self, kind: str, payload: Any, isolated: bool) -> Any:
        """``pb_utils.load_model`` / ``unload_model`` / ``is_model_ready`` from a model."""
        if kind == "load_model":
            name, config, files = payload
            if config or files:
                raise InferenceError(
                    "load_model with a configuration override or files is not supported by "
                    "pb_tensor.runtime", TritonError.UNSUPPORTED,
                )
            with self._lock:
                for key in [k for k in self._bls if k[0] == name]:
                    self._bls.pop(key).unload()
            self.bls_target(name, -1, isolated)
            return None
        if kind == "unload_model":
            name, unload_dependents = payload
            with self._lock:
                for key in [k for k in self._bls if k[0] == name]:
                    model = self._bls.pop(key)
                    if isinstance(model, EnsembleModel):
                        model.unload(unload_dependents=bool(unload_dependents))
                    else:
                        model.unload()
            return None
        if kind == "is_model_ready":
            name, version = payload
            with self._lock:
                return any(
                    m.loaded and m.name == name and (not version or str(m.version) == version)
                    for m in self._models
                )
        raise InferenceError(f"unknown runtime request {kind!r}", TritonError.INTERNAL)

    def forget(self, model: LoadedModel) -> None:
        """Drop an unloaded model from the bookkeeping."""
        with self._lock:
            if model in self._models:
                self._models.remove(model)
            for key, value in list(self._bls.items()):
                if value is model:
                    del self._bls[key]

    def close(self) -> None:
        """Unload every model loaded through this repository and remove the pool."""
        with self._lock:
            self._closed = True
            models = list(reversed(self._models))
        for model in models:
            model.unload()
        with self._lock:
            self._bls.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __enter__(self) -> ModelRepository:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        # Never raises: pytest shows reprs of half-built objects (a constructor that raised).
        path = getattr(self, "_path", None)
        return f"<ModelRepository {path!r}, {len(getattr(self, '_models', ()))} loaded>"


def _gpu_count() -> int:
    from pb_tensor import cuda  # only a KIND_GPU instance group needs the CUDA facade

    return cuda.device_count()
