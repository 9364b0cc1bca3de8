"""Doubles INPUT0 with PyTorch, moving tensors through DLPack (zero-copy both ways)."""

import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            x = torch.from_dlpack(in0.to_dlpack())
            zero_copy = x.data_ptr() == in0.data_ptr if x.numel() else True
            y = x * 2
            out0 = pb_utils.Tensor.from_dlpack("OUTPUT0", y)
            zero_copy = zero_copy and (y.numel() == 0 or out0.data_ptr == y.data_ptr())
            flag = pb_utils.Tensor("ZERO_COPY", np.array([zero_copy], dtype=np.bool_))
            responses.append(pb_utils.InferenceResponse([out0, flag]))
        return responses
