"""The runtime as a user meets it (issue 21, and issue 18's log levels after load): each test
runs the command or the API as a user would and checks the text the user sees."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from upstream_models import PYTHON_MODELS, repository

import pb_tensor
from pb_tensor.cli import main as cli_main
from pb_tensor.runtime import InferenceError, ModelLoadError, ModelRepository

REPO_ROOT = Path(pb_tensor.__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples" / "model_repository"
TIMEOUT = 180

_LOUD = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        print("hello from initialize")
        pb_utils.Logger.log_warn("careful")
        pb_utils.Logger.log_verbose("details")

    def execute(self, requests):
        print("executing")
        raise ValueError("bad input")
"""
_LOUD_CONFIG = """\
backend: "python"
max_batch_size: 4
input [
  { name: "X", data_type: TYPE_FP32, dims: [-1, 3] },
  { name: "S", data_type: TYPE_STRING, dims: [1] },
  { name: "O", data_type: TYPE_INT32, dims: [1], optional: true }
]
output [{ name: "Y", data_type: TYPE_FP32, dims: [-1] }]
"""
_CRASH = (
    "import os\n\n\nclass TritonPythonModel:\n    def execute(self, requests):\n"
    "        os._exit(3)\n"
)


def _cli(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT, env=env,
        cwd=cwd, check=False,
    )  # fmt: skip


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """add_sub, bls_add_sub and decoupled_repeat (examples), a model that prints, logs and
    raises, and one whose stub exits with code 3."""
    root = tmp_path / "repo"
    for name in ("add_sub", "bls_add_sub", "decoupled_repeat"):
        shutil.copytree(EXAMPLES / name, root / name)
    (root / "loud" / "1").mkdir(parents=True)
    (root / "loud" / "1" / "model.py").write_text(_LOUD)
    (root / "loud" / "config.pbtxt").write_text(_LOUD_CONFIG)
    (root / "crash" / "1").mkdir(parents=True)
    (root / "crash" / "1" / "model.py").write_text(_CRASH)
    return root


def test_run_prints_an_execute_error_once(repo: Path) -> None:
    """Item 1: the CLI prints the error once; the API leaves printing to the caller."""
    r = _cli("-m", "pb_tensor", "run", str(repo), "loud", "-i", "X=[[[1, 2, 3]]]",
             "-i", 'S=[["a"]]')  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.count("ValueError: bad input") == 1, r.stderr
    # The traceback holds the model's frames only, as Triton's (whose stub is C++).
    assert r.stderr == (
        "WARNING model 'loud' (model.py:8): careful\n"
        "error: Failed to process the request(s) for model 'loud_0', message: ValueError: "
        f"bad input\n\nAt:\n  {repo / 'loud' / '1' / 'model.py'}(13): execute\n\n"
    ), r.stderr
    code = f"""
        import numpy as np
        from pb_tensor.runtime import InferenceError, ModelRepository
        with ModelRepository({str(repo)!r}) as repo, repo.load("loud") as model:
            try:
                model.infer({{"X": np.ones((1, 1, 3), np.float32), "S": [["a"]]}})
            except InferenceError as exc:
                print("caught", type(exc).__name__)
    """
    r = _cli("-c", textwrap.dedent(code))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "hello from initialize\nexecuting\ncaught InferenceError\n"
    assert r.stderr == ""  # no last-resort handler printing the runtime's records


def test_input_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 2: what --input says for a missing file, a pickled BYTES array, text sent to an
    FP32 input, and numbers sent to a BYTES input (they become its strings)."""
    words = tmp_path / "words.npy"
    np.save(words, np.array([b"a"], dtype=object), allow_pickle=True)
    missing = tmp_path / "nofile.npy"
    cases = [
        (["add_sub", "-i", f"INPUT0={missing}"], f"no such file '{missing}'"),
        (["string_identity", "-i", f"INPUT0={words}"],
         "the file holds an object array, which .npy stores as a pickle (never loaded here); "
         "save BYTES as a fixed-width array (np.save(path, np.array(values, dtype='S'))) or "
         "pass JSON strings (INPUT0='[\"a\", \"b\"]')"),
        (["add_sub", "-i", 'INPUT0=["a"]'],
         "input 'INPUT0' is TYPE_FP32 in the model configuration: could not convert string to "
         "float: 'a'"),
    ]  # fmt: skip
    for args, message in cases:
        status = cli_main(["run", str(EXAMPLES), "--in-process", *args])
        err = capsys.readouterr().err
        assert status == 2, err
        assert err.splitlines()[-1] == f"error: --input {args[-1]!r}: {message}"
    assert cli_main(["run", str(EXAMPLES), "--in-process", "string_identity",
                     "-i", "INPUT0=[1, 2]"]) == 0  # fmt: skip
    assert capsys.readouterr().out == "OUTPUT0  BYTES  [2]  ['1', '2']\n"


def test_layout_hints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 3: model.py directly in the model folder; check pointed at a model folder."""
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "config.pbtxt").write_text('backend: "python"\n')
    (flat / "model.py").write_text("class TritonPythonModel:\n    pass\n")
    with ModelRepository(tmp_path) as repo, pytest.raises(ModelLoadError) as info:
        repo.load("flat")
    assert str(info.value) == (
        "failed to load model 'flat': at least one version must be available under the "
        "version policy of model 'flat' (model.py is in the model folder; Triton's layout is "
        f"<model>/<version>/model.py: move it to '{flat / '1' / 'model.py'}')"
    )
    assert cli_main(["check", str(EXAMPLES / "add_sub")]) == 1
    assert capsys.readouterr().out == (
        f"no models in {EXAMPLES / 'add_sub'}: it looks like a model folder; pass the "
        f"repository that holds it ({EXAMPLES})\n"
    )


