"""pb_tensor.utils: ModelConfig (auto_complete_config) with upstream's validation errors, and the
model-config helpers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pb_tensor import utils as pb_utils


def _config(**extra: Any) -> pb_utils.ModelConfig:
    base: dict[str, Any] = {"name": "m", "max_batch_size": 0, "input": [], "output": []}
    base.update(extra)
    return pb_utils.ModelConfig(json.dumps(base))


def _value_error(call: Any) -> str:
    with pytest.raises(ValueError) as e:  # noqa: PT011 - the text is compared exactly
        call()
    return str(e.value)


def test_from_json_text_and_dict() -> None:
    text = '{"name": "m", "max_batch_size": 4, "input": [], "output": []}'
    assert pb_utils.ModelConfig(text).as_dict() == json.loads(text)
    source = {"name": "m", "input": [{"name": "A", "dims": [1]}]}
    c = pb_utils.ModelConfig(source)
    c.as_dict()["input"][0]["dims"].append(2)
    assert source["input"][0]["dims"] == [1]  # a deep copy


def test_constructor_errors() -> None:
    with pytest.raises(TypeError) as e:
        pb_utils.ModelConfig(3)  # type: ignore[arg-type]
    assert str(e.value) == "ModelConfig(): model_config must be the JSON text or a dict, got int"
    with pytest.raises(ValueError) as e:  # noqa: PT011 - the text is compared exactly
        pb_utils.ModelConfig("[1]")
    assert str(e.value) == "ModelConfig(): the configuration is not a JSON object: [1]"
    with pytest.raises(json.JSONDecodeError):
        pb_utils.ModelConfig("{")


def test_as_dict_is_the_object() -> None:
    c = _config()
    assert c.as_dict() is c.as_dict()


def test_set_max_batch_size() -> None:
    c = _config()
    c.set_max_batch_size(8)
    assert c.as_dict()["max_batch_size"] == 8
    c.set_max_batch_size(16)
    assert c.as_dict()["max_batch_size"] == 16
    assert _value_error(lambda: c.set_max_batch_size(4)) == (
        "configuration specified max_batch_size 16, but in auto-complete-config function for "
        "model 'm' specified max_batch_size 4"
    )


def test_set_dynamic_batching() -> None:
    c = _config()
    c.set_dynamic_batching()
    assert c.as_dict()["dynamic_batching"] == {}
    c.as_dict()["dynamic_batching"]["max_queue_delay_microseconds"] = 5
    c.set_dynamic_batching()  # kept as configured
    assert c.as_dict()["dynamic_batching"] == {"max_queue_delay_microseconds": 5}


@pytest.mark.parametrize("scheduler", ["sequence_batching", "ensemble_scheduling"])
def test_set_dynamic_batching_conflict(scheduler: str) -> None:
    c = _config(**{scheduler: {}})
    assert _value_error(c.set_dynamic_batching) == (
        f"Configuration specified scheduling_choice as '{scheduler}', but auto-complete-config "
        "function for model 'm' tries to set scheduling_choice as 'dynamic_batching'"
    )


def test_add_input_and_output() -> None:
    c = _config()
    c.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True})
    c.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
    assert c.as_dict()["input"] == [
        {"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True}
    ]
    assert c.as_dict()["output"] == [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}]


def test_add_completes_configured_tensor() -> None:
    c = _config(
        input=[{"name": "IN", "data_type": "TYPE_INVALID", "dims": []}],
        output=[{"name": "OUT", "data_type": "TYPE_INT32", "dims": []}],
    )
    c.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [-1], "optional": False})
    c.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [2, 2]})
    assert c.as_dict()["input"] == [
        {"name": "IN", "data_type": "TYPE_INT32", "dims": [-1], "optional": False}
    ]
    assert c.as_dict()["output"] == [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [2, 2]}]


def test_add_without_input_key_in_config() -> None:
    c = pb_utils.ModelConfig('{"name": "m"}')
    c.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [1]})
    c.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]})
    assert len(c.as_dict()["input"]) == 1
    assert len(c.as_dict()["output"]) == 1


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            {"name": "IN", "data_type": "TYPE_FP32", "dims": [1], "format": "x"},
            "input 'IN' in auto-complete-config function for model 'm' contains property other "
            "than 'name', 'data_type', 'dims' and 'optional'.",
        ),
        (
            {"data_type": "TYPE_FP32", "dims": [1]},
            "input in auto-complete-config function for model 'm' is missing 'name' property.",
        ),
        (
            {"name": "IN", "dims": [1]},
            "input 'IN' in auto-complete-config function for model 'm' is missing 'data_type' "
            "property.",
        ),
        (
            {"name": "IN", "data_type": "TYPE_FP32"},
            "input 'IN' in auto-complete-config function for model 'm' is missing 'dims' "
            "property.",
        ),
    ],
)
def test_add_input_errors(tensor: dict[str, Any], message: str) -> None:
    assert _value_error(lambda: _config().add_input(tensor)) == message


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            {"name": "OUT", "data_type": "TYPE_FP32", "dims": [1], "optional": True},
            "output 'OUT' in auto-complete-config function for model 'm' contains property "
            "other than 'name', 'data_type' and 'dims'.",
        ),
        (
            {"dims": [1]},
            "output in auto-complete-config function for model 'm' is missing 'name' property.",
        ),
        (
            {"name": "OUT", "dims": [1]},
            "output 'OUT' in auto-complete-config function for model 'm' is missing "
            "'data_type' property.",
        ),
        (
            {"name": "OUT", "data_type": "TYPE_FP32"},
            "output 'OUT' in auto-complete-config function for model 'm' is missing 'dims' "
            "property.",
        ),
    ],
)
def test_add_output_errors(tensor: dict[str, Any], message: str) -> None:
    assert _value_error(lambda: _config().add_output(tensor)) == message


def test_add_conflicts_with_configuration() -> None:
    c = _config(
        input=[{"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": False}],
        output=[{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}],
    )
    assert _value_error(
        lambda: c.add_input({"name": "IN", "data_type": "TYPE_INT8", "dims": [4]})
    ) == (
        "unable to load model 'm', configuration expects datatype TYPE_FP32 for input 'IN', "
        "model provides TYPE_INT8"
    )
    assert _value_error(
        lambda: c.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [5]})
    ) == (
        "model 'm', tensor 'IN': the model expects dims [5] but the model configuration "
        "specifies dims [4]"
    )
    assert _value_error(
        lambda: c.add_input(
            {"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True}
        )
    ) == (
        "model 'm', tensor 'IN': the model expects optional True but the model configuration "
        "specifies optional False"
    )
    assert _value_error(
        lambda: c.add_output({"name": "OUT", "data_type": "TYPE_FP16", "dims": [4]})
    ) == (
        "unable to load model 'm', configuration expects datatype TYPE_FP32 for output 'OUT', "
        "model provides TYPE_FP16"
    )
    assert _value_error(
        lambda: c.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [1, 4]})
    ) == (
        "model 'm', tensor 'OUT': the model expects dims [1, 4] but the model configuration "
        "specifies dims [4]"
    )


def test_set_model_transaction_policy() -> None:
    c = _config()
    c.set_model_transaction_policy({"decoupled": True})
    assert c.as_dict()["model_transaction_policy"] == {"decoupled": True}
    c.set_model_transaction_policy({"decoupled": True})
    c.set_model_transaction_policy({})
    assert pb_utils.using_decoupled_model_transaction_policy(c.as_dict()) is True
    assert _value_error(lambda: c.set_model_transaction_policy({"decoupled": False})) == (
        "trying to change decoupled property in auto-complete-config for model 'm', which is "
        "already set to 'True'."
    )
    assert _value_error(lambda: c.set_model_transaction_policy({"sequence": True})) == (
        "model transaction property in auto-complete-config function for model 'm' contains "
        "property other than 'decoupled'."
    )


def test_config_helpers() -> None:
    config = {
        "input": [{"name": "A", "dims": [1]}, {"name": "B", "dims": [2]}],
        "output": [{"name": "C", "dims": [3]}],
    }
    assert pb_utils.get_input_config_by_name(config, "B") == {"name": "B", "dims": [2]}
    assert pb_utils.get_input_config_by_name(config, "C") is None
    assert pb_utils.get_output_config_by_name(config, "C") == {"name": "C", "dims": [3]}
    assert pb_utils.get_output_config_by_name({}, "C") is None
    assert pb_utils.get_input_config_by_name({}, "A") is None
    assert pb_utils.using_decoupled_model_transaction_policy({}) is False
    assert pb_utils.using_decoupled_model_transaction_policy(
        {"model_transaction_policy": {"decoupled": False}}
    ) is False
    with pytest.raises(KeyError):
        pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {}})


def test_flag_constants() -> None:
    assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START == 1
    assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END == 2
    assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL == 1
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE == 2


def test_dtype_and_bytes_helpers_are_pb_tensors() -> None:
    import pb_tensor

    for name in (
        "Tensor",
        "TRITON_STRING_TO_NUMPY",
        "serialize_byte_tensor",
        "deserialize_bytes_tensor",
        "numpy_to_triton_type",
        "triton_to_numpy_type",
        "triton_string_to_numpy",
    ):
        assert getattr(pb_utils, name) is getattr(pb_tensor, name), name
