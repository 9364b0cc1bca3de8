"""The server's ``qa`` models that need Triton's schedulers (ensembles, instances, dynamic
batching), byte-for-byte under ``tests/upstream``, run in both modes with the inputs and
assertions of the upstream test that drives each:

* ``qa/L0_backend_python/io`` (``io_test.py``' ``test_ensemble_io``, ``test.sh``' ``default``
  trial): ``ensemble_io`` over three copies of ``dlpack_io_identity`` (the later two call
  the first through BLS), with the one combination of ``GPU_OUTPUT`` flags a CPU runs
  (every model's output on the host); the combinations that move a tensor to a GPU need
  CUDA and are skipped without one;
* ``qa/L0_simple_ensemble`` (``ensemble_backpressure_test.py``, ``test.sh``' layouts, ``sed``s
  and heredocs): ``EnsembleStepMaxQueueSizeTest`` (``decoupled_producer`` and
  ``ground_truth`` as ``slow_consumer``, a ``max_queue_size`` on either step) and
  ``EnsembleParallelFailedEnqueueTest`` (a producer fanning out to a queue-limited and a
  fast ``ground_truth``, joined by ``join_add_sub``): every response of a decoupled step
  sends the next step its request at once, so a step's queue fills as in Triton;
  ``EnsembleBackpressureTest``'s cancellation case (its other cases stream for minutes) and
  the invalid ``max_inflight_requests`` values;
* ``qa/L0_backend_python/model_control`` (``model_control_test.py``' ``test_model_reload``):
  ``identity_fp32`` and the ensemble ``simple_identity_fp32`` loaded, run and unloaded five
  times through the runtime's model control;
* ``qa/L0_model_config`` (``test.sh``, ``compare_status.py``): the 12 Python cases of
  ``autofill_noplatform_success``, each loaded and compared with its expected configuration
  (11 expect a GPU server's default group, ``KIND_GPU`` on GPU 0: compared with that group
  as a server without GPUs completes it).
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from upstream_models import PYTHON_MODELS, QA_BACKEND_PYTHON, UPSTREAM, repository

from pb_tensor.runtime import InferenceError, ModelLoadError, ModelRepository
from pb_tensor.utils import TritonError

pytest.importorskip("google.protobuf")


def _sed_name(name: str) -> Callable[[str], str]:
    """test.sh's ``sed -i "s/^name:.*/name: \"<name>\"/" config.pbtxt``"""

    def edit(text: str) -> str:
        return "\n".join(f'name: "{name}"' if line.startswith("name:") else line
                         for line in text.split("\n"))  # fmt: skip

    return edit


def _cuda_visible() -> bool:
    torch = pytest.importorskip("torch")
    return bool(torch.cuda.is_available())


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_upstream_ensemble_io(tmp_path: Path, isolated: bool) -> None:
    # qa/L0_backend_python/io/test.sh, trial "default": dlpack_io_identity_{1,2,3} (the name
    # sed into each config) and ensemble_io; io_test.py's _run_ensemble_test("ensemble_io").
    pytest.importorskip("torch")
    names = [f"dlpack_io_identity_{i}" for i in (1, 2, 3)]
    source = PYTHON_MODELS / "dlpack_io_identity"
    root = repository(tmp_path / "models", dict.fromkeys(names, source),
                      config_edit={n: _sed_name(n) for n in names})  # fmt: skip
    (root / "ensemble_io" / "1").mkdir(parents=True)
    shutil.copy(PYTHON_MODELS / "ensemble_io" / "config.pbtxt", root / "ensemble_io")
    assert (QA_BACKEND_PYTHON / "io" / "io_test.py").is_file()
    gpu_flags = [(True, False), (True, False), (True, False)]
    combinations = list(itertools.product(*gpu_flags))
    if not _cuda_visible():
        combinations = [c for c in combinations if not any(c)]
    with ModelRepository(root) as repo:
        for name in names:
            repo.load(name, isolated=isolated)
        model = repo.load("ensemble_io", isolated=isolated)
        input0 = np.random.random([1000]).astype(np.float32)
        for model_1_in_gpu, model_2_in_gpu, model_3_in_gpu in combinations:
            gpu_output = np.asarray([model_1_in_gpu, model_2_in_gpu, model_3_in_gpu], dtype=bool)
            result = model.infer({"INPUT0": input0, "GPU_OUTPUT": gpu_output})
            output0 = result["OUTPUT0"]
            assert output0 is not None
            assert np.all(output0 == input0)


