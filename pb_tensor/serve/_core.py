"""The protocol-independent part of the front door: which models are loaded (Triton's model
control modes), their metadata, loading and unloading, and running requests.

Only :mod:`pb_tensor.runtime`'s public API is used; every error is a :class:`ServeError` with
Triton's code and message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pb_tensor.runtime import (
    BackgroundUnloads,
    EnsembleModel,
    InferenceError,
    LoadedModel,
    ModelLoadError,
    ModelRepository,
    Outputs,
    RequestRefused,
    ResponseStream,
    config_change_requires_reload,
    instance_groups,
    model_timestamps,
    newest_time,
    parse_model_version,
    version_modified,
)
from pb_tensor.serve._errors import (
    INTERNAL,
    NOT_FOUND,
    UNAVAILABLE,
    ServeError,
)
from pb_tensor.serve._handoff import Handoff, await_future
from pb_tensor.serve._headers import HeaderForwarder
from pb_tensor.serve._inline import InlinePolicy, run_outside_loop
from pb_tensor.serve._logging import LogSettings
from pb_tensor.serve._shm import Regions

__all__ = ["Core", "ModelState", "Options", "parse_version", "responses"]

log = logging.getLogger("pb_tensor.serve")

CONTROL_MODES = ("none", "explicit", "poll")


@dataclasses.dataclass
class Options:
    """What ``pb-tensor serve`` runs: tritonserver's options of the same names."""

    model_repositories: list[str]
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    http_address: str = "127.0.0.1"
    grpc_address: str = "127.0.0.1"
    metrics_address: str = "127.0.0.1"
    allow_http: bool = True
    allow_grpc: bool = True
    allow_metrics: bool = True
    model_control_mode: str = "none"
    load_models: list[str] = dataclasses.field(default_factory=list)
    strict_model_config: bool = False
    exit_on_error: bool = True
    # tritonserver's --strict-readiness: the server is ready only while every model is
    strict_readiness: bool = True
    log_verbose: int = 0
    # tritonserver's other --log-* flags (the logging extension changes them while serving)
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_format: str = "default"
    log_file: str = ""
    in_process: bool = False
    # --inline-quick-models: an opt-in, because a model run on the event loop's thread sees
    # a running asyncio loop (asyncio.run in its execute fails) where Triton's stub has none.
    inline_quick_models: bool = False
    # --http-header-forward-pattern, --grpc-header-forward-pattern: headers whose names
    # match become string request parameters ("" forwards none)
    http_header_forward_pattern: str = ""
    grpc_header_forward_pattern: str = ""
    # --exit-timeout-secs: how long a stop waits for requests in flight
    exit_timeout_secs: int = 30
    # --http-max-input-size (Triton's default: 64 MiB)
    max_input_size: int = 64 * 1024 * 1024
    # --host-policy: {policy name: {setting: value}} (ModelRepository's host_policies)
    host_policies: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ModelState:
    """A model's row in the repository index: its version, state and reason."""

    name: str
    version: str = ""
    state: str = ""
    reason: str = ""


# core's MODEL_READY_REASON_DUPLICATE
_DUPLICATE = "model appears in two or more repositories"


def parse_version(text: str) -> int:
    """Triton's ``GetModelVersionFromString``: ``""`` is -1 (latest).

    Raises:
        ServeError: not an integer, or negative (Triton's messages).
    """
    version = parse_model_version(text)
    if version is None:
        raise ServeError(
            f"failed to get model version from specified version string '{text}' (details: "
            "stol), version should be an integral value > 0"
        )
    if version < 0 and text:
        raise ServeError(
            f"invalid model version specified '{text}' , version should be an integral "
            "value > 0"
        )
    return version


def responses(stream: ResponseStream) -> Iterator[Outputs | InferenceError]:
    """A request's responses as Triton's front ends get them: each response's outputs, an
    error response as its error, and what the model sends after an error that was not final.
    ``ResponseSenderDropped`` comes last when the model let go of the request's sender (no
    final flag then: Triton's front ends send nothing more)."""
    while True:
        try:
            yield next(stream)
        except StopIteration:
            return
        except InferenceError as exc:
            yield exc
            if stream.finished:
                return


def inference_error(exc: InferenceError) -> ServeError:
    """The runtime's error as a front-door error (same message and code)."""
    return ServeError(exc.message(), int(exc.code()), refused=isinstance(exc, RequestRefused))


