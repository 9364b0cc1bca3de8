"""Test models for the runtime tests: a repository of small models, each exercising one
behaviour (written to a temporary directory by :func:`build_repository`)."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "model_repository"

IDENTITY_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

HEADER = """
import json, os, signal, sys, time
import numpy as np
import triton_python_backend_utils as pb_utils

def value(request):
    return pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()

def ok(request, array=None):
    array = value(request) if array is None else array
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", array)])
"""

MODELS: dict[str, str] = {
    "raises": """
        class TritonPythonModel:
            def execute(self, requests):
                raise ValueError("boom")
    """,
    "wrong_count": """
        class TritonPythonModel:
            def execute(self, requests):
                return []
    """,
    "not_list": """
        class TritonPythonModel:
            def execute(self, requests):
                return tuple(ok(r) for r in requests)
    """,
    "not_response": """
        class TritonPythonModel:
            def execute(self, requests):
                return ["nope" for r in requests]
    """,
    "send_twice": """
        class TritonPythonModel:
            def execute(self, requests):
                for r in requests:
                    r.get_response_sender().send(
                        ok(r), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return [ok(r) for r in requests]
    """,
    "crash": """
        class TritonPythonModel:
            def execute(self, requests):
                v = int(value(requests[0])[0])
                if v == 1:
                    os._exit(3)
                if v == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                if v == 3:
                    time.sleep(60)
                return [ok(r) for r in requests]
    """,
    "args_echo": """
        class TritonPythonModel:
            def initialize(self, args):
                self.args = args
            def execute(self, requests):
                text = np.array([json.dumps(self.args).encode()], dtype=object)
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", text)])
                        for r in requests]
    """,
    "logs": """
        class TritonPythonModel:
            def execute(self, requests):
                pb_utils.Logger.log_info("info from the model")
                pb_utils.Logger.log_warn("warning from the model")
                pb_utils.Logger.log_error("error from the model")
                return [ok(r) for r in requests]
    """,
    "metrics": """
        class TritonPythonModel:
            def initialize(self, args):
                family = pb_utils.MetricFamily(
                    name="requests_total", description="requests seen",
                    kind=pb_utils.MetricFamily.COUNTER)
                self.counter = family.Metric(labels={"model": args["model_name"]})
            def execute(self, requests):
                self.counter.increment(len(requests))
                return [ok(r) for r in requests]
    """,
    "bls_unknown": """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    response = pb_utils.InferenceRequest(
                        model_name="no_such_model", requested_output_names=["OUT"],
                        inputs=[pb_utils.get_input_tensor_by_name(r, "IN")]).exec()
                    text = response.error().message() + "|" + str(response.error().code())
                    out.append(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUT", np.array([text.encode()], dtype=object))]))
                return out
    """,
    "bls_wrong_mode": """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    n = pb_utils.Tensor("N", np.array([1], dtype=np.int32))
                    response = pb_utils.InferenceRequest(
                        model_name="decoupled_repeat", requested_output_names=["OUT"],
                        inputs=[n]).exec()
                    text = response.error().message()
                    out.append(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUT", np.array([text.encode()], dtype=object))]))
                return out
    """,
    "bls_stream": """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    n = pb_utils.Tensor("N", value(r).astype(np.int32)[:1])
                    responses = pb_utils.InferenceRequest(
                        model_name="decoupled_repeat", requested_output_names=["OUT"],
                        inputs=[n]).exec(decoupled=True)
                    got = [int(pb_utils.get_output_tensor_by_name(x, "OUT").as_numpy()[0])
                           for x in responses if x.output_tensors()]
                    out.append(ok(r, np.array(got, dtype=np.int32)))
                return out
    """,
    "identity": """
        class TritonPythonModel:
            def execute(self, requests):
                return [ok(r) for r in requests]
    """,
    "bls_async": """
        class TritonPythonModel:
            async def execute(self, requests):
                out = []
                for r in requests:
                    response = await pb_utils.InferenceRequest(
                        model_name="identity", requested_output_names=["OUT"],
                        inputs=[pb_utils.get_input_tensor_by_name(r, "IN")]).async_exec()
                    ready = pb_utils.is_model_ready("identity")
                    extra = np.array([int(ready)], dtype=np.int32)
                    out.append(ok(r, np.concatenate([
                        pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy(), extra])))
                return out
    """,
    "finalize_marker": """
        class TritonPythonModel:
            def initialize(self, args):
                self.path = os.path.join(args["model_repository"], "finalized")
            def execute(self, requests):
                return [ok(r) for r in requests]
            def finalize(self):
                with open(self.path, "w") as f:
                    f.write("yes")
    """,
    "readiness": """
        class TritonPythonModel:
            def initialize(self, args):
                self.state = True
            def is_ready(self):
                return self.state
            def execute(self, requests):
                v = int(value(requests[0])[0])
                self.state = {0: False, 1: True, 2: "yes"}[v]
                return [ok(r) for r in requests]
    """,
    "init_raises": """
        class TritonPythonModel:
            def initialize(self, args):
                raise RuntimeError("bad init")
            def execute(self, requests):
                return []
    """,
    "no_class": """
        class SomethingElse:
            pass
    """,
    "auto_bad": """
        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(config):
                return None
            def execute(self, requests):
                return []
    """,
}

DECOUPLED_CONFIG = IDENTITY_CONFIG + "model_transaction_policy { decoupled: true }\n"

# A decoupled model whose IN[0] says what it sends: 0 a response, an error response
# (UNAVAILABLE "bad step"), a response, then the final flag alone; 1 one response from a
# thread, then it lets go of the sender; 2 a response and an error response with the final
# flag; any other n one response [n] with the final flag.
STEPS_MODEL = """
import threading

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            mode = int(value(request)[0])
            error = pb_utils.InferenceResponse(
                error=pb_utils.TritonError("bad step", pb_utils.TritonError.UNAVAILABLE))
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            if mode == 0:
                sender.send(ok(request, np.array([1], np.int32)))
                sender.send(error)
                sender.send(ok(request, np.array([2], np.int32)))
                sender.send(flags=final)
            elif mode == 1:
                def later(sender=sender, request=request):
                    sender.send(ok(request, np.array([1], np.int32)))
                thread = threading.Thread(target=later)
                thread.start()
                thread.join()
            elif mode == 2:
                sender.send(ok(request, np.array([1], np.int32)))
                sender.send(error, flags=final)
            else:
                sender.send(ok(request, np.array([mode], np.int32)), flags=final)
        return None
"""


def write_model(root: Path, name: str, code: str, config: str = IDENTITY_CONFIG) -> None:
    """Model ``name`` under ``root``: ``HEADER`` and ``code`` (dedented) as version 1's
    ``model.py``, ``config`` after its name as ``config.pbtxt``."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(HEADER + textwrap.dedent(code))
    (root / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}')



def build_repository(root: Path) -> Path:
    """Write every test model under ``root``; returns ``root``."""
    for name, code in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(HEADER + textwrap.dedent(code))
        config = IDENTITY_CONFIG
        if name in ("args_echo", "bls_unknown", "bls_wrong_mode"):
            config = config.replace('"OUT" data_type: TYPE_INT32', '"OUT" data_type: TYPE_STRING')
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n' + config)
    (root / "decoupled_returns" / "1").mkdir(parents=True)
    (root / "decoupled_returns" / "1" / "model.py").write_text(
        HEADER + "class TritonPythonModel:\n    def execute(self, requests):\n"
        "        return [ok(r) for r in requests]\n"
    )
    (root / "decoupled_returns" / "config.pbtxt").write_text(DECOUPLED_CONFIG)
    (root / "bad_config" / "1").mkdir(parents=True)
    (root / "bad_config" / "1" / "model.py").write_text("")
    (root / "bad_config" / "config.pbtxt").write_text('name: "bad_config"\nmax_batch_size: "x"\n')
    (root / "no_model_py" / "1").mkdir(parents=True)
    (root / "no_model_py" / "config.pbtxt").write_text(IDENTITY_CONFIG)
    (root / "no_dims" / "1").mkdir(parents=True)
    (root / "no_dims" / "1" / "model.py").write_text(HEADER + textwrap.dedent(MODELS["raises"]))
    (root / "no_dims" / "config.pbtxt").write_text(
        'input [ { name: "IN" data_type: TYPE_INT32 } ]\n'
    )
    shutil.copytree(EXAMPLES / "decoupled_repeat", root / "decoupled_repeat")
    return root


def step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    """One ``ensemble_scheduling`` step: ``model`` with its input and output maps."""
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version}{maps} }}'


def ensemble(
    steps: list[str],
    inputs: str = '{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }',
    outputs: str = '{ name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] }',
    extra: str = "",
) -> str:
    """An ensemble's ``config.pbtxt`` from its ``steps`` (see :func:`step`)."""
    return (f'platform: "ensemble"\n{extra}\ninput [ {inputs} ]\noutput [ {outputs} ]\n'
            f"ensemble_scheduling {{ step [ {', '.join(steps)} ] }}\n")  # fmt: skip