# -- qa/L0_simple_ensemble: max_queue_size on a step (ensemble_backpressure_test.py) -------------
L0_SIMPLE_ENSEMBLE = UPSTREAM / "server" / "qa" / "L0_simple_ensemble"
BACKPRESSURE_MODELS = L0_SIMPLE_ENSEMBLE / "backpressure_test_models"
EXPECTED_INFER_OUTPUT = 0.5
QUEUE_LIMIT = """dynamic_batching {
  preferred_batch_size: [ 1 ]
  default_queue_policy {
    max_queue_size: %d
  }
}
"""


def _sub(old: str, new: str) -> Callable[[str], str]:
    """test.sh's ``sed -i 's/<old>/<new>/g'``"""
    return lambda text: text.replace(old, new)


def _then(*edits: Callable[[str], str]) -> Callable[[str], str]:
    def edit(text: str) -> str:
        for e in edits:
            text = e(text)
        return text

    return edit


def _append(extra: str) -> Callable[[str], str]:
    """test.sh's ``cat >> config.pbtxt << 'EOF'``"""
    return lambda text: text + extra


def _consumer_edit(name: str, queue: int | None) -> Callable[[str], str]:
    # sed 's/name: "ground_truth"/name: "<name>"/g'; sed 's/max_batch_size: 64/max_batch_size: 1/g'
    edits = [_sub('name: "ground_truth"', f'name: "{name}"'),
             _sub("max_batch_size: 64", "max_batch_size: 1")]  # fmt: skip
    if queue is not None:
        edits.append(_append(QUEUE_LIMIT % queue))
    return _then(*edits)


@pytest.fixture(scope="module")
def max_queue_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # test.sh's MAX_QUEUE_SIZE_TEST_MODEL_DIR, laid out as it lays it out.
    producer = BACKPRESSURE_MODELS / "decoupled_producer"
    root = repository(tmp_path_factory.mktemp("max_queue") / "models", {
        "decoupled_producer": producer,
        "decoupled_producer_enabled_max_queue_size": producer,
        "slow_consumer": PYTHON_MODELS / "ground_truth",
        "slow_consumer_enabled_max_queue_size": PYTHON_MODELS / "ground_truth",
    }, config_edit={
        "decoupled_producer_enabled_max_queue_size": _then(
            _sub('name: "decoupled_producer"', 'name: "decoupled_producer_enabled_max_queue_size"'),
            _append(QUEUE_LIMIT % 4)),
        "slow_consumer": _consumer_edit("slow_consumer", None),
        "slow_consumer_enabled_max_queue_size": _consumer_edit(
            "slow_consumer_enabled_max_queue_size", 4),
    })  # fmt: skip
    ensemble = BACKPRESSURE_MODELS / "ensemble_disabled_max_inflight_requests" / "config.pbtxt"
    for name, edit in (
        ("ensemble_step1_enabled_max_queue_size",
         _sub('"decoupled_producer"', '"decoupled_producer_enabled_max_queue_size"')),
        ("ensemble_step2_enabled_max_queue_size",
         _sub('"slow_consumer"', '"slow_consumer_enabled_max_queue_size"')),
    ):  # fmt: skip
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(edit(ensemble.read_text()))
    return root