class Core:
    """Models of one or more repositories, loaded as ``options`` says.

    Thread-safe: loading and unloading run in worker threads, requests on event loops.
    """

    def __init__(self, options: Options) -> None:
        if options.model_control_mode not in CONTROL_MODES:
            raise ServeError(
                f"unknown model control mode '{options.model_control_mode}' (choose from "
                "none, explicit, poll)"
            )
        if options.model_control_mode == "poll":
            raise ServeError(
                "--model-control-mode=poll is not supported by pb-tensor serve (use none or "
                "explicit)", UNAVAILABLE,
            )
        self.options = options
        # Headers forwarded as request parameters, by front door (None: none are).
        self.http_headers = (
            HeaderForwarder(options.http_header_forward_pattern, "--http-header-forward-pattern")
            if options.http_header_forward_pattern else None
        )
        self.grpc_headers = (
            HeaderForwarder(options.grpc_header_forward_pattern, "--grpc-header-forward-pattern")
            if options.grpc_header_forward_pattern else None
        )
        # What the models reach through BLS and pb_utils' model control: this server's
        # models, as in Triton (a repository alone would load what they name).
        self._server_models = _ServerModels(self)
        # Inputs are views of the request's own (writable) buffer, which nothing else reads:
        # in-process models may take them without a copy, as a stub takes its shared memory.
        self._repositories = [
            ModelRepository(p, share_inputs=True, host_policies=options.host_policies,
                            server=self._server_models)
            for p in options.model_repositories
        ]  # fmt: skip
        self._lock = threading.RLock()
        # model -> its latest served version; model -> every version served (its version
        # policy's); model -> its rows in the repository index, one per version
        self._loaded: dict[str, LoadedModel] = {}
        self._served: dict[str, dict[int, LoadedModel]] = {}
        self._states: dict[str, list[ModelState]] = {}
        self._overrides: dict[str, tuple[ModelRepository, str]] = {}
        # ensemble -> the models its steps run on (Triton's dependency graph, one level), and
        # the models loaded because they were asked for, not as a composing model (Triton's
        # "explicitly loaded": unload_dependents leaves them)
        self._depends: dict[str, set[str]] = {}
        self._asked: set[str] = set()
        # Triton serialises the load / unload requests that touch one model (a second one
        # waits for the first: LockNodes' retry) and runs those of other models in
        # parallel: a lock per model name. Unloads go on in threads of their own after the
        # request returned (AsyncUnload): the server's close waits for them.
        self._control: dict[str, threading.RLock] = {}
        self._unloads = BackgroundUnloads()
        # The newest modification time in each loaded model's directory, read before it
        # loaded (core's ModelTimestamp): a load request finding it unchanged reloads nothing.
        self._stamps: dict[str, int] = {}
        # Each loaded model's directory timestamps when it loaded (core's ModelTimestamp):
        # a version whose own files did not change since is updated, not reloaded.
        self._timestamps: dict[str, dict[str, int]] = {}
        self._inflight = 0
        self._pending: dict[tuple[str, int], int] = {}  # per model version
        self.regions = Regions()
        self._handoff = Handoff(max_workers=64, name="pb-tensor-serve-infer")
        self._idle = threading.Condition(self._lock)
        self._inline = InlinePolicy()
        self.live = True
        self.ready = False
        self.log_settings = LogSettings(
            info=options.log_info, warning=options.log_warning, error=options.log_error,
            verbose_level=options.log_verbose, log_format=options.log_format,
            log_file=options.log_file,
        )  # fmt: skip
        self.startup_failures: list[str] = []

    # -- repository ---------------------------------------------------------------------------
    def repository_of(self, name: str) -> ModelRepository | None:
        """The first of the server's repositories that holds model ``name``."""
        return self._repository_of(name)

    def _repository_of(self, name: str) -> ModelRepository | None:
        # A model in two or more repositories is no model (core's Poll: "not unique across
        # all model repositories"; it does not load, the index says why).
        found = [repo for repo in self._repositories if name in repo.models()]
        return found[0] if len(found) == 1 else None

    def _duplicates(self) -> set[str]:
        """The model names that two or more of the repositories hold."""
        seen: set[str] = set()
        twice: set[str] = set()
        for repo in self._repositories:
            for name in repo.models():
                (twice if name in seen else seen).add(name)
        return twice

    def names(self) -> list[str]:
        """Every model name of the repositories, sorted."""
        names: set[str] = set()
        for repo in self._repositories:
            names.update(repo.models())
        return sorted(names)

    def startup(self) -> list[ModelState]:
        """Load the models the control mode asks for (every model with ``none``; the
        ``--load-model`` ones with ``explicit``, ``*`` for all); their states."""
        if self.options.model_control_mode == "none" or "*" in self.options.load_models:
            wanted = self.names()
        else:
            wanted = list(dict.fromkeys(self.options.load_models))
        duplicates = self._duplicates()
        for name in wanted:
            with self._lock:
                if name in self._loaded:  # loaded already as an ensemble's composing model
                    self._asked.add(name)  # (and asked for: every model named at start)
                    continue
            if name in duplicates:
                self.startup_failures.append(name)
                log.error("failed to poll model '%s': not unique across all model "
                          "repositories", name)  # fmt: skip
                continue
            try:
                self.load(name, None, {}, startup=True)
            except ServeError as exc:
                self.startup_failures.append(name)
                log.error("%s", exc.message.rstrip())
        self.ready = True
        with self._lock:
            return [row for n in sorted(self._states) for row in self._states[n]]

    def index(self, ready_only: bool) -> list[ModelState]:
        """Triton's repository index: every model of the repositories, with the state and
        version of those that were loaded or failed to load (a row per version)."""
        duplicates = self._duplicates()
        with self._lock:
            names = self.names()
            rows = [row for n in names if n not in duplicates
                    for row in self._states.get(n, [ModelState(n)])]  # fmt: skip
            rows += [ModelState(n, "", "UNAVAILABLE", _DUPLICATE) for n in duplicates]
            rows += [row for n, r in self._states.items() if n not in names for row in r]
        rows.sort(key=lambda s: (s.name, int(s.version) if s.version.isdigit() else -1))
        return [r for r in rows if r.state == "READY"] if ready_only else rows

    def server_ready(self) -> bool:
        """Triton's server readiness (``InferenceServer::IsReady``): started and not
        stopping; with ``--strict-readiness`` (the default) also every model the server
        tried to load ready: each of its versions served and passing its readiness check
        (a stub that died, a model whose ``is_ready()`` says no), or unloaded. Runs the
        models' checks: call it off the event loop."""
        if not self.ready:
            return False
        if not self.options.strict_readiness:
            return True
        with self._lock:
            states = {name: list(rows) for name, rows in self._states.items()}
            served = {name: dict(versions) for name, versions in self._served.items()}
        for name, rows in sorted(states.items()):
            if not rows:
                return False  # a model with no version to serve
            for row in rows:
                if row.state != "READY":
                    if row.reason == "unloaded":
                        continue
                    return False
                model = served.get(name, {}).get(int(row.version))
                why = "not served" if model is None else model.not_ready_reason()
                if why is not None:
                    log.debug(
                        "Model '%s' version %s is in READY lifecycle state but failed runtime "
                        "readiness check during server readiness evaluation: %s",
                        name, row.version, why,
                    )  # fmt: skip
                    return False
        return True

    def model(self, name: str, version: str = "") -> LoadedModel:
        """The loaded model ``name`` (``version`` "" for the latest the server serves).

        Raises:
            ServeError: Triton's ``Request for unknown model`` errors.
        """
        wanted = parse_version(version)
        with self._lock:
            model = self._loaded.get(name)
            if model is not None and wanted != -1:
                model = self._served[name].get(wanted)
                if model is None:
                    raise ServeError(f"Request for unknown model: '{name}' version {wanted} "
                                     "is not found", NOT_FOUND)  # fmt: skip
            known = name in self._states
        if model is None:
            if known:
                raise ServeError(
                    f"Request for unknown model: '{name}' has no available versions", NOT_FOUND
                )
            raise ServeError(f"Request for unknown model: '{name}' is not found")
        return model

    def versions(self, name: str) -> list[int]:
        """The versions of model ``name`` the server serves now, ascending."""
        with self._lock:
            return sorted(self._served.get(name, {}))

    def composing_model(self, name: str, version: int) -> LoadedModel | None:
        """The server's model ``name`` an ensemble step runs on, loaded now when it is not
        (Triton loads an ensemble's composing models with it); None for a ``version`` the
        server does not serve (the ensemble fails to load, as in Triton).

        Raises:
            ModelLoadError: the model failed to load (its load error).
        """
        with self._lock:
            model = self._loaded.get(name)
        if model is None:
            try:
                self.load(name, None, {}, startup=True, dependency=True)
            except ServeError as exc:
                if isinstance(exc.__cause__, ModelLoadError):  # the runtime's, core's status
                    raise exc.__cause__ from None
                with self._lock:
                    reasons = [r.reason for r in self._states.get(name, []) if r.reason]
                raise ModelLoadError(reasons[-1] if reasons else exc.message) from None
        with self._lock:
            if version == -1:
                return self._loaded.get(name)
            return self._served.get(name, {}).get(version)

    def loaded_models(self) -> list[LoadedModel]:
        """The models loaded now (a model per version the server serves)."""
        with self._lock:
            return [m for versions in self._served.values() for m in versions.values()]

    # -- control ------------------------------------------------------------------------------
    def load(self, name: str, config: str | None, files: Mapping[str, bytes], *,
             startup: bool = False, dependency: bool = False, affected: bool = False) -> None:
        """Load (or reload) model ``name``; ``config`` (JSON) and ``files`` (paths relative to
        the model directory) override the repository's, as Triton's load request does.
        ``dependency``: loaded as an ensemble's composing model, not asked for
        (``unload_dependents`` may unload it). ``affected``: reloaded even when its directory
        did not change (an ensemble whose composing model was reloaded).

        As in Triton, a model that is loaded already keeps serving while its new copy loads;
        the new copy then takes its place and the old one is unloaded in the background
        (its requests in flight end first). When the new copy fails to load, the old one
        goes on serving. Load and unload requests for one model run one at a time.

        Raises:
            ServeError: load/unload not allowed in this mode, no such model, or it failed to
                load (Triton's messages).
        """
        if not startup and self.options.model_control_mode != "explicit":
            raise ServeError(
                "explicit model load / unload is not allowed if polling is enabled",
                UNAVAILABLE,
            )
        if files and config is None:
            raise ServeError(
                "Load parameter 'config' must be specified for model file override"
            )
        # The ensembles on the model are reloaded once its lock is let go: an ensemble's own
        # load takes its composing models' locks (a lock order the other way round would
        # deadlock with it).
        with self._control_lock(name):
            dependents, old, old_override = self._load(name, config, files, dependency,
                                                       affected)  # fmt: skip
        # Triton reloads the ensembles whose composing model changed: they run on the new
        # one (with the configuration they had, an override included). The old copy goes
        # once they do: until then their requests run on it.
        try:
            for ensemble in dependents:
                with self._lock:
                    asked = ensemble in self._asked
                try:
                    self.load(ensemble, None, {}, startup=True, dependency=not asked,
                              affected=True)  # fmt: skip
                except ServeError as exc:
                    log.error("%s", exc.message.rstrip())
        finally:
            if old:
                self._in_background(name, old, old_override)

    def _control_lock(self, name: str) -> threading.RLock:
        """The lock of model ``name``'s load and unload requests."""
        with self._lock:
            lock = self._control.get(name)
            if lock is None:
                lock = self._control[name] = threading.RLock()
            return lock

    def _load(self, name: str, config: str | None, files: Mapping[str, bytes],
              dependency: bool, affected: bool) -> tuple[
                  list[str], list[LoadedModel], tuple[ModelRepository, str] | None]:
        """:meth:`load` under the model's lock; the ensembles to reload on the new copy, and
        the copies it replaced (with their override) for the caller to unload."""
        repo = self._repository_of(name)
        # An ensemble reloaded because a composing model of its was: from the configuration
        # it loaded with, an override included (Triton's dependency graph keeps the node's
        # configuration), which its new copy then keeps.
        kept: tuple[ModelRepository, str] | None = None
        if affected and config is None:
            with self._lock:
                kept = self._overrides.get(name)
            if kept is not None:
                repo = kept[0]
        if repo is None and not files:
            raise ServeError(
                f"failed to load '{name}', failed to poll from model repository", INTERNAL
            )
        # (core's ModelTimestamp of the repository's directory: its newest time decides
        # whether anything changed, its entries which versions did)
        timestamps = {} if repo is None else model_timestamps(os.path.join(repo.path, name))
        stamp = newest_time(timestamps)
        with self._lock:
            serving = self._loaded.get(name)
            # Triton reloads a loaded model only when the request overrides its configuration
            # or its directory changed since it loaded (since the override, for a copy
            # loaded with one: a plain load keeps the override); otherwise the request
            # succeeds and changes nothing (core's InitializeModelInfo, "unmodified").
            if (serving is not None and config is None and not affected
                    and stamp <= self._stamps.get(name, -1)):  # fmt: skip
                if not dependency:
                    self._asked.add(name)
                return [], [], None
        override: tuple[ModelRepository, str] | None = None
        # The directory whose files the new copies run: the repository's, also under a
        # configuration override without files (core keeps the model's path then).
        source = repo
        try:
            if config is not None:
                override = self._override(name, repo, config, files)
                repo = override[0]
            if repo is None:  # unreachable: files come with a config
                raise ServeError(f"failed to load '{name}'", INTERNAL)
            config_path = os.path.join(repo.path, name, "config.pbtxt")
            if self.options.strict_model_config and not os.path.isfile(config_path):
                if serving is None:
                    with self._lock:
                        self._states[name] = [ModelState(
                            name, "", "UNAVAILABLE", f"no {config_path} (strict model config)")]
                raise ServeError(
                    f"load failed for model '{name}': --strict-model-config=true needs "
                    f"{config_path}\n"
                )
            in_place = not files and source is not None
            if not in_place:  # the new copies run files of the override's directory
                timestamps = model_timestamps(os.path.join(repo.path, name))
            loaded: dict[int, LoadedModel] = {}
            updated: dict[int, LoadedModel] = {}
            version: int | None = None
            served: list[int] | None = None
            try:
                # Every version its version policy serves (core's VersionsToLoad); none: the
                # load's own error says so.
                served = repo.served_versions(name)
                wanted: list[int | None] = [*served] or [None]
                for version in wanted:
                    current = (self._updatable(name, repo, version, timestamps) if in_place
                               else None)  # fmt: skip
                    if current is not None:
                        self._update(name, current.version, current, repo)
                        updated[current.version] = loaded[current.version] = current
                        continue
                    model = repo.load(name, version=version,
                                      isolated=not self.options.in_process)  # fmt: skip
                    loaded[model.version] = model
            except ModelLoadError as exc:
                for model in loaded.values():  # a version failed: the new copies go
                    if model not in updated.values():
                        model.unload()
                if serving is None and served == []:
                    # Core's AsyncLoad refuses before it records any version: the model has
                    # no row in the index ("has no available versions" for requests).
                    with self._lock:
                        self._states[name] = []
                elif serving is None:
                    self._failed(name, repo, version if exc.version is None else exc.version,
                                 exc.reason or str(exc))
                # else: Triton's "model availability claim": the loaded copy goes on
                # serving, as it was (ModelLifeCycle::OnLoadFinal).
                # (from exc: an ensemble loading this model quotes it, composing_model)
                raise ServeError(f"load failed for model '{name}': {exc.core_status()}\n"
                                 ) from exc
        except BaseException:
            self._discard(override)
            raise
        if override is not None and all(m.repository is not override[0]
                                        for m in loaded.values()):  # fmt: skip
            # Every version was updated in place: the override gave only the configuration.
            self._discard(override)
            override = None
        latest = loaded[max(loaded)]
        with self._lock:
            self._timestamps[name] = timestamps
            # (a copy updated in place goes on serving: it is no old copy)
            old = [m for m in self._served.get(name, {}).values()
                   if all(m is not kept for kept in updated.values())]  # fmt: skip
            old_override = self._overrides.pop(name, None)
            if kept is not None and old_override is kept:
                old_override, override = None, kept  # (the new copy keeps it)
            self._loaded[name] = latest
            self._served[name] = loaded
            # (an override counts as a change made now: SetModelConfigModifiedTime)
            self._stamps[name] = stamp if config is None else max(stamp, time.time_ns())
            self._states[name] = [ModelState(name, str(v), "READY", "") for v in sorted(loaded)]
            if not dependency:
                self._asked.add(name)
            if override is not None:
                self._overrides[name] = override
            self._depends.pop(name, None)
            for model in loaded.values():
                if isinstance(model, EnsembleModel):
                    self._depends.setdefault(name, set()).update(
                        m.name for m in model.composing_models)
            dependents = [e for e, needs in self._depends.items()
                          if name in needs and e != name and e in self._loaded]  # fmt: skip
        return dependents, old, old_override

    def _updatable(self, name: str, repo: ModelRepository, version: int | None,
                   timestamps: dict[str, int]) -> LoadedModel | None:  # fmt: skip
        """The serving copy of ``name`` ``version`` that this load updates in place rather
        than reloads (core's ``AsyncLoad``): a model (no ensemble) whose version directory
        and other files (``config.pbtxt`` aside) did not change since it loaded, and whose
        new configuration differs from its own in ``instance_group`` and
        ``version_policy`` only. None: the version loads anew."""
        with self._lock:
            current = self._served.get(name, {}).get(version) if version is not None else None
            before = self._timestamps.get(name)
            override = self._overrides.get(name)
        if override is not None and current is not None and current.repository is override[0]:
            return None  # it runs from an override's copy of the files: a load replaces it
        if (current is None or isinstance(current, EnsembleModel) or not current.loaded
                or before is None or current.source_config is None
                or version is None or version_modified(before, timestamps, version)):  # fmt: skip
            return None
        try:
            config = repo.read_config(name)
        except ModelLoadError:
            return None  # (the load reports it)
        if config_change_requires_reload(current.source_config, config):
            return None
        return current

    @staticmethod
    def _update(name: str, version: int, model: LoadedModel, repo: ModelRepository) -> None:
        """Update the instances of ``model`` to the configuration ``repo`` has for ``name``
        (core's ``UpdateModelConfig``).

        Raises:
            ModelLoadError: Triton's text for a version whose update failed (it keeps
                serving, its instances unchanged).
        """
        config = repo.read_config(name)
        try:
            model.update_instance_group(instance_groups(config))
        except ModelLoadError as exc:
            raise ModelLoadError(f"version {version} is at READY state: {exc};") from None
        model.source_config = config

    def _failed(self, name: str, repo: ModelRepository, version: int | None,
                error: str) -> None:  # fmt: skip
        """Model ``name``, not loaded, failed to load with ``error`` (``version``: the one
        that failed, None for the model's latest): its index row says so. (No ensemble runs
        on it: unloading a model unloads the ensembles on it, and an ensemble that loads it
        fails with this error, CheckNode's text.)"""
        if version is None:
            versions = repo.versions(name)
            version = versions[-1] if versions else None
        with self._lock:
            self._states[name] = [ModelState(
                name, "" if version is None else str(version), "UNAVAILABLE", error
            )]  # fmt: skip

    def _in_background(self, name: str, models: list[LoadedModel],
                       override: tuple[ModelRepository, str] | None,
                       then: Callable[[], None] | None = None) -> None:
        """Unload ``models`` (copies of ``name`` that no longer serve) in a thread of their
        own, then ``then()``; the server's close waits for it."""

        def run() -> None:
            try:
                for model in models:
                    try:
                        model.unload()
                    except Exception:
                        log.exception("unloading model '%s' failed", name)
            finally:
                self._discard(override)
                if then is not None:
                    then()

        self._unloads.start(name, run)

    def _override(self, name: str, repo: ModelRepository | None, config: str,
                  files: Mapping[str, bytes]) -> tuple[ModelRepository, str]:
        import json

        from google.protobuf import json_format

        from pb_tensor.serve._protos import config_to_text

        try:
            text = config_to_text(json.loads(config))
        except (ValueError, json_format.ParseError) as exc:
            raise ServeError(f"failed to load '{name}': invalid config override: {exc}") from None
        root = tempfile.mkdtemp(prefix="pb-tensor-serve-")
        model_dir = os.path.join(root, name)
        try:
            if files:
                os.makedirs(model_dir)
                for rel, data in files.items():
                    # Core's JoinPath: a path starting with "/" is appended too (relative to
                    # the model directory), not taken as absolute.
                    path = os.path.normpath(model_dir + ("" if rel.startswith("/") else "/")
                                            + rel)  # fmt: skip
                    if not path.startswith(model_dir + os.sep):
                        raise ServeError(f"failed to load '{name}': Invalid file parameter "
                                         f"'file:{rel}' with normalized path '{path}' must "
                                         "stay within model directory.")
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "wb") as f:
                        f.write(data)
            elif repo is not None:
                shutil.copytree(os.path.join(repo.path, name), model_dir, symlinks=True)
            with open(os.path.join(model_dir, "config.pbtxt"), "w", encoding="utf-8") as f:
                f.write(text)
            policies = self.options.host_policies
            return ModelRepository(root, share_inputs=True, host_policies=policies,
                                   server=self._server_models), root  # fmt: skip
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise

    @staticmethod
    def _discard(override: tuple[ModelRepository, str] | None) -> None:
        if override is not None:
            override[0].close()
            shutil.rmtree(override[1], ignore_errors=True)

    def unload(self, name: str, *, unload_dependents: bool = False) -> None:
        """Unload model ``name``; with ``unload_dependents``, an ensemble's composing models
        too. As Triton's unload, this returns once the unloading started: the model takes no
        new request at once, and its index row says ``UNLOADING`` until its requests in
        flight ended and its ``finalize`` ran (then ``UNAVAILABLE``, ``unloaded``); the
        unloading goes on in a thread of its own (a model may unload the model that runs
        its own request).

        Raises:
            ServeError: not allowed in this control mode.
        """
        if self.options.model_control_mode != "explicit":
            raise ServeError(
                "explicit model load / unload is not allowed if polling is enabled",
                UNAVAILABLE,
            )
        with self._control_lock(name):
            dropped = self._unload(name, unload_dependents, background=True)
        self._drop_ensembles(dropped, background=True)

    def _drop_ensembles(self, dropped: list[tuple[str, str]], background: bool = False) -> None:
        """Unload the ensembles of ``dropped`` (a composing model of theirs went), each with
        its reason (Triton's) in the index once unloaded, and, in turn, the ensembles that run
        on them. Each under its own lock, taken with no other held: a load takes an ensemble's
        lock before its composing models' (composing_model), so this one must not be taken
        while a composing model's is held."""
        while dropped:
            ensemble, reason = dropped.pop(0)
            with self._control_lock(ensemble):
                dropped += self._unload(ensemble, background=background, reason=reason)

    def _ensembles_on(self, name: str) -> list[str]:
        """The loaded ensembles whose steps run on model ``name`` (called with the lock)."""
        return [e for e, steps in self._depends.items() if name in steps and e in self._loaded]

    def _unload(self, name: str, unload_dependents: bool = False, background: bool = False,
                reason: str = "unloaded") -> list[tuple[str, str]]:  # fmt: skip
        """Unload ``name`` (its lock held); with ``unload_dependents``, an ensemble's
        composing models that were loaded with it (not asked for) and that no other loaded
        ensemble runs on go with it, in turn, each under its own lock too (Triton locks every
        model a request touches). ``background``: the model is ``UNLOADING`` until its
        unloading, in a thread of its own, ended. Returns the ensembles that ran on the
        models unloaded, with Triton's reason, for :meth:`_drop_ensembles` once the lock is
        let go."""
        with self._lock:
            self._loaded.pop(name, None)
            models = list(self._served.pop(name, {}).values())
            override = self._overrides.pop(name, None)
            needs = self._depends.pop(name, set())
            rows: list[ModelState] = []
            if models:
                rows = self._states[name] = [
                    ModelState(name, str(m.version), *(("UNLOADING", "") if background
                                                       else ("UNAVAILABLE", reason)))
                    for m in models]  # fmt: skip
            ensembles = self._ensembles_on(name) if models else []
            self._asked.discard(name)
            # Triton's cascading removal: a composing model goes when it was not asked for
            # and no other loaded ensemble runs on it.
            composing = [] if not unload_dependents else [
                m for m in needs if m in self._loaded and m not in self._asked
                and not any(m in steps for e, steps in self._depends.items()
                            if e in self._loaded)]  # fmt: skip
        dropped = [(e, f"ensemble {e} contains models that are not available or ambiguous: "
                       f"{name}") for e in ensembles]  # fmt: skip
        for dependent in composing:
            with self._control_lock(dependent):
                dropped += self._unload(dependent, unload_dependents=True, background=background)
        if not models:
            self._discard(override)
            return dropped

        def unloaded() -> None:
            with self._lock:
                if self._states.get(name) is rows:  # (not loaded again meanwhile)
                    self._states[name] = [ModelState(name, r.version, "UNAVAILABLE", reason)
                                          for r in rows]  # fmt: skip

        if background:
            self._in_background(name, models, override, unloaded)
            return dropped
        try:
            for model in models:  # (an ensemble's composing models are the server's: above)
                model.unload()
        finally:
            self._discard(override)
            unloaded()
        return dropped

    # -- requests -----------------------------------------------------------------------------
    async def infer(self, model: LoadedModel, inputs: Mapping[str, Any],
                    requested: Sequence[str] | None, parameters: Mapping[str, Any],
                    request_id: str, correlation_id: int | str, flags: int) -> Outputs:
        """Run one request on ``model`` in a worker thread (in-process, a quick model's
        request on this thread: :mod:`pb_tensor.serve._inline`); cancelling the awaiting
        task (a client that went away) cancels the request, which the model sees.

        Raises:
            ServeError: the request is invalid or the model answered with an error.
        """
        if not self.options.in_process:
            return await self._infer_future(model, inputs, requested, parameters, request_id,
                                            correlation_id, flags)
        # In-process, the request runs as a stream of its one response on a worker thread
        # (_handoff): the stream's cancel() reaches the model from here, with less on the way
        # than infer_async's future. With stub processes, a stream that ends in an error
        # response waits for a final flag that does not come (bounded, 10 s), so there
        # infer_async's future is used.
        # A model that has shown it is quick runs on this (the event loop's) thread: no
        # hand-over to a pool thread and back (see _inline).
        stream = self.stream(model, inputs, requested, parameters, request_id,
                             correlation_id, flags)
        inline = self.options.inline_quick_models and self._inline.allowed(
            model, self.pending(model) == 1)

        def run() -> Outputs | None:
            start = time.perf_counter_ns()
            try:
                first = None
                for outputs in stream:
                    if first is None:
                        first = outputs
                return first
            finally:
                self.done(model)
                self._inline.record(model, time.perf_counter_ns() - start, inline)

        try:
            result = run_outside_loop(run) if inline else await self._handoff.run(run)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except InferenceError as exc:
            raise inference_error(exc) from None
        if result is None:
            raise ServeError(f"model '{model.name}' sent no response for the request",
                             INTERNAL)
        return result

    async def _infer_future(self, model: LoadedModel, inputs: Mapping[str, Any],
                            requested: Sequence[str] | None, parameters: Mapping[str, Any],
                            request_id: str, correlation_id: int | str, flags: int
                            ) -> Outputs:
        self._enter(model)
        try:
            try:
                future = model.infer_async(
                    inputs, requested_outputs=requested or None, parameters=parameters or None,
                    request_id=request_id, correlation_id=correlation_id, flags=flags,
                )  # fmt: skip
            except InferenceError as exc:
                raise inference_error(exc) from None
            except (TypeError, ValueError) as exc:
                raise ServeError(str(exc)) from None
            try:
                outputs: Outputs = await await_future(future)
                return outputs
            except InferenceError as exc:
                raise inference_error(exc) from None
        finally:
            self._leave(model)

    def stream(self, model: LoadedModel, inputs: Mapping[str, Any],
               requested: Sequence[str] | None, parameters: Mapping[str, Any],
               request_id: str, correlation_id: int | str, flags: int) -> ResponseStream:
        """Start one request on ``model`` for its responses one by one (decoupled models);
        the caller iterates in a worker thread and calls :meth:`done` after.

        Raises:
            ServeError: malformed inputs.
        """
        try:
            stream = model.stream(
                inputs, requested_outputs=requested or None, parameters=parameters or None,
                request_id=request_id, correlation_id=correlation_id, flags=flags,
            )  # fmt: skip
        except InferenceError as exc:
            raise inference_error(exc) from None
        except (TypeError, ValueError) as exc:
            raise ServeError(str(exc)) from None
        self._enter(model)
        return stream

    def done(self, model: LoadedModel) -> None:
        """A stream from :meth:`stream` on ``model`` ended."""
        self._leave(model)

    def pending(self, model: LoadedModel) -> int:
        """Requests of ``model`` (one model version) in flight now."""
        with self._lock:
            return self._pending.get((model.name, model.version), 0)

    def _enter(self, model: LoadedModel) -> None:
        with self._lock:
            self._inflight += 1
            key = (model.name, model.version)
            self._pending[key] = self._pending.get(key, 0) + 1

    def _leave(self, model: LoadedModel) -> None:
        with self._lock:
            self._inflight -= 1
            self._pending[(model.name, model.version)] -= 1
            if self._inflight == 0:
                self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until no request runs; whether none does."""
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        """Unload every model (``finalize`` runs, stubs stop) and close the repositories,
        which removes their shared memory."""
        self.ready = False
        self.live = False
        with self._lock:
            names = list(self._loaded)
        for name in names:
            try:
                self._unload(name)  # (the ensembles on it are among the names)
            except Exception:
                log.exception("unloading model '%s' failed", name)
        self._unloads.wait()  # (Triton's shutdown waits for the unloads going on too)
        for repo in self._repositories:
            repo.close()
        self._handoff.close()
        self.regions.close()


class _ServerModels:
    """This server's models as the repositories' models reach them (the runtime's
    ``ServerModels``): BLS requests and ``pb_utils.is_model_ready`` find the models the
    server has loaded, from any of its repositories, with Triton's errors for the others;
    ``pb_utils.load_model`` / ``unload_model`` load and unload them for every client, in the
    explicit control mode only (Triton's error otherwise)."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def _model(self, name: str, version: int) -> LoadedModel:
        try:
            return self._core.model(name, "" if version < 0 else str(version))
        except ServeError as exc:
            raise InferenceError(exc.message) from None

    def bls_target(self, name: str, version: int, isolated: bool) -> LoadedModel:
        return self._model(name, version)

    def ready_model(self, name: str, version: int) -> LoadedModel:
        return self._model(name, version)

    def load_model(self, name: str, config: str, files: Mapping[str, bytes]) -> None:
        # The parameters Triton's load takes: a "file:<path>" one per override file.
        paths = {k[len("file:"):]: v for k, v in files.items() if k.startswith("file:")}
        try:
            self._core.load(name, config or None, paths)
        except ServeError as exc:
            raise InferenceError(exc.message) from None

    def unload_model(self, name: str, unload_dependents: bool) -> None:
        try:
            self._core.unload(name, unload_dependents=unload_dependents)
        except ServeError as exc:
            raise InferenceError(exc.message) from None

    def repository_of(self, name: str) -> ModelRepository | None:
        return self._core.repository_of(name)

    def step_model(self, name: str, version: int, isolated: bool) -> LoadedModel | None:
        return self._core.composing_model(name, version)
