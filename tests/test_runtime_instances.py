"""Model instances (``instance_group``): Triton's names and ``initialize`` arguments per
instance, requests running concurrently on idle instances, BLS to itself, unload, crashes,
and the statistics of a model without a batcher."""

from __future__ import annotations

import itertools
import json
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from upstream_models import PYTHON_MODELS, repository

from pb_tensor.runtime import InferenceError, ModelLoadError, ModelRepository
from pb_tensor.runtime._scheduling._stats import Statistics

_MODEL = '''
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]
        keys = ("model_instance_name", "model_instance_kind", "model_instance_device_id")
        path = os.path.join(args["model_repository"], "init_" + self.name + ".json")
        with open(path, "w") as f:
            json.dump({k: args[k] for k in keys}, f)
        self.dir = args["model_repository"]

    def execute(self, requests):
        out = []
        for request in requests:
            sleep = float(pb_utils.get_input_tensor_by_name(request, "SLEEP").as_numpy()[0])
            if sleep < 0:
                os._exit(1)
            start = time.time()
            time.sleep(sleep)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("NAME", np.array([self.name.encode()], dtype=np.object_)),
                pb_utils.Tensor("TIMES", np.array([start, time.time()], dtype=np.float64)),
            ]))
        return out

    def finalize(self):
        open(os.path.join(self.dir, "fini_" + self.name), "w").close()
'''

_CONFIG = """
backend: "python"
input [ { name: "SLEEP" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [
  { name: "NAME" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "TIMES" data_type: TYPE_FP64 dims: [ 2 ] }
]
"""


def _write(root: Path, groups: str, name: str = "rec") -> Path:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "1" / "model.py").write_text(_MODEL)
    (root / name / "config.pbtxt").write_text(_CONFIG + groups)
    return root


def _sleep(seconds: float) -> dict[str, np.ndarray]:
    return {"SLEEP": np.array([seconds], np.float32)}


MODES = pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])


@MODES
def test_initialize_args_per_instance(tmp_path: Path, isolated: bool) -> None:
    """Each instance gets Triton's name (``<group>_<c>``), kind and device id; unloading
    finalizes every one of them."""
    _write(tmp_path, """
instance_group [
  { count: 2 kind: KIND_CPU },
  { name: "extra" count: 1 kind: KIND_MODEL }
]
""")
    with ModelRepository(tmp_path) as repo:
        model = repo.load("rec", isolated=isolated)
        assert model.instance_names == ["rec_0_0", "rec_0_1", "extra_0"]
        assert model.instance_name == "rec_0_0"
        pids = model.pids
        if isolated:
            assert len(set(pids)) == 3
            assert None not in pids
        else:
            assert pids == [None, None, None]
        model.unload()
    args = {p.name: json.loads(p.read_text()) for p in (tmp_path / "rec").glob("init_*.json")}
    assert args == {
        "init_rec_0_0.json": {"model_instance_name": "rec_0_0", "model_instance_kind": "CPU",
                              "model_instance_device_id": "0"},
        "init_rec_0_1.json": {"model_instance_name": "rec_0_1", "model_instance_kind": "CPU",
                              "model_instance_device_id": "0"},
        "init_extra_0.json": {"model_instance_name": "extra_0", "model_instance_kind": "MODEL",
                              "model_instance_device_id": "0"},
    }
    assert sorted(p.name for p in (tmp_path / "rec").glob("fini_*")) == [
        "fini_extra_0", "fini_rec_0_0", "fini_rec_0_1"
    ]


