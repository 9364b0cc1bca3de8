"""The argument checks of upstream's ``L0_backend_python/argument_validation`` test model, run
against pb_tensor.utils: the same calls must raise the same exception types."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pb_tensor import utils as pb_utils

INPUTS = [pb_utils.Tensor("INPUT0", np.asarray([1, 2], dtype=np.int32))]
OUTPUTS = [pb_utils.Tensor("OUTPUT0", np.asarray([1, 2], dtype=np.int32))]


def _request(**kwargs: Any) -> pb_utils.InferenceRequest:
    base: dict[str, Any] = {
        "inputs": INPUTS,
        "model_name": "my_model",
        "requested_output_names": ["my_output"],
    }
    base.update(kwargs)
    return pb_utils.InferenceRequest(**base)


CASES: list[tuple[str, Callable[[], object], type[BaseException]]] = [
    ("inputs [None]", lambda: _request(inputs=[None]), pb_utils.TritonModelException),
    ("inputs None", lambda: _request(inputs=None), TypeError),
    ("model_name None", lambda: _request(model_name=None), TypeError),
    ("requested [None]", lambda: _request(requested_output_names=[None]), TypeError),
    ("requested None", lambda: _request(requested_output_names=None), TypeError),
    ("correlation_id None", lambda: _request(correlation_id=None), TypeError),
    ("request_id None", lambda: _request(request_id=None), TypeError),
    ("model_version None", lambda: _request(model_version=None), TypeError),
    ("flags None", lambda: _request(flags=None), TypeError),
    (
        "response [None]",
        lambda: pb_utils.InferenceResponse(output_tensors=[None]),  # type: ignore[list-item]
        pb_utils.TritonModelException,
    ),
    (
        "response None",
        lambda: pb_utils.InferenceResponse(output_tensors=None),  # type: ignore[arg-type]
        TypeError,
    ),
    ("tensor name None", lambda: pb_utils.Tensor(None, np.zeros(2)), TypeError),  # type: ignore[arg-type]
    ("tensor array None", lambda: pb_utils.Tensor("OUTPUT0", None), TypeError),  # type: ignore[arg-type]
    (
        "from_dlpack None",
        lambda: pb_utils.Tensor.from_dlpack("OUTPUT0", None),
        pb_utils.TritonModelException,
    ),
    (
        "from_dlpack empty name",
        lambda: pb_utils.Tensor.from_dlpack("", None),
        pb_utils.TritonModelException,
    ),
    ("tensor empty name, None", lambda: pb_utils.Tensor("", None), TypeError),  # type: ignore[arg-type]
    (
        "log level None",
        lambda: pb_utils.Logger.log("Invalid Level", None),  # type: ignore[arg-type]
        TypeError,
    ),
    ("log level int", lambda: pb_utils.Logger.log("Invalid Level", 1), TypeError),  # type: ignore[arg-type]
    ("log_info None", lambda: pb_utils.Logger.log_info(None), TypeError),  # type: ignore[arg-type]
    ("log_warn None", lambda: pb_utils.Logger.log_warn(None), TypeError),  # type: ignore[arg-type]
    ("log_error None", lambda: pb_utils.Logger.log_error(None), TypeError),  # type: ignore[arg-type]
    ("log_verbose None", lambda: pb_utils.Logger.log_verbose(None), TypeError),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("call", "error"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rejected_as_upstream(call: Callable[[], object], error: type[BaseException]) -> None:
    with pytest.raises(error):
        call()


def test_accepted_as_upstream() -> None:
    assert isinstance(_request(correlation_id=5).correlation_id(), int)
    assert _request(correlation_id="test_str_id-5").correlation_id() == "test_str_id-5"
    assert _request().correlation_id() == 0
    pb_utils.InferenceRequest(requested_output_names=[], inputs=[], model_name="my_model")
    pb_utils.InferenceResponse(output_tensors=[])
    pb_utils.InferenceResponse(OUTPUTS)
    pb_utils.Logger.log("Level unspecified")