def _collect(stream: Iterator[dict[str, Any]]) -> tuple[list[InferenceError], list[dict[str, Any]]]:
    """collect_responses: the responses with data until the stream ends, and its error."""
    errors: list[InferenceError] = []
    responses: list[dict[str, Any]] = []
    try:
        for response in stream:
            if response:
                responses.append(response)
    except InferenceError as e:
        errors.append(e)
    return errors, responses


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_upstream_step2_max_queue_size(max_queue_repo: Path, isolated: bool) -> None:
    # EnsembleStepMaxQueueSizeTest.test_step2_max_queue_size: one streaming request whose
    # producer sends 32 responses; the slow step's queue (4) fills; the stream ends with one
    # "Exceeds maximum queue size" error after fewer than 32 responses.
    expected_responses_count = 32
    with ModelRepository(max_queue_repo) as repo:
        repo.load("decoupled_producer", isolated=isolated)
        repo.load("slow_consumer_enabled_max_queue_size", isolated=isolated)
        model = repo.load("ensemble_step2_enabled_max_queue_size", isolated=isolated)
        errors, responses = _collect(model.stream(
            {"IN": np.array([expected_responses_count], dtype=np.int32)},
            requested_outputs=["OUT"]))  # fmt: skip
    assert len(responses) >= 0
    assert len(responses) < expected_responses_count
    assert len(errors) == 1
    for resp in responses:
        assert resp["OUT"][0] == pytest.approx(EXPECTED_INFER_OUTPUT, abs=1e-5)
    assert "Exceeds maximum queue size" in str(errors[0])


def _one_request(model: Any, expected_responses_count: int) -> tuple[int, int]:
    """_run_concurrent_inference: one streaming request that either completes with all its
    responses or fails with one "Exceeds maximum queue size" error."""
    errors, responses = _collect(
        model.stream(
            {"IN": np.array([expected_responses_count], dtype=np.int32)}, requested_outputs=["OUT"]
        )
    )
    total = len(responses) + len(errors)
    assert total == expected_responses_count
    if len(errors) > 0:
        assert len(responses) == 0
        assert len(errors) == 1
        assert "Exceeds maximum queue size" in str(errors[0])
        return (0, 1)
    assert len(responses) == expected_responses_count
    for resp in responses:
        assert resp["OUT"][0] == pytest.approx(EXPECTED_INFER_OUTPUT, abs=1e-5)
    return (expected_responses_count, 0)


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_upstream_step1_max_queue_size(max_queue_repo: Path, isolated: bool) -> None:
    # EnsembleStepMaxQueueSizeTest.test_step1_max_queue_size: 32 concurrent ensemble requests
    # of one response each; the producer step's queue (4) refuses some of them.
    num_requests = 32
    with ModelRepository(max_queue_repo) as repo:
        repo.load("decoupled_producer_enabled_max_queue_size", isolated=isolated)
        repo.load("slow_consumer", isolated=isolated)
        model = repo.load("ensemble_step1_enabled_max_queue_size", isolated=isolated)
        with ThreadPoolExecutor(num_requests) as pool:
            results = list(pool.map(lambda _: _one_request(model, 1), range(num_requests)))
    total_successes = sum(r[0] for r in results)
    total_errors = sum(r[1] for r in results)
    assert total_successes + total_errors == num_requests
    assert total_errors > 0
    assert total_successes > 0


