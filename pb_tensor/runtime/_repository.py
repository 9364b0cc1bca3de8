"""``ModelRepository``: Triton's model repository layout, loading models from it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pb_tensor import Tensor
from pb_tensor.runtime import _schema
from pb_tensor.runtime._engines import Handler, StubEngine, StubFailure
from pb_tensor.runtime._ensemble import EnsembleModel
from pb_tensor.runtime._ensemble_load import check_ensemble_config, is_ensemble, load_ensemble
from pb_tensor.runtime._errors import InferenceError, ModelLoadError, VersionNotServed
from pb_tensor.runtime._host import (
    HostInfo,
)
from pb_tensor.runtime._host_policy import (
    HostPolicyError,
    check_binding,
    check_host_policies,
)
from pb_tensor.runtime._inprocess import InProcessEngine
from pb_tensor.runtime._instance_infos import host_infos, instance_signatures
from pb_tensor.runtime._local_backend import LocalBackend
from pb_tensor.runtime._model import LoadedModel
from pb_tensor.runtime._model_import import (
    UserModelError,
    load_model_module,
    model_class,
    run_auto_complete,
)
from pb_tensor.runtime._scheduling import Instance, InstanceFactory
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._unloads import BackgroundUnloads
from pb_tensor.runtime._updates import (
    config_change_requires_reload,
    instance_groups,
    model_timestamps,
    newest_time,
    version_modified,
)
from pb_tensor.runtime._validate import ModelSpec
from pb_tensor.shm import SharedMemoryPool

log = logging.getLogger("pb_tensor.runtime")

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["ModelRepository", "ServerModels", "example_repository", "model_version_of",
           "parse_model_version"]

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


_INT64_MAX = 2**63 - 1


def parse_model_version(text: str) -> int | None:
    """A model version string read as Triton reads it (``std::stol`` in
    ``GetModelVersionFromString``): -1 for ``""``, else the value of leading blanks, a sign
    and digits (what follows them is ignored); None when there are no digits or the value is
    no 64-bit integer (``stol`` throws). Negative values are the caller's to refuse."""
    if not text:
        return -1
    body = text.lstrip(" \t\n\v\f\r")
    sign = 1
    if body[:1] in ("+", "-"):
        sign = -1 if body[0] == "-" else 1
        body = body[1:]
    digits = len(body) - len(body.lstrip("0123456789"))
    if not digits:
        return None
    value = sign * int(body[:digits])
    return value if -_INT64_MAX - 1 <= value <= _INT64_MAX else None


def model_version_of(text: str) -> int:
    """The version a model-control call's version string names (-1 for ""), read as
    upstream's stub reads it (:func:`parse_model_version`).

    Raises:
        InferenceError: upstream's text for a string that is no integer or is negative.
    """
    value = parse_model_version(text)
    if value is None:
        raise InferenceError(
            f"failed to get model version from specified version string '{text}' (details: "
            "stol), version should be an integral value > 0", TritonError.INVALID_ARG,
        )  # fmt: skip
    if value < 0 and text:
        raise InferenceError(
            f"failed to get model version from specified version string '{text}', version "
            "should be an integral value > 0", TritonError.INVALID_ARG,
        )  # fmt: skip
    return value


def _policy_versions(config: Any, versions: list[int]) -> list[int]:
    """The versions (of ``versions``, ascending) the configuration's ``version_policy``
    serves (core's ``VersionsToLoad``; no policy: the newest one)."""
    policy = config.version_policy
    if policy.HasField("specific"):
        return sorted(set(policy.specific.versions) & set(versions))
    if policy.HasField("all"):
        return list(versions)
    count = policy.latest.num_versions if policy.HasField("latest") else 1
    return list(versions[-count:]) if count > 0 else []


class ServerModels(Protocol):
    """The models of the server a repository serves in (``pb-tensor serve``): they decide
    what the repository's models reach through BLS and ``pb_utils``' model control, as
    Triton's server decides for its models. A repository without one loads the models its
    models name on first use. Each method raises a ``TritonModelException`` whose message
    is the server's (Triton's) error text."""

    def bls_target(self, name: str, version: int, isolated: bool) -> LoadedModel:
        """The loaded model a BLS request to ``name`` runs on (``version``; -1: the
        latest)."""
        ...

    def load_model(self, name: str, config: str, files: Mapping[str, bytes]) -> None:
        """``pb_utils.load_model``: ``config`` ("" for none) and ``files`` as the model
        gave them."""
        ...

    def unload_model(self, name: str, unload_dependents: bool) -> None:
        """``pb_utils.unload_model``."""
        ...

    def ready_model(self, name: str, version: int) -> LoadedModel:
        """The loaded model ``pb_utils.is_model_ready`` asks about (``version``; -1: the
        latest)."""
        ...

    def repository_of(self, name: str) -> ModelRepository | None:
        """The server's repository that holds model ``name`` (Triton finds an ensemble's
        composing models in every repository); None when none does."""
        ...

    def step_model(self, name: str, version: int, isolated: bool) -> LoadedModel | None:
        """The server's model an ensemble's step runs on (loaded now when it is not, as
        Triton loads an ensemble's composing models); None when the server does not serve
        that version (the ensemble then fails to load, with Triton's message). Raises
        ``ModelLoadError`` when the model fails to load."""
        ...


