"""OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (numpy)."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        out0 = pb_utils.get_output_config_by_name(self.model_config, "OUTPUT0")
        self.out0_dtype = pb_utils.triton_string_to_numpy(out0["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if in0.shape != in1.shape:
                error = pb_utils.TritonError(
                    f"INPUT0 and INPUT1 must have the same shape, got {in0.shape} and {in1.shape}",
                    pb_utils.TritonError.INVALID_ARG,
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            out0 = pb_utils.Tensor("OUTPUT0", (in0 + in1).astype(self.out0_dtype))
            out1 = pb_utils.Tensor("OUTPUT1", (in0 - in1).astype(self.out0_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out0, out1]))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("add_sub: finalize")
