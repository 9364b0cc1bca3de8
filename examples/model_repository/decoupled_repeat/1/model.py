"""Streams N responses per request from a background thread (decoupled mode)."""

import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            thread = threading.Thread(target=self.respond, args=(request, n))
            thread.start()
            self.threads.append(thread)

    def respond(self, request, n):
        sender = request.get_response_sender()
        for i in range(n):
            if sender.is_cancelled():
                break
            out = pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse([out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