class ModelRepository:
    """A Triton model repository on disk: ``<path>/<model>/config.pbtxt`` and
    ``<path>/<model>/<version>/model.py``.

    A context manager: closing it unloads every model it loaded (BLS targets included) and
    removes the shared-memory pool the stubs use.

    ``server``: the models of a server the repository serves in (see :class:`ServerModels`);
    None (the default) for a repository of its own.

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
        server: ServerModels | None = None,
    ) -> None:
        self._server = server
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
        # Names of the models a load was started for (Triton keeps an entry for each, and
        # says "has no available versions" rather than "is not found" once it had one).
        self._tried: set[str] = set()
        # pb_utils' model control without a server, as Triton's: a BLS target's timestamp
        # when it loaded (a load request reloads it only when its directory changed), and
        # the copies being unloaded in the background (an unload returns once started; they
        # take no new request meanwhile; close waits for them).
        self._stamps: dict[str, int] = {}
        # The directory timestamps of each model whose BLS copies loaded (core's
        # ModelTimestamp): a version whose files did not change is updated, not reloaded.
        self._timestamps: dict[str, dict[str, int]] = {}
        self._going: set[LoadedModel] = set()
        self._unloads = BackgroundUnloads()
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
            # (core ignores a version directory with leading zeros, such as "01")
            if (entry.isdigit() and not (len(entry) > 1 and entry[0] == "0")
                    and os.path.isdir(os.path.join(model_dir, entry))):  # fmt: skip
                out.append(int(entry))
        return sorted(out)

    def holder(self, name: str) -> ModelRepository | None:
        """The repository that holds model ``name``: this one, else (in a server) the
        server's repository that does; None when none does."""
        if name in self.models():
            return self
        return None if self._server is None else self._server.repository_of(name)

    def versions(self, name: str) -> list[int]:
        """The version numbers of model ``name`` (its numeric subdirectories), ascending."""
        d = os.path.join(self._path, name)
        return self._version_dirs(d) if os.path.isdir(d) else []

    def served_versions(self, name: str) -> list[int]:
        """The versions of model ``name`` its ``version_policy`` serves, ascending (core's
        ``VersionsToLoad``): the ``num_versions`` newest with ``latest`` (the default, one),
        every one with ``all``, and those of ``specific`` that have a directory. Empty when
        none does (Triton then refuses to load the model).

        Raises:
            ModelLoadError: no such model, or its ``config.pbtxt`` is malformed.
        """
        model_dir, config = self._read_config(name)
        return _policy_versions(config, self._version_dirs(model_dir))

    def read_config(self, name: str) -> Any:
        """Model ``name``'s configuration as a load reads it, normalized, before
        ``auto_complete_config`` (a ``ModelConfig`` message): what a later load compares with
        the one a loaded copy came from to decide between an instance update and a reload.

        Raises:
            ModelLoadError: no such model directory, or a malformed ``config.pbtxt``.
        """
        _, config = self._read_config(name)
        _schema.normalize(config, name)
        return config

    def _read_config(self, name: str) -> tuple[str, Any]:
        """Model ``name``'s directory and its ``config.pbtxt`` as written (an empty
        configuration without one).

        Raises:
            ModelLoadError: no such model directory, or a malformed ``config.pbtxt``.
        """
        model_dir = os.path.join(self._path, name)
        if not name or os.sep in name or not os.path.isdir(model_dir):
            raise ModelLoadError(
                f"failed to load model '{name}': no model directory {model_dir!r}"
            )
        config_path = os.path.join(model_dir, "config.pbtxt")
        try:
            config = (_schema.parse_config_file(config_path) if os.path.isfile(config_path)
                      else _schema.new_config())  # fmt: skip
        except _schema.ConfigError as exc:
            raise ModelLoadError(f"failed to load model '{name}': {exc}") from None
        return model_dir, config

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
        """Load model ``name``: ``version``, else the newest version its ``version_policy``
        serves (:meth:`served_versions`; the newest directory by default).

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
        model_dir, config = self._read_config(name)
        with self._lock:
            self._tried.add(name)
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
            served = _policy_versions(config, versions)
            if not served:
                raise ModelLoadError(
                    f"failed to load model '{name}': at least one version must be available "
                    f"under the version policy of model '{name}'"
                )
            version = served[-1]
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
        _check_stub_name(name, where, version)  # (the auto-complete stub's: the model's name)
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

            def plan(groups: Any) -> list[tuple[HostInfo, object]]:
                infos = [
                    dataclasses.replace(
                        info, bf16_as_numpy=self._bf16_as_numpy,
                        share_inputs=self._share_inputs, pb_tensor_extras=self._pb_tensor_extras,
                    )
                    for info in host_infos(groups, name, version, model_dir, model_path,
                                            self._host_policies)
                ]  # fmt: skip
                if not isolated:  # not bound, but refused where Triton's binding would fail
                    for cpus in {info.cpus for info in infos if info.cpus}:
                        check_binding(cpus)
                return list(zip(infos, instance_signatures(groups)))

            planned = plan(final)
            infos = [info for info, _ in planned]
            for info in infos:
                _check_stub_name(info.instance_name, where, version)
            model = LoadedModel(
                self, name=name, version=version, config=_schema.config_to_dict(final),
                spec=ModelSpec.from_config(final), isolated=isolated,
                decoupled=infos[0].decoupled, instance_name=infos[0].instance_name,
                timeout=timeout,
            )  # fmt: skip
            model.source_config = config
            holder.append(model)
            in_process_cls: type = object
            if not isolated:
                if cls is None:  # unreachable: set on the in-process path above
                    raise UserModelError("the model class was not loaded")
                in_process_cls = cls

            def start(more: list[HostInfo]) -> list[Instance]:
                """Instances for an update of the model's instance groups."""
                if isolated:
                    started: list[StubEngine] = [
                        StubEngine(self.pool, model_path, name, on_stub_message)
                    ]
                    try:
                        started[0].spawn(None)
                        return self._start_stubs(started, more, model_path, name,
                                                 on_stub_message)  # fmt: skip
                    except BaseException:
                        for engine in started:
                            engine.kill()
                        raise
                made: list[Instance] = []
                try:
                    for info in more:
                        made.append(Instance(
                            InProcessEngine(info, in_process_cls, LocalBackend(model, info)),
                            info.instance_name,
                        ))  # fmt: skip
                except BaseException:
                    for instance in made:
                        instance.engine.stop()
                    raise
                return made

            def retire(instance: Instance) -> None:
                def stop() -> None:
                    instance.engine.stop()  # (a finalize error is the stub's to log)

                self._unloads.start(name, stop)

            factory = InstanceFactory(plan, start, retire, _gpu_count)
            if isolated:
                instances = self._start_stubs(engines, infos, model_path, name,
                                              on_stub_message)  # fmt: skip
            else:
                instances = [
                    Instance(InProcessEngine(info, in_process_cls, LocalBackend(model, info)),
                             info.instance_name)
                    for info in infos
                ]  # fmt: skip
            for instance, (_, signature) in zip(instances, planned):
                instance.signature = signature
            model._attach(instances, factory)
        except (StubFailure, UserModelError, _schema.ConfigError, HostPolicyError) as exc:
            for engine in engines:
                engine.kill()
            if isinstance(exc, (StubFailure, UserModelError)):
                # What the stub reported, as python_backend's model / instance creation
                # gives it core (INTERNAL): the version fails as it is created.
                raise ModelLoadError(f"failed to load {where}: {exc}", version=version,
                                     reason=f"Internal: {exc}") from None
            # (A configuration core refuses mostly while it polls the repository, before
            # any version exists: its text stays the runtime's.)
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
        and ensembles share it: loaded on first use in ``isolated`` mode, then reused (the
        server's model, where the repository has a server that serves it).

        Raises:
            ModelLoadError: as :meth:`load`.
        """
        if self._server is not None:
            served = self._server.step_model(name, version, isolated)
            if served is None:
                raise VersionNotServed(
                    f"model '{name}' version {version} is not loaded by the server"
                )
            return served
        key = (name, version if version > 0 else -1, isolated)
        with self._lock:
            model = self._bls.get(key)
            if model is not None and model.loaded:
                return model
            timestamps = model_timestamps(os.path.join(self._path, name))
            model = self.load(name, version=version if version > 0 else None,
                              isolated=isolated, timeout=timeout)
            self._bls[key] = model
            self._stamps.setdefault(name, newest_time(timestamps))
            self._timestamps.setdefault(name, timestamps)
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
        if self._server is not None:
            return self._server.bls_target(name, version, isolated)
        key = (name, version if version > 0 else -1, isolated)
        with self._lock:
            model = self._bls.get(key)
            if model is not None and model.loaded:
                return model
            loaded = [m for m in self._models
                      if m.loaded and m.name == name and m.isolated == isolated
                      and (version <= 0 or m.version == version)
                      and m not in self._going]  # fmt: skip
            if loaded:
                return max(loaded, key=lambda m: m.version)
            if name not in self.models():
                raise InferenceError(
                    f"Request for unknown model: '{name}' is not found", TritonError.INVALID_ARG
                )
            # A version its policy does not serve is not Triton's to reach (GetModel's error;
            # a malformed configuration is the load's to report, below).
            with contextlib.suppress(ModelLoadError):
                if version > 0 and version not in self.served_versions(name):
                    raise InferenceError(
                        f"Request for unknown model: '{name}' version {version} is not found",
                        TritonError.NOT_FOUND,
                    )
            try:
                return self.shared_model(name, version, isolated, timeout)
            except ModelLoadError as exc:
                raise InferenceError(
                    f"Request for unknown model: '{name}' is not found ({exc})",
                    TritonError.INVALID_ARG,
                ) from None

    def control(self, kind: str, payload: Any, isolated: bool) -> Any:
        """``pb_utils.load_model`` / ``unload_model`` / ``is_model_ready`` from a model
        (``payload``: their arguments); through the repository's server when it has one.

        Raises:
            InferenceError: the server's error, Triton's ``Request for unknown model``
                error for the readiness of a model that is not loaded (as Triton raises it),
                an invalid version string, or a load with a configuration override or files
                (only ``pb-tensor serve`` loads those).
            ModelLoadError: the model failed to load.
        """
        server = self._server
        if kind == "load_model":
            name, config, files = payload
            if server is not None:
                server.load_model(name, config or "", files or {})
                return None
            if config or files:
                raise InferenceError(
                    "load_model with a configuration override or files is not supported by "
                    "pb_tensor.runtime", TritonError.UNSUPPORTED,
                )
            if name not in self.models():  # Triton's model repository manager's texts
                raise InferenceError(
                    f"failed to load '{name}', failed to poll from model repository",
                    TritonError.INTERNAL,
                )
            return self._reload(name, isolated)
        if kind == "unload_model":
            name, unload_dependents = payload
            if server is not None:
                server.unload_model(name, bool(unload_dependents))
                return None
            with self._lock:
                going = [self._bls.pop(k) for k in [k for k in self._bls if k[0] == name]]
                self._stamps.pop(name, None)
                self._timestamps.pop(name, None)
            self._in_background(going, bool(unload_dependents))
            return None
        if kind == "is_model_ready":
            name, text = payload
            version = model_version_of(text)
            # TRITONSERVER_ServerModelIsReady: loaded, and the model's readiness check
            model = server.ready_model(name, version) if server is not None else (
                self._ready_model(name, version))
            return model.is_ready()
        raise InferenceError(f"unknown runtime request {kind!r}", TritonError.INTERNAL)

    def _reload(self, name: str, isolated: bool) -> None:
        """``pb_utils.load_model(name)`` without a server, as Triton's load: the model is
        loaded when it is not; a loaded one is reloaded only when its directory changed since
        it loaded, its new copies loading while the old ones serve, which then go in the
        background; when a new copy fails to load, the old ones go on serving.

        Raises:
            InferenceError: the model failed to load (Triton's text).
        """
        timestamps = model_timestamps(os.path.join(self._path, name))
        stamp = newest_time(timestamps)
        with self._lock:
            copies = {k: m for k, m in self._bls.items() if k[0] == name and m.loaded}
            loaded = any(m.loaded and m.name == name and m.isolated == isolated
                         and m not in self._going for m in self._models)  # fmt: skip
            unchanged = stamp <= self._stamps.get(name, -1)
            before = self._timestamps.get(name)
        try:
            if not copies:
                if not loaded:
                    self.shared_model(name, -1, isolated)
                return
            if unchanged:
                return
            new: dict[tuple[str, int, bool], LoadedModel] = {}
            try:
                for key, copy in copies.items():
                    if self._update(copy, before, timestamps):
                        continue
                    new[key] = self.load(name, version=key[1] if key[1] > 0 else None,
                                         isolated=key[2])  # fmt: skip
            except ModelLoadError:
                for model in new.values():
                    model.unload()
                raise
        except ModelLoadError as exc:
            raise InferenceError(f"load failed for model '{name}': {exc.core_status()}\n",
                                 TritonError.INTERNAL) from None  # fmt: skip
        with self._lock:
            old = [self._bls[k] for k in new if k in self._bls]
            self._bls.update(new)
            self._stamps[name] = stamp
            self._timestamps[name] = timestamps
        self._in_background(old)

    def _update(self, copy: LoadedModel, before: dict[str, int] | None,
                timestamps: dict[str, int]) -> bool:  # fmt: skip
        """Update ``copy``'s instances to the repository's configuration instead of reloading
        it, where core would (its version's files unchanged since ``before``, and a new
        configuration that differs in ``instance_group`` or ``version_policy`` only);
        whether it did.

        Raises:
            ModelLoadError: the update failed (Triton's text; the copy is unchanged).
        """
        if (before is None or copy.source_config is None or isinstance(copy, EnsembleModel)
                or version_modified(before, timestamps, copy.version)):  # fmt: skip
            return False
        try:
            config = self.read_config(copy.name)
        except ModelLoadError:
            return False  # (the reload reports it)
        if config_change_requires_reload(copy.source_config, config):
            return False
        try:
            copy.update_instance_group(instance_groups(config))
        except ModelLoadError as exc:
            raise ModelLoadError(
                f"version {copy.version} is at READY state: {exc};") from None  # fmt: skip
        copy.source_config = config
        return True

    def _in_background(self, models: list[LoadedModel], unload_dependents: bool = False
                       ) -> None:  # fmt: skip
        """Unload ``models`` in a thread of their own (Triton's unload does not wait for the
        requests in flight: a model may unload the model its own request runs on); they take
        no new BLS request meanwhile, and :meth:`close` waits for them."""
        if not models:
            return

        def run() -> None:
            try:
                for model in models:
                    try:
                        if isinstance(model, EnsembleModel):
                            model.unload(unload_dependents=unload_dependents)
                        else:
                            model.unload()
                    except Exception:
                        log.exception("unloading model '%s' failed", model.name)
            finally:
                with self._lock:
                    self._going.difference_update(models)

        with self._lock:
            self._going.update(models)
        self._unloads.start(models[0].name, run)

    def _ready_model(self, name: str, version: int) -> LoadedModel:
        """A loaded model ``name`` (``version``; -1: the latest), else Triton's error for
        it (core's ``ModelLifeCycle::GetModel`` texts)."""
        with self._lock:
            loaded = [m for m in self._models
                      if m.loaded and m.name == name and m not in self._going]  # fmt: skip
            tried = name in self._tried
        found = [m for m in loaded if version in (-1, m.version)]
        if found:
            return max(found, key=lambda m: m.version)
        if not loaded and not tried:
            message = f"'{name}' is not found"
        elif version == -1:
            message = f"'{name}' has no available versions"
        else:
            message = f"'{name}' version {version} is not found"
        raise InferenceError(f"Request for unknown model: {message}", TritonError.NOT_FOUND)

    def forget(self, model: LoadedModel) -> None:
        """Drop an unloaded model from the bookkeeping."""
        with self._lock:
            if model in self._models:
                self._models.remove(model)
            for key, value in list(self._bls.items()):
                if value is model:
                    del self._bls[key]

    def wait_for_unloads(self) -> None:
        """Wait until the unloads ``pb_utils.unload_model`` (and reloads) started in the
        background have ended (their ``finalize`` ran)."""
        self._unloads.wait()

    def close(self) -> None:
        """Unload every model loaded through this repository and remove the pool."""
        with self._lock:
            self._closed = True
        self.wait_for_unloads()
        with self._lock:
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


# python_backend's INVALID_CHARS (pb_utils.h): a stub's name is passed to a shell, and names
# holding any of these are refused before one is started (StubLauncher::Launch).
_INVALID_STUB_CHARS = frozenset(";|&$`<>()[]{}\\\"'*?~#!")


def _check_stub_name(stub_name: str, where: str, version: int) -> None:
    """Refuse, as python_backend does in both of its stubs' launches, a model or instance
    name with a character its ``IsValidIdentifier`` rejects (in-process too: the model must
    load in Triton).

    Raises:
        ModelLoadError: upstream's ``Invalid stub name: contains invalid characters``.
    """
    if not stub_name or not _INVALID_STUB_CHARS.isdisjoint(stub_name):
        text = "Invalid stub name: contains invalid characters"
        raise ModelLoadError(f"failed to load {where}: {text}", version=version,
                             reason=f"Invalid argument: {text}")