@MODES
def test_two_instances_run_concurrently(tmp_path: Path, isolated: bool) -> None:
    """Two 0.4 s requests on two instances overlap (the times the model recorded), each on
    its own instance."""
    _write(tmp_path, "instance_group [ { count: 2 kind: KIND_CPU } ]")
    with ModelRepository(tmp_path) as repo:
        model = repo.load("rec", isolated=isolated, timeout=30)
        futures = [model.infer_async(_sleep(0.4)) for _ in range(2)]
        results = [f.result(30) for f in futures]
    names = sorted(r["NAME"][0] for r in results)
    assert names == [b"rec_0_0", b"rec_0_1"]
    (s0, e0), (s1, e1) = (r["TIMES"] for r in results)
    assert s0 < e1
    assert s1 < e0


def test_one_instance_runs_requests_one_at_a_time(tmp_path: Path) -> None:
    """With one instance, concurrent requests do not overlap."""
    _write(tmp_path, "")
    with ModelRepository(tmp_path) as repo:
        model = repo.load("rec", isolated=False)
        futures = [model.infer_async(_sleep(0.1)) for _ in range(3)]
        spans = sorted(tuple(f.result(30)["TIMES"]) for f in futures)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start


def test_kind_gpu_without_gpu_is_triton_load_error(tmp_path: Path) -> None:
    from pb_tensor import cuda

    if cuda.device_count() > 0:
        pytest.skip("a GPU is visible: KIND_GPU instances load")
    _write(tmp_path, "instance_group [ { count: 1 kind: KIND_GPU } ]")
    with ModelRepository(tmp_path) as repo, pytest.raises(ModelLoadError) as info:
        repo.load("rec", isolated=False)
    assert str(info.value).endswith(
        ": instance group rec_0 of model rec has kind KIND_GPU but no GPUs are available"
    )


def test_gpus_in_a_cpu_group_is_triton_load_error(tmp_path: Path) -> None:
    _write(tmp_path, "instance_group [ { count: 1 kind: KIND_CPU gpus: [ 0 ] } ]")
    with ModelRepository(tmp_path) as repo, pytest.raises(ModelLoadError) as info:
        repo.load("rec", isolated=False)
    assert str(info.value).endswith(
        ": instance group rec_0 of model rec has kind KIND_CPU but specifies one or more GPUs"
    )


def test_crash_of_one_instance_fails_only_its_request(tmp_path: Path) -> None:
    """One stub dies: its request fails with Triton's error; the other instance's request
    succeeds; the crashed instance restarts for the next request."""
    _write(tmp_path, "instance_group [ { count: 2 kind: KIND_CPU } ]")
    with ModelRepository(tmp_path) as repo:
        model = repo.load("rec", isolated=True, timeout=30)
        slow = model.infer_async(_sleep(0.5))
        crash = model.infer_async(_sleep(-1.0))
        with pytest.raises(InferenceError) as info:
            crash.result(30)
        assert "is not healthy" in info.value.message()
        assert slow.result(30)["NAME"][0] in (b"rec_0_0", b"rec_0_1")
        results = [model.infer(_sleep(0.0))["NAME"][0] for _ in range(4)]
        assert sorted(set(results)) == [b"rec_0_0", b"rec_0_1"]


def test_statistics_without_batcher(tmp_path: Path) -> None:
    """Each request is its own ``execute``: execution_count equals inference_count; a
    request refused by validation counts as a failure."""
    _write(tmp_path, "instance_group [ { count: 2 kind: KIND_CPU } ]")
    with ModelRepository(tmp_path) as repo:
        model = repo.load("rec", isolated=False)
        empty = model.statistics()
        assert empty["execution_count"] == 0
        assert empty["last_inference"] == 0
        for _ in range(3):
            model.infer(_sleep(0.0))
        with pytest.raises(InferenceError):
            model.infer({"SLEEP": np.array([0.0], np.float64)})
        stats = model.statistics()
    assert stats["name"] == "rec"
    assert stats["version"] == "1"
    assert stats["inference_count"] == 3
    assert stats["execution_count"] == 3
    assert stats["last_inference"] > 0
    inference = stats["inference_stats"]
    assert [inference[k]["count"] for k in ("success", "fail", "queue", "compute_input",
                                            "compute_infer", "compute_output", "cache_hit",
                                            "cache_miss")] == [3, 1, 3, 3, 3, 3, 0, 0]
    assert inference["success"]["ns"] >= inference["compute_infer"]["ns"] > 0
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (1, 3)
    ]
    assert stats["response_stats"] == {}
    assert stats["memory_usage"] == []