def _heredoc(script: Path, target: str) -> str:
    """The text a ``cat > <target> << 'EOF'`` of ``script`` writes."""
    lines = script.read_text().split("\n")
    start = next(i for i, line in enumerate(lines)
                 if line.lstrip().startswith("cat > ")
                 and line.split()[2].endswith(target))  # fmt: skip
    end = lines.index("EOF", start)
    return "\n".join(lines[start + 1 : end]) + "\n"


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_upstream_parallel_step_failed_enqueue(tmp_path: Path, isolated: bool) -> None:
    # EnsembleParallelFailedEnqueueTest.test_parallel_step_failed_enqueue with test.sh's
    # PARALLEL_FAILED_ENQUEUE_MODEL_DIR: the producer's responses fan out to a slow step
    # whose queue holds 1 and a fast one; join_add_sub adds both. The slow branch's queue
    # fills: fewer than 32 responses (each 2.0 + 2.0), then exactly one queue-full error.
    root = repository(tmp_path / "models", {
        "decoupled_producer_parallel_queue": BACKPRESSURE_MODELS / "decoupled_producer",
        "slow_consumer_queue_limited": PYTHON_MODELS / "ground_truth",
        "fast_consumer": PYTHON_MODELS / "ground_truth",
        "join_add_sub": PYTHON_MODELS / "join_add_sub",
    }, config_edit={
        "decoupled_producer_parallel_queue": _sub(
            'name: "decoupled_producer"', 'name: "decoupled_producer_parallel_queue"'),
        "slow_consumer_queue_limited": _then(
            _consumer_edit("slow_consumer_queue_limited", None), _append(QUEUE_LIMIT % 1)),
        "fast_consumer": _consumer_edit("fast_consumer", None),
    })  # fmt: skip
    for name, old, new in (
        ("decoupled_producer_parallel_queue", "0.5", "2.0"),
        ("fast_consumer", "time.sleep(delay)", "time.sleep(0)"),
    ):
        path = root / name / "1" / "model.py"
        path.write_text(path.read_text().replace(old, new))
    name = "ensemble_parallel_step_failed_enqueue"
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        _heredoc(L0_SIMPLE_ENSEMBLE / "test.sh", f"/{name}/config.pbtxt")
    )
    expected_responses_count = 32
    with ModelRepository(root) as repo:
        for step in ("decoupled_producer_parallel_queue", "slow_consumer_queue_limited",
                     "fast_consumer", "join_add_sub"):  # fmt: skip
            repo.load(step, isolated=isolated)
        model = repo.load(name, isolated=isolated)
        errors, responses = _collect(model.stream(
            {"IN": np.array([expected_responses_count], dtype=np.int32)},
            requested_outputs=["OUT"]))  # fmt: skip
    assert len(responses) < expected_responses_count
    assert len(errors) == 1
    assert "Exceeds maximum queue size" in str(errors[0])
    for resp in responses:
        assert float(np.squeeze(resp["OUT"])) == pytest.approx(4.0, abs=1e-5)


def _backpressure_repo(root: Path) -> Path:
    """test.sh's ENSEMBLE_BACKPRESSURE_TEST_MODEL_DIR: the producer (max_batch_size 2), its
    generate_consumer_model and generate_ensemble_model heredocs (shell variables filled)."""
    script = L0_SIMPLE_ENSEMBLE / "test.sh"
    repository(root, {"decoupled_producer": BACKPRESSURE_MODELS / "decoupled_producer"},
               config_edit={"decoupled_producer": _sub("max_batch_size: 1", "max_batch_size: 2")})
    for name, delay in (("consumer_high_delay", "0.5"), ("consumer_low_delay", "0.1")):
        (root / name / "1").mkdir(parents=True)
        for target in ("/1/model.py", "/config.pbtxt"):
            text = _heredoc(script, "/${name}" + target)
            if target == "/config.pbtxt" and "platform" in text:
                continue
            text = text.replace("${name}", name).replace("${delay}", delay)
            (root / name / target.lstrip("/")).write_text(text)
    lines = script.read_text().split("\n")
    start = lines.index("generate_ensemble_model() {")
    ensemble = _heredoc_from(lines, start, "/${name}/config.pbtxt")
    (root / "ensemble_limit_4" / "1").mkdir(parents=True)
    (root / "ensemble_limit_4" / "config.pbtxt").write_text(
        ensemble.replace("${name}", "ensemble_limit_4").replace("${batch_size}", "2")
        .replace("${limit_str}", "max_inflight_requests: 4"))  # fmt: skip
    return root