def test_load_errors(tmp_path: Path, repo: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Item 4: a SyntaxError shows file, line and caret; a crashed stub its exit code or the
    signal that killed it."""
    (tmp_path / "syn" / "1").mkdir(parents=True)
    path = tmp_path / "syn" / "1" / "model.py"
    path.write_text("x = 1\ndef f(:\n    pass\n")
    with ModelRepository(tmp_path) as r, pytest.raises(ModelLoadError) as info:
        r.load("syn", isolated=False)
    assert str(info.value) == (
        f"failed to load model 'syn' version 1 ({path}): SyntaxError: invalid syntax "
        f"(model.py, line 2)\n\n  File \"{path}\", line 2\n    def f(:\n          ^"
    )
    with ModelRepository(repo) as r, r.load("crash") as model, \
            pytest.raises(InferenceError) as failed:
        model.infer({})
    assert str(failed.value) == (
        "Failed to process the request(s) for model instance 'crash_0', message: Stub "
        "process 'crash_0' is not healthy. It exited with code 3."
    )
    with ModelRepository(repo) as r, r.load("crash") as model:
        pid = model.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with caplog.at_level(logging.DEBUG, logger="pb_tensor.runtime"):
            while model.is_ready():  # (bounded: until the killed stub is reaped)
                assert time.monotonic() < deadline, "the killed stub still looks healthy"
                time.sleep(0.01)
    # core's verbose line, with python_backend's text and how the stub ended
    assert caplog.messages[-1] == (
        "Model 'crash' version 1 is not ready: Stub process 'crash_0' is not healthy. "
        "It was killed by signal 9 (SIGKILL)."
    )


def test_check_smoke(repo: Path) -> None:
    """Items 5 and 6: one request per model from its configuration, progress rows, each
    model's output (its stub's prints and log records) under its failing row, exit 1."""
    r = _cli("-m", "pb_tensor", "check", "--smoke", str(repo),
             "-i", "add_sub:INPUT0=[1, 2, 3]", "-i", "add_sub:INPUT1=[1, 1, 1]")  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    # Nothing outside the table: add_sub's finalize record (as bls_add_sub's BLS target) is
    # captured with bls_add_sub's row.
    assert r.stderr == ""
    # Times vary: replace them before comparing.
    out = re.sub(r"\(\d+\.\d s\)", "(T)", r.stdout).splitlines()
    path = repo / "loud" / "1" / "model.py"
    assert out[:5] == [
        "[1/5] add_sub           ok      (T) outputs OUTPUT0 [3], OUTPUT1 [3]",
        "[2/5] bls_add_sub       ok      (T) outputs OUTPUT0 [1], OUTPUT1 [1]",
        "[3/5] crash             FAILED  (T) Failed to process the request(s) for model "
        "instance 'crash_0', message: Stub process 'crash_0' is not healthy. It exited "
        "with code 3.",
        "[4/5] decoupled_repeat  ok      (T) 1 response(s)",
        "[5/5] loud              FAILED  (T) Failed to process the request(s) for model "
        "'loud_0', message: ValueError: bad input",
    ]
    assert " " * 26 + f"{path}(13): execute" in out
    at = out.index(" " * 24 + "the model's output:")
    assert out[at + 1:at + 4] == [
        "                          hello from initialize",
        "                          WARNING model 'loud' (model.py:8): careful",
        "                          executing",
    ]
    assert out[-1] == "5 model(s), 2 with problems"
    r = _cli("-m", "pb_tensor", "check", "--smoke", str(repo), "-i", "add_sub=1")
    assert (r.returncode, r.stderr) == (2, "error: --input 'add_sub=1': expected "
                                           "MODEL:NAME=VALUE\n")


@pytest.mark.parametrize(("flags", "shown", "hidden"), [
    ([], ["WARNING model 'loud' (model.py:8): careful"], ["VERBOSE"]),
    (["-v"], ["WARNING model 'loud' (model.py:8): careful",
              "VERBOSE model 'loud' (model.py:9): details"], []),
    (["--log-level", "error"], [], ["careful", "details"]),
])  # fmt: skip
def test_log_levels(repo: Path, flags: list[str], shown: list[str], hidden: list[str]) -> None:
    """Item 6: pb_utils.Logger records on the command line at the level asked for."""
    r = _cli("-m", "pb_tensor", "run", str(repo), "loud", "--in-process", *flags,
             "-i", "X=[[[1, 2, 3]]]", "-i", 'S=[["a"]]')  # fmt: skip
    lines = r.stderr.splitlines()
    assert r.stderr.count("error: Failed to process the request(s)") == 1, r.stderr
    for line in shown:
        assert line in lines
    for word in hidden:
        assert word not in r.stderr


def test_pytest_fixture(tmp_path: Path) -> None:
    """Item 7: a relative path is taken from the test file's folder; a failing model test
    shows the test's line and the model's traceback, not the runtime's frames; captured log
    lines name the model's file and line; repr never raises."""
    tests = tmp_path / "tests"
    (tests / "models" / "loud" / "1").mkdir(parents=True)
    (tests / "models" / "loud" / "1" / "model.py").write_text(_LOUD)
    (tests / "models" / "loud" / "config.pbtxt").write_text(_LOUD_CONFIG)
    (tests / "test_user.py").write_text(textwrap.dedent("""
        import numpy as np

        def test_loud(triton_repository):
            model = triton_repository("models").load("loud")
            model.infer({"X": np.ones((1, 1, 3), np.float32), "S": [["a"]]})
    """))
    installed = any(ep.value == "pb_tensor.runtime.pytest_plugin"
                    for ep in metadata.entry_points(group="pytest11"))  # fmt: skip
    plugin = [] if installed else ["-p", "pb_tensor.runtime.pytest_plugin"]
    r = _cli("-m", "pytest", "-p", "no:cacheprovider", *plugin, "tests/test_user.py",
             cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert '>       model.infer({"X": np.ones((1, 1, 3), np.float32), "S": [["a"]]})' in out
    assert "E       pb_tensor.runtime._errors.InferenceError: Failed to process the request(s)" \
        " for model 'loud_0', message: ValueError: bad input" in out
    assert f"E         {tests / 'models' / 'loud' / '1' / 'model.py'}(13): execute" in out
    assert "def infer(" not in out
    assert "_model.py" not in out
    assert "WARNING  pb_tensor.runtime.model.loud:model.py:8 careful" in out
    assert "ERROR    pb_tensor.runtime:model.py:13 Failed to process the request(s)" in out
    half_built = ModelRepository.__new__(ModelRepository)
    assert repr(half_built) == "<ModelRepository None, 0 loaded>"


@pytest.mark.parametrize("clone", [True, False])
def test_install_hints(tmp_path: Path, clone: bool) -> None:
    """Item 8: run from a clone (pyproject.toml of pb-tensor beside the package), the hint
    names the clone's extra; installed from a wheel, the packages themselves."""
    (tmp_path / "pb_tensor").mkdir()
    shutil.copy(REPO_ROOT / "pb_tensor" / "_hints.py", tmp_path / "pb_tensor")
    if clone:
        (tmp_path / "pyproject.toml").write_text('[project]\nname = "pb-tensor"\n')
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('h', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(m.install_hint('runtime', 'protobuf'))\n")  # fmt: skip
    r = _cli("-c", code, str(tmp_path / "pb_tensor" / "_hints.py"))
    expected = f'pip install -e ".[runtime]" (in {tmp_path})' if clone else "pip install protobuf"
    assert (r.returncode, r.stdout) == (0, expected + "\n"), r.stderr


def test_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """Item 9: the benchmarks' --quick flag is accepted by the command's bench."""
    assert cli_main(["bench", "--quick"]) == 0
    assert capsys.readouterr().out.startswith("quick benchmark, (2, 3) float32")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def collected() -> Iterator[_Collect]:
    logger = logging.getLogger("pb_tensor.runtime")
    handler, level = _Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize(("subtest", "verbose"), [("default", 0), ("verbose", 3)])
@pytest.mark.parametrize("isolated", [True, False])
def test_log_level_raised_after_load(
    tmp_path: Path, collected: _Collect, isolated: bool, subtest: str, verbose: int
) -> None:
    """Issue 18 item 14, qa L0_backend_python/logging: identity_fp32_logging loaded, then (in
    the "verbose" subtest) verbose logging turned on while it is loaded; one request of
    logging_test.py; then the server stops. Upstream counts 4 of each other message and 0 / 3
    verbose ones (execute's two, finalize's; initialize ran before the change)."""
    path = repository(tmp_path, {"identity_fp32_logging":
                                 PYTHON_MODELS / "identity_fp32_logging"})  # fmt: skip
    with ModelRepository(path) as repo:
        model = repo.load("identity_fp32_logging", isolated=isolated)
        if subtest == "verbose":
            logging.getLogger("pb_tensor.runtime").setLevel(logging.DEBUG)
        data = np.array([[1.0]], dtype=np.float32)
        assert np.array_equal(model.infer({"INPUT0": data})["OUTPUT0"], data)
    counts = {word: sum(word in m for m in collected.messages)
              for word in ("Specific", "Info", "Warning", "Error", "Verbose")}  # fmt: skip
    assert counts == {"Specific": 4, "Info": 4, "Warning": 4, "Error": 4, "Verbose": verbose}
