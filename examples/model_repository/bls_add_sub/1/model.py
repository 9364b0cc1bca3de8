"""Forwards its inputs to the add_sub model with a BLS request."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            bls_request = pb_utils.InferenceRequest(
                model_name="add_sub",
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[
                    pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                    pb_utils.get_input_tensor_by_name(request, "INPUT1"),
                ],
            )
            bls_response = bls_request.exec()
            if bls_response.has_error():
                raise pb_utils.TritonModelException(bls_response.error().message())
            responses.append(pb_utils.InferenceResponse(bls_response.output_tensors()))
        return responses
