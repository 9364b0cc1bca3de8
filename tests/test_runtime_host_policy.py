"""Host policies (tritonserver's ``--host-policy=<name>,cpu-cores=<lower>-<upper>``): a stub
runs on the CPUs of its instance's policy (the group's ``host_policy``, else ``cpu``,
``gpu_<device>`` or ``model`` by its kind), bound before ``initialize``, with Triton's errors
for malformed policies; in-process instances are not bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_support import needs_serve

from pb_tensor.runtime import ModelLoadError, ModelRepository

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"),
    reason="CPU binding needs Linux's sched_setaffinity",
)

REPO_ROOT = Path(__file__).resolve().parents[1]

# The model reports the CPUs it runs on in initialize (bound before it, as in Triton) and in
# execute, from a thread it starts itself (threads inherit the binding).
_MODEL = """
import os, threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.at_init = sorted(os.sched_getaffinity(0))

    def execute(self, requests):
        seen = []
        t = threading.Thread(target=lambda: seen.extend(sorted(os.sched_getaffinity(0))))
        t.start()
        t.join()
        out = np.array(self.at_init + [-1] + seen, dtype=np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("CPUS", out)])
                for _ in requests]
"""


def _repository(root: Path, group: str = "") -> Path:
    model = root / "where"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(_MODEL)
    (model / "config.pbtxt").write_text(textwrap.dedent(f"""
        backend: "python"
        input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "CPUS" data_type: TYPE_INT64 dims: [ -1 ] }} ]
        {group}
    """))
    return root


def _cpus_seen(model: Any) -> tuple[list[int], list[int]]:
    cpus = [int(c) for c in model.infer({"IN": np.ones(1, np.float32)})["CPUS"]]
    split = cpus.index(-1)
    return cpus[:split], cpus[split + 1 :]


def _stub_threads_cpus(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def _one_cpu() -> int:
    # A CPU this process may use, other than the first when there are several.
    return max(os.sched_getaffinity(0))


def test_a_stub_runs_on_the_cpus_of_the_default_cpu_policy(tmp_path: Path) -> None:
    cpu = _one_cpu()
    mine = os.sched_getaffinity(0)
    policies = {"cpu": {"cpu-cores": f"{cpu}-{cpu}"}}
    with ModelRepository(_repository(tmp_path), host_policies=policies) as repo:
        model = repo.load("where", isolated=True)
        assert _cpus_seen(model) == ([cpu], [cpu])
        assert model.pid is not None
        assert _stub_threads_cpus(model.pid) == {frozenset({cpu})}
        assert os.sched_getaffinity(0) == mine  # the caller's threads are left alone


def test_ranges_and_a_group_policy_by_name(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    ranges = ",".join(f"{c}-{c}" for c in mine)
    group = 'instance_group [ { count: 2 kind: KIND_CPU host_policy: "near" } ]'
    # "cpu" would bind to one CPU; the group names "near", which has them all.
    policies = {"near": {"cpu-cores": ranges}, "cpu": {"cpu-cores": f"{mine[0]}-{mine[0]}"}}
    with ModelRepository(_repository(tmp_path, group), host_policies=policies) as repo:
        model = repo.load("where", isolated=True)
        assert _cpus_seen(model) == (mine, mine)


def test_a_policy_nobody_uses_binds_nothing(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    group = "instance_group [ { count: 1 kind: KIND_MODEL } ]"
    # A KIND_MODEL instance uses the policy named "model", not "cpu".
    policies = {"cpu": {"cpu-cores": f"{mine[-1]}-{mine[-1]}"}}
    with ModelRepository(_repository(tmp_path, group), host_policies=policies) as repo:
        assert _cpus_seen(repo.load("where", isolated=True)) == (mine, mine)
    policies = {"model": {"cpu-cores": f"{mine[-1]}-{mine[-1]}"}}
    with ModelRepository(_repository(tmp_path / "again", group),
                         host_policies=policies) as repo:  # fmt: skip
        assert _cpus_seen(repo.load("where", isolated=True)) == ([mine[-1]], [mine[-1]])


def test_in_process_instances_are_not_bound(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    policies = {"cpu": {"cpu-cores": f"{mine[-1]}-{mine[-1]}"}}
    with ModelRepository(_repository(tmp_path), host_policies=policies) as repo:
        assert _cpus_seen(repo.load("where", isolated=False)) == (mine, mine)
    assert sorted(os.sched_getaffinity(0)) == mine


def test_a_restarted_stub_is_bound_again(tmp_path: Path) -> None:
    cpu = _one_cpu()
    with ModelRepository(_repository(tmp_path),
                         host_policies={"cpu": {"cpu-cores": f"{cpu}-{cpu}"}}) as repo:
        model = repo.load("where", isolated=True)
        first = model.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while model.is_ready():  # until the stub is found dead (and reaped)
            assert time.monotonic() < deadline, "the killed stub still looks healthy"
            time.sleep(0.01)
        # The next request starts a new stub, bound like the first.
        assert _cpus_seen(model) == ([cpu], [cpu])
        assert model.pid not in (None, first)


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ({"cpu": {"cpu-count": "1"}},
         "Unsupported host policy setting 'cpu-count' is specified, supported settings are "
         "'numa-node', 'cpu-cores'"),
        ({"cpu": {"cpu-cores": "3"}},
         "host policy setting 'cpu-cores' format is "
         "'<lower_cpu_core_id>-<upper_cpu_core_id>'. Got 3"),
        ({"cpu": {"cpu-cores": "0-1,2"}},
         "host policy setting 'cpu-cores' format is "
         "'<lower_cpu_core_id>-<upper_cpu_core_id>'. Got 2"),
        ({"cpu": {"cpu-cores": "a-3"}}, "Parsing 'cpu-cores' value: Can't parse 'a' to integer"),
        ({"cpu": {"cpu-cores": "0-1x"}},
         "Parsing 'cpu-cores' value: Can't parse '1x' to integer"),
        ({"cpu": {"cpu-cores": "3-1"}}, "Unable to set NUMA thread affinity: Invalid argument"),
        ({"cpu": {"cpu-cores": "0-1000000000"}},
         "Unable to set NUMA thread affinity: Invalid argument"),
        ({"cpu": {"cpu-cores": "-1-2"}}, "Parsing 'cpu-cores' value: Can't parse '' to integer"),
        ({"cpu": {"numa-node": "0"}},
         "host policy 'cpu': setting 'numa-node' is not supported here (no NUMA memory "
         "binding); bind to the node's cores with 'cpu-cores'"),
    ],
)  # fmt: skip
def test_malformed_policies_are_refused_with_tritons_messages(
    tmp_path: Path, policies: dict[str, dict[str, str]], message: str
) -> None:
    with pytest.raises(ModelLoadError) as info:
        ModelRepository(tmp_path, host_policies=policies)
    assert str(info.value) == message


def test_policies_must_be_strings(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="settings and values are strings"):
        ModelRepository(tmp_path, host_policies={"cpu": {"cpu-cores": 1}})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="map a policy name to its settings"):
        ModelRepository(tmp_path, host_policies={"cpu": "0-1"})  # type: ignore[dict-item]


def test_a_cpu_this_machine_lacks_fails_the_load(tmp_path: Path) -> None:
    mine = os.sched_getaffinity(0)
    policies = {"cpu": {"cpu-cores": "60000-60000"}}
    with ModelRepository(_repository(tmp_path), host_policies=policies) as repo:
        with pytest.raises(ModelLoadError) as info:
            repo.load("where", isolated=True)
        assert str(info.value).endswith(
            "Unable to set NUMA thread affinity: Invalid argument")
        # In-process instances are not bound, but their load fails as Triton's would.
        with pytest.raises(ModelLoadError) as info:
            repo.load("where", isolated=False)
        assert str(info.value).endswith(
            "Unable to set NUMA thread affinity: Invalid argument")
    assert sorted(os.sched_getaffinity(0)) == sorted(mine)


def test_serve_takes_tritonservers_host_policy_flag() -> None:
    from pb_tensor.cli import _parser
    from pb_tensor.serve._cli import options_from_args

    args = _parser().parse_args([
        "serve", "--model-repository=a", "--host-policy", "cpu,cpu-cores=0-1",
        "--host-policy=fast,cpu-cores=2-3,5-5", "--host-policy", "cpu,numa-node=0",
    ])  # fmt: skip
    assert options_from_args(args).host_policies == {
        "cpu": {"cpu-cores": "0-1", "numa-node": "0"}, "fast": {"cpu-cores": "2-3,5-5"},
    }
    bad = subprocess.run(
        [sys.executable, "-m", "pb_tensor", "serve", "--model-repository", "a",
         "--host-policy", "cpu"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert ("--host-policy option format is '<policy name>,<setting>=<value>'. Got cpu"
            in bad.stderr)  # fmt: skip


@needs_serve
def test_serve_refuses_a_setting_triton_does_not_know(tmp_path: Path) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "pb_tensor", "serve", "--model-repository", str(tmp_path),
         "--host-policy", "cpu,cpu-count=2", "--http-port", "0", "--grpc-port", "0",
         "--metrics-port", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.strip().endswith(
        "error: creating server: Unsupported host policy setting 'cpu-count' is specified, "
        "supported settings are 'numa-node', 'cpu-cores'")