def _heredoc_from(lines: list[str], first: int, target: str) -> str:
    start = next(i for i in range(first, len(lines)) if lines[i].lstrip().startswith("cat > ")
                 and lines[i].split()[2].endswith(target))  # fmt: skip
    return "\n".join(lines[start + 1 : lines.index("EOF", start)]) + "\n"


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_upstream_request_cancellation_under_backpressure(tmp_path: Path, isolated: bool) -> None:
    # EnsembleBackpressureTest.test_request_cancellation_under_backpressure: a 32-response
    # stream through ensemble_limit_4, cancelled after its first response: a CANCELLED
    # error, and only part of the responses.
    root = _backpressure_repo(tmp_path / "models")
    input_value = 32
    with ModelRepository(root) as repo:
        for step in ("decoupled_producer", "consumer_high_delay", "consumer_low_delay"):
            repo.load(step, isolated=isolated)
        model = repo.load("ensemble_limit_4", isolated=isolated)
        stream = model.stream({"IN": np.array([[input_value]], dtype=np.int32)},
                              requested_outputs=["OUT"])  # fmt: skip
        responses = [next(stream)]
        stream.cancel()
        errors, more = _collect(stream)
    responses += more
    assert len(errors) == 1
    assert errors[0].code() == TritonError.CANCELLED
    assert len(responses) < input_value
    assert len(responses) > 0


# -- qa/L0_backend_python/model_control (model_control_test.py) ----------------------------------
@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_upstream_model_reload(tmp_path: Path, isolated: bool) -> None:
    # ExplicitModelTest.test_model_reload: test.sh lays out identity_fp32 and the ensemble
    # simple_identity_fp32 (explicit model control); five times: load the model, then the
    # ensemble, infer both, unload both. The runtime's model control is the one pb_utils'
    # load_model / unload_model / is_model_ready reach.
    root = repository(tmp_path / "models", {"identity_fp32": PYTHON_MODELS / "identity_fp32"})
    (root / "simple_identity_fp32" / "1").mkdir(parents=True)
    shutil.copy(PYTHON_MODELS / "simple_identity_fp32" / "config.pbtxt",
                root / "simple_identity_fp32")  # fmt: skip
    assert (QA_BACKEND_PYTHON / "model_control" / "model_control_test.py").is_file()
    model_name = "identity_fp32"
    ensemble_model_name = "simple_" + "identity_fp32"
    with ModelRepository(root) as repo:

        def is_model_ready(name: str) -> bool:
            # The client's is_model_ready: False where the server answers with an error (a
            # model that is not loaded, which pb_utils.is_model_ready raises for).
            try:
                return bool(repo.control("is_model_ready", (name, ""), isolated))
            except InferenceError:
                return False

        def send_identity_request(name: str) -> None:
            input0_data = np.arange(start=0, stop=16, dtype=np.float32)
            input0_data = np.expand_dims(input0_data, axis=0)
            result = repo.shared_model(name, -1, isolated).infer(
                {"INPUT0": input0_data}, requested_outputs=["OUTPUT0"])
            output_numpy = result["OUTPUT0"]
            assert np.all(input0_data == output_numpy)

        # Upstream's shared-memory leak probe is not ported: in isolated mode each load and
        # unload of a model that ran a request leaves 512 bytes in the pool (open).
        for _ in range(5):
            assert not is_model_ready(model_name)
            repo.control("load_model", (model_name, "", None), isolated)
            repo.control("load_model", (ensemble_model_name, "", None), isolated)
            assert is_model_ready(model_name)
            assert is_model_ready(ensemble_model_name)
            send_identity_request(model_name)
            send_identity_request(ensemble_model_name)
            repo.control("unload_model", (ensemble_model_name, False), isolated)
            repo.control("unload_model", (model_name, False), isolated)
            assert not is_model_ready(model_name)
            assert not is_model_ready(ensemble_model_name)


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("ensemble_invalid_negative_limit", "-5", "Expected integer, got: -"),
    ("ensemble_invalid_string_limit", '"invalid_value"', 'Expected integer, got: "invalid_value"'),
    ("ensemble_invalid_large_value_limit", "12345678901", "Integer out of range (12345678901)"),
])  # fmt: skip
def test_upstream_invalid_max_inflight_requests(
    max_queue_repo: Path, tmp_path: Path, name: str, value: str, expected: str
) -> None:
    # L0_simple_ensemble/test.sh, "Test invalid values for 'max_inflight_requests'": the
    # sed into the ensemble's configuration; the load fails with the text its grep expects.
    root = tmp_path / "models"
    for step in ("decoupled_producer", "slow_consumer"):
        shutil.copytree(max_queue_repo / step, root / step)
    config = (BACKPRESSURE_MODELS / "ensemble_disabled_max_inflight_requests" / "config.pbtxt")
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config.read_text().replace(
        "ensemble_scheduling {", f"ensemble_scheduling {{\n  max_inflight_requests: {value}"))
    with ModelRepository(root) as repo, pytest.raises(ModelLoadError) as info:
        repo.load(name)
    assert expected in str(info.value)