@pytest.mark.parametrize("failed", [False, True], ids=["success", "failure"])
def test_statistics_of_one_request_as_of_a_batch(failed: bool) -> None:
    """``one_request`` (the in-process path's single call) records what ``execution`` and
    then ``success`` / ``failure`` record for a batch of one."""
    one, pair = Statistics(), Statistics()
    for start, exec_start, end, size in ((100, 250, 1000, 1), (2000, 2000, 2600, 4)):
        one.one_request(size, failed, start, exec_start, end)
        pair.execution(size, exec_start, exec_start, end, end)
        if failed:
            pair.failure(start, end)
        else:
            pair.success(size, start, exec_start, exec_start, end, end, end)
    got, want = one.entry("m", 1), pair.entry("m", 1)
    assert got["last_inference"] > 0
    assert abs(got.pop("last_inference") - want.pop("last_inference")) < 60_000
    assert got == want
    assert got["inference_stats"]["fail" if failed else "success"]["count"] == 2


# -- BLS to itself ---------------------------------------------------------------------------
_SELF_CALL = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            depth = int(pb_utils.get_input_tensor_by_name(request, "DEPTH").as_numpy()[0])
            text = ""
            if depth > 0:
                response = pb_utils.InferenceRequest(
                    model_name="self_call", requested_output_names=["ERROR"],
                    inputs=[pb_utils.Tensor("DEPTH", np.array([depth - 1], np.int32))],
                ).exec()
                if response.has_error():
                    text = response.error().message()
                else:
                    text = response.output_tensors()[0].as_numpy()[0].decode()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("ERROR", np.array([text.encode() or b"ok"], np.object_))]))
        return out
