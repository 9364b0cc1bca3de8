"""Loading an ensemble: Triton's checks in Triton's order, then its composing models (loaded
with it, as Triton's explicit model control does) and the resolved steps."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pb_tensor.runtime import _schema
from pb_tensor.runtime._ensemble import EnsembleModel
from pb_tensor.runtime._ensemble_steps import Step, proven_outputs
from pb_tensor.runtime._ensemble_validate import (
    ENSEMBLE_PLATFORM,
    EnsembleConfigError,
    check_against_models,
    check_scheduling,
    dependency_cycle,
    step_models,
)
from pb_tensor.runtime._errors import ModelLoadError, VersionNotServed
from pb_tensor.runtime._model import LoadedModel
from pb_tensor.runtime._validate import ModelSpec, known_outputs

if TYPE_CHECKING:
    from pb_tensor.runtime._repository import ModelRepository

__all__ = ["check_ensemble_config", "is_ensemble", "load_ensemble"]


def is_ensemble(config: Any) -> bool:
    """Whether a configuration asks for Triton's ensemble scheduler."""
    return bool(config.platform == ENSEMBLE_PLATFORM or config.HasField("ensemble_scheduling"))


def check_ensemble_config(config: Any, name: str, model_dir: str) -> None:
    """The checks of an ensemble's own configuration, which Triton makes before it looks at
    versions or composing models.

    Raises:
        ModelLoadError: Triton's message.
    """
    try:
        check_scheduling(config, os.path.basename(os.path.normpath(model_dir)))
    except EnsembleConfigError as exc:
        raise ModelLoadError(f"failed to load model '{name}': {exc}") from None


def _serves(repository: ModelRepository, name: str, version: int) -> bool:
    """Whether model ``name``'s version policy serves ``version`` (core's CheckNode needs the
    version loaded); a malformed configuration is its load's to report."""
    holder = repository.holder(name)
    if holder is None:
        return False
    try:
        return version in holder.served_versions(name)
    except ModelLoadError:
        return True


def _steps_of(repository: ModelRepository, name: str) -> list[str] | None:
    """The models ensemble ``name`` runs on (found in whichever repository holds it); None
    for a model that is no (readable) ensemble."""
    holder = repository.holder(name)
    if holder is None:
        return None
    path = os.path.join(holder.path, name, "config.pbtxt")
    if not os.path.isfile(path):
        return None
    try:
        config = _schema.parse_config_file(path)
    except _schema.ConfigError:
        return None
    if not is_ensemble(config):
        return None
    return [n for n, _ in step_models(config)]


def load_ensemble(
    repository: ModelRepository,
    config: Any,
    *,
    name: str,
    version: int,
    model_dir: str,
    isolated: bool,
    timeout: float | None,
) -> EnsembleModel:
    """Validate ensemble ``config`` and load its composing models (as Triton's explicit
    mode does); the loaded ensemble.

    Raises:
        ModelLoadError: Triton's message: the ensemble's configuration is invalid, a
            composing model is missing, fails to load or does not fit the ensemble, or
            ensembles contain each other.
    """
    where = f"model '{name}' version {version}"
    try:
        check_scheduling(config, os.path.basename(os.path.normpath(model_dir)))
        # (every repository of the server the repository serves in, as Triton's)
        missing = sorted({n for n, _ in step_models(config) if repository.holder(n) is None})
        if missing:
            raise EnsembleConfigError(
                f"ensemble {name} contains models that are not available or ambiguous: "
                + ", ".join(missing))
        cycle = dependency_cycle(name, lambda n: _steps_of(repository, n))
        if cycle is not None:
            raise cycle
        for step_name, step_version in step_models(config):
            if step_version > 0 and not _serves(repository, step_name, step_version):
                raise EnsembleConfigError(
                    f"ensemble '{name}' depends on '{step_name}' whose required version "
                    f"{step_version} is not loaded.")
        models: dict[tuple[str, int], LoadedModel] = {}
        for step_name, step_version in step_models(config):
            key = (step_name, step_version if step_version > 0 else -1)
            if key in models:
                continue
            try:
                models[key] = repository.shared_model(step_name, step_version, isolated,
                                                      timeout)  # fmt: skip
            except VersionNotServed:  # (the server loaded the model: not that version)
                raise EnsembleConfigError(
                    f"ensemble '{name}' depends on '{step_name}' whose required version "
                    f"{step_version} is not loaded.") from None
            except ModelLoadError as exc:
                nested = _steps_of(repository, step_name) is not None
                if nested:
                    raise EnsembleConfigError(
                        f"ensemble '{name}' depends on '{step_name}' which is not valid. "
                        f"Model '{step_name}' failed with error: {exc}") from None
                raise EnsembleConfigError(
                    f"ensemble '{name}' depends on '{step_name}' which has no loaded "
                    f"version. Model '{step_name}' loading failed with error: "
                    f"{exc.core_status()}") from None
        # One configuration per model, whatever the version (Triton's layout).
        completed = {
            n: _schema.config_from_dict(m.config, where=f"model '{n}'")
            for (n, _), m in models.items()
        }
        decoupled = check_against_models(config, completed)
    except EnsembleConfigError as exc:
        raise ModelLoadError(f"failed to load {where}: {exc}") from None
    config.model_transaction_policy.decoupled = decoupled
    spec = ModelSpec.from_config(config)
    steps = []
    for step in config.ensemble_scheduling.step:
        model_config = completed[step.model_name]
        model = models[(step.model_name, step.model_version if step.model_version > 0 else -1)]
        dims = {i.name: tuple(i.dims) for i in model_config.input}
        batching = model_config.max_batch_size > 0
        inputs = tuple((k, v, dims[k]) for k, v in step.input_map.items())
        requested = tuple(step.output_map)
        model_spec = ModelSpec.from_config(model_config)
        checked = known_outputs(model_spec, requested) if requested else None
        # An in-process engine's model (a nested ensemble has none of its own).
        in_process = not model.isolated and not isinstance(model, EnsembleModel)
        mapped = [k for k, _, _ in inputs]
        checkable = (
            checked is not None and model_spec.all_required
            and len(set(mapped)) == len(mapped) == len(model_spec.table)
            and all(k in model_spec.table for k in mapped)
        )  # fmt: skip
        steps.append(Step(
            model,
            batching,
            inputs,
            dict(step.output_map),
            requested,
            model.isolated,
            model.isolated and not isinstance(model, EnsembleModel),
            proven_outputs(spec, model_spec, batching, inputs, requested),
            None if checked is None else tuple(checked),
            in_process,
            in_process and model._copy_inputs,
            tuple(model_spec.table[k][0] for k in mapped) if checkable else None,
            model_spec.max_batch_size,
        ))  # fmt: skip
    output_dims = {
        o.name: tuple(o.reshape.shape if o.HasField("reshape") else o.dims)
        for o in config.output
    }
    return EnsembleModel(
        repository, name=name, version=version, config=_schema.config_to_dict(config),
        spec=spec, isolated=isolated, decoupled=decoupled,
        timeout=timeout, steps=steps,
        optional_inputs=[i.name for i in config.input if i.optional],
        output_dims=output_dims,
    )  # fmt: skip
