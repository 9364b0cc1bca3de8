"""``ModelConfig`` (what ``auto_complete_config`` receives) and the model-config helpers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ModelConfig",
    "get_input_config_by_name",
    "get_output_config_by_name",
    "using_decoupled_model_transaction_policy",
]


class ModelConfig:
    """The model configuration ``auto_complete_config(auto_complete_model_config)`` receives
    and returns: Triton's ``ModelConfig`` message in its JSON form (field names as in
    ``model_config.proto``: ``max_batch_size``, ``input``, ``output`` ...).

    ``ModelConfig(model_config)`` takes the JSON text, as upstream, or a dict (a deep copy is
    kept). Only ``max_batch_size``, inputs, outputs, ``dynamic_batching`` and the transaction
    policy can be changed, through the ``set_``/``add_`` methods; each raises upstream's
    ``ValueError`` when the change contradicts the configuration.

    Raises:
        TypeError: ``model_config`` is neither a str nor a mapping.
        ValueError: the text is not JSON (``json.JSONDecodeError``) or not a JSON object.
    """

    __slots__ = ("_model_config",)

    def __init__(self, model_config: str | Mapping[str, Any]) -> None:
        if isinstance(model_config, str):
            loaded = json.loads(model_config)
        elif isinstance(model_config, Mapping):
            # A JSON round trip: a deep copy holding only JSON types, as upstream's.
            loaded = json.loads(json.dumps(dict(model_config)))
        else:
            raise TypeError(
                "ModelConfig(): model_config must be the JSON text or a dict, got "
                f"{type(model_config).__name__}"
            )
        if not isinstance(loaded, dict):
            raise ValueError(f"ModelConfig(): the configuration is not a JSON object: {loaded!r}")
        self._model_config: dict[str, Any] = loaded

    def as_dict(self) -> dict[str, Any]:
        """The configuration (the object itself, as upstream: treat it as read-only)."""
        return self._model_config

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set ``max_batch_size``.

        Raises:
            ValueError: the configuration already specifies a larger non-zero value.
        """
        current = self._model_config.get("max_batch_size", 0)
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in "
                f"auto-complete-config function for model '{self._name}' specified "
                f"max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        """Choose the dynamic batcher as scheduler unless one is set (no-op when it is).

        Raises:
            ValueError: the configuration sets ``sequence_batching`` or
                ``ensemble_scheduling``.
        """
        found = None
        if "sequence_batching" in self._model_config:
            found = "sequence_batching"
        elif "ensemble_scheduling" in self._model_config:
            found = "ensemble_scheduling"
        if found is not None:
            raise ValueError(
                f"Configuration specified scheduling_choice as '{found}', but "
                f"auto-complete-config function for model '{self._name}' tries to set "
                "scheduling_choice as 'dynamic_batching'"
            )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        """Add an input (``name``, ``data_type``, ``dims``, optionally ``optional``), or
        complete the configured input of that name.

        Raises:
            ValueError: upstream's messages: a property other than those, a missing one, or
                a ``data_type``/``dims``/``optional`` that contradicts the configured input.
        """
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict[str, Any]) -> None:
        """Add an output (``name``, ``data_type``, ``dims``), or complete the configured
        output of that name.

        Raises:
            ValueError: upstream's messages: a property other than those, a missing one, or
                a ``data_type``/``dims`` that contradicts the configured output.
        """
        self._add("output", output, ("name", "data_type", "dims"))

    def _add(self, kind: str, tensor: dict[str, Any], valid: tuple[str, ...]) -> None:
        model = self._name
        allowed = (
            "'name', 'data_type', 'dims' and 'optional'"
            if kind == "input"
            else "'name', 'data_type' and 'dims'"
        )
        for prop in tensor:
            if prop not in valid:
                raise ValueError(
                    f"{kind} '{tensor.get('name')}' in auto-complete-config function for model "
                    f"'{model}' contains property other than {allowed}."
                )
        if "name" not in tensor:
            raise ValueError(
                f"{kind} in auto-complete-config function for model '{model}' is missing "
                "'name' property."
            )
        for prop in ("data_type", "dims"):
            if prop not in tensor:
                raise ValueError(
                    f"{kind} '{tensor['name']}' in auto-complete-config function for model "
                    f"'{model}' is missing '{prop}' property."
                )
        existing_list: list[dict[str, Any]] = self._model_config.setdefault(kind, [])
        name = tensor["name"]
        for current in existing_list:
            if current.get("name") != name:
                continue
            current_type = current.get("data_type", "TYPE_INVALID")
            current_dims = current.get("dims", [])
            if current_type != "TYPE_INVALID" and current_type != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{model}', configuration expects datatype "
                    f"{current_type} for {kind} '{name}', model provides {tensor['data_type']}"
                )
            if current_dims and current_dims != tensor["dims"]:
                raise ValueError(
                    f"model '{model}', tensor '{name}': the model expects dims "
                    f"{tensor['dims']} but the model configuration specifies dims "
                    f"{current_dims}"
                )
            if (
                kind == "input"
                and "optional" in current
                and "optional" in tensor
                and current["optional"] != tensor["optional"]
            ):
                raise ValueError(
                    f"model '{model}', tensor '{name}': the model expects optional "
                    f"{tensor['optional']} but the model configuration specifies optional "
                    f"{current['optional']}"
                )
            current["data_type"] = tensor["data_type"]
            current["dims"] = tensor["dims"]
            if kind == "input" and "optional" in tensor:
                current["optional"] = tensor["optional"]
            return
        existing_list.append(tensor)

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        """Set ``model_transaction_policy`` (only ``decoupled``).

        Raises:
            ValueError: another property, or a ``decoupled`` that contradicts the
                configuration (upstream's messages).
        """
        model = self._name
        for prop in transaction_policy_dict:
            if prop != "decoupled":
                raise ValueError(
                    "model transaction property in auto-complete-config function for model "
                    f"'{model}' contains property other than 'decoupled'."
                )
        policy: dict[str, Any] = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != wanted:
                raise ValueError(
                    "trying to change decoupled property in auto-complete-config for model "
                    f"'{model}', which is already set to '{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted

    def __repr__(self) -> str:
        return f"ModelConfig({self._model_config!r})"


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The configuration of the input called ``name`` (from ``json.loads(args["model_config"])``),
    or None."""
    properties: dict[str, Any]
    for properties in model_config.get("input", ()):
        if properties["name"] == name:
            return properties
    return None


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The configuration of the output called ``name``, or None."""
    properties: dict[str, Any]
    for properties in model_config.get("output", ()):
        if properties["name"] == name:
            return properties
    return None


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    """Whether the configuration sets the decoupled transaction policy.

    Raises:
        KeyError: ``model_transaction_policy`` is present without ``decoupled`` (as upstream).
    """
    if "model_transaction_policy" in model_config:
        return bool(model_config["model_transaction_policy"]["decoupled"])
    return False