'''


@MODES
@pytest.mark.parametrize("count", [1, 2])
def test_bls_to_itself(tmp_path: Path, isolated: bool, count: int) -> None:
    """A model with two instances may call itself once (the call runs on the other
    instance); one level deeper than its instances, or with one instance, the call gets
    UNAVAILABLE instead of deadlocking."""
    (tmp_path / "self_call" / "1").mkdir(parents=True)
    (tmp_path / "self_call" / "1" / "model.py").write_text(_SELF_CALL)
    (tmp_path / "self_call" / "config.pbtxt").write_text(textwrap.dedent(f"""
        backend: "python"
        input [ {{ name: "DEPTH" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        output [ {{ name: "ERROR" data_type: TYPE_STRING dims: [ 1 ] }} ]
        instance_group [ {{ count: {count} kind: KIND_CPU }} ]
    """))
    with ModelRepository(tmp_path) as repo:
        model = repo.load("self_call", isolated=isolated, timeout=30)
        error = model.infer({"DEPTH": np.array([count], np.int32)})["ERROR"][0].decode()
        if count == 1:
            assert error.endswith(
                "model 'self_call' has one instance and this thread is already using it "
                "(a BLS request to itself, or a request made while iterating its stream)"
            )
        else:
            assert error.endswith(
                "model 'self_call' has 2 instances and this thread is already using all of "
                "them (BLS requests to itself nested deeper than its instance count, or "
                "requests made while iterating its streams)"
            )
            assert model.infer({"DEPTH": np.array([1], np.int32)})["ERROR"][0] == b"ok"


@MODES
def test_upstream_bls_parameters(tmp_path: Path, isolated: bool) -> None:
    """qa bls_parameters (4 instances) calls itself recursively three levels deep; the
    assertions of L0_backend_python/bls/bls_parameters_test.py."""
    repository(tmp_path, {"bls_parameters": PYTHON_MODELS / "bls_parameters"})
    num_params = 3
    expected_params = {}
    for i in range(1, num_params + 1):
        expected_params["bool_" + str(i)] = bool(i)
        expected_params["int_" + str(i)] = i
        expected_params["str_" + str(i)] = str(i)
    with ModelRepository(tmp_path) as repo:
        model = repo.load("bls_parameters", isolated=isolated, timeout=60)
        result = model.infer({"NUMBER_PARAMETERS": np.array([num_params], dtype=np.ubyte)},
                             requested_outputs=["PARAMETERS_AGGREGATED"])  # fmt: skip
    params_json = str(result["PARAMETERS_AGGREGATED"][0], encoding="utf-8")
    assert json.loads(params_json) == expected_params


def test_concurrent_callers_threads(tmp_path: Path) -> None:
    """Eight threads share two instances: every request answered by one of them."""
    _write(tmp_path, "instance_group [ { count: 2 kind: KIND_CPU } ]")
    names: list[bytes] = []
    with ModelRepository(tmp_path) as repo:
        model = repo.load("rec", isolated=False)

        def call() -> None:
            names.append(model.infer(_sleep(0.01))["NAME"][0])

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert len(names) == 8
    assert set(names) <= {b"rec_0_0", b"rec_0_1"}


def test_kind_gpu_instances_per_visible_gpu(tmp_path: Path, fake: object) -> None:
    """With two (fake) GPUs visible: a KIND_GPU group without ``gpus`` gets ``count``
    instances on each GPU (Triton names them per count, so both GPUs have ``<group>_0``);
    listed GPUs get ``count`` each; an id that is not visible is Triton's load error."""
    _write(tmp_path, """
instance_group [
  { count: 1 kind: KIND_GPU },
  { name: "one" count: 2 kind: KIND_GPU gpus: [ 1 ] }
]
""")
    with ModelRepository(tmp_path) as repo:
        model = repo.load("rec", isolated=False)
        assert model.instance_names == ["rec_0_0", "rec_0_0", "one_0", "one_1"]
        assert model.config["instance_group"][0]["gpus"] == [0, 1]
        model.unload()
    args = {p.name: json.loads(p.read_text()) for p in (tmp_path / "rec").glob("init_*.json")}
    assert args["init_one_0.json"] == {"model_instance_name": "one_0",
                                       "model_instance_kind": "GPU",
                                       "model_instance_device_id": "1"}  # fmt: skip
    assert args["init_rec_0_0.json"]["model_instance_kind"] == "GPU"
    _write(tmp_path, "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 5 ] } ]", "bad")
    with ModelRepository(tmp_path) as repo, pytest.raises(ModelLoadError) as info:
        repo.load("bad", isolated=False)
    assert str(info.value).endswith(
        ": instance group bad_0 of model bad specifies invalid or unsupported gpu id 5. GPUs "
        "with at least the minimum required CUDA compute compatibility of 6.000000 are: 0, 1"
    )


@MODES
@pytest.mark.parametrize(("name", "groups"), [
    ("rec$1", ""),  # the model's name (its auto-complete stub's)
    ("rec", 'instance_group [ { name: "g(1)" count: 1 kind: KIND_CPU } ]\n'),  # an instance's
])  # fmt: skip
def test_a_stub_name_python_backend_refuses(tmp_path: Path, isolated: bool, name: str,
                                            groups: str) -> None:  # fmt: skip
    # python_backend's IsValidIdentifier: no stub starts under a name with a shell character.
    _write(tmp_path, groups, name=name)
    with ModelRepository(tmp_path) as repo, pytest.raises(ModelLoadError) as info:
        repo.load(name, isolated=isolated)
    assert str(info.value).endswith(": Invalid stub name: contains invalid characters")
    assert str(info.value).startswith(f"failed to load model '{name}' version 1 (")