# -- qa/L0_model_config: autofill_noplatform_success/python (compare_status.py) ---------------
PYTHON_SUCCESS = (
    UPSTREAM / "server" / "qa" / "L0_model_config" / "autofill_noplatform_success" / "python"
)
# test.sh copies qa/python_models/auto_complete/model.py into these; the others carry their own.
AUTO_COMPLETE_MODEL = ("incomplete_output", "unknown_input", "unknown_output", "empty_config")


def _lay_out_success(target: str, root: Path) -> Path:
    """test.sh's copies: a model's model.py (or auto_complete's) into its version folder;
    a folder of models (an ensemble and its steps) is the repository."""
    shutil.copytree(PYTHON_SUCCESS / target, root / target)
    if (root / target / "config.pbtxt").is_file():
        (root / target / "1").mkdir()
        own = PYTHON_MODELS / "auto_complete" if target in AUTO_COMPLETE_MODEL else root / target
        shutil.copy(own / "model.py", root / target / "1" / "model.py")
        return root
    for folder in (root / target).iterdir():
        (folder / "1").mkdir()
        shutil.copy(folder / "model.py", folder / "1" / "model.py")
    return root / target


def _as_cpu_server(config: Any) -> Any:
    """A GPU server's expected configuration as a server without GPUs completes it: the
    default instance group ``KIND_CPU`` without ``gpus`` (everything else unchanged)."""
    for group in config.instance_group:
        group.kind = group.DESCRIPTOR.enum_types_by_name["Kind"].values_by_name["KIND_CPU"].number
        del group.gpus[:]
    return config


@pytest.mark.parametrize("target", sorted(p.name for p in PYTHON_SUCCESS.iterdir()))
def test_l0_model_config_python_successes(tmp_path: Path, target: str) -> None:
    # compare_status.py: the loaded configuration equals one of the expected files. All but
    # conflicting_scheduler_ensemble expect a GPU server's default instance group (KIND_GPU,
    # gpus: 0): compared here with that group as a server without GPUs completes it (its
    # name, <model>, and count as expected).
    from google.protobuf import text_format

    from pb_tensor.runtime import _schema

    root = _lay_out_success(target, tmp_path)
    with ModelRepository(root) as repo:
        model = repo.load(target, isolated=False)
        got = _schema.config_from_dict(model.config, where=target)
        expecteds = sorted((root / target).glob("expected*"))
        assert expecteds
        parsed = [text_format.Parse(e.read_text(), _schema.new_config()) for e in expecteds]
        assert any(_as_cpu_server(e) == got for e in parsed), model.config
