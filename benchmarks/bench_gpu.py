"""GPU latency of pb_tensor's Tensor against PyTorch doing the same, measured in the same run.

Run from the repository root on a machine with a CUDA device and torch (CuPy optional)::

    python benchmarks/bench_gpu.py            # ~20 s
    python benchmarks/bench_gpu.py --quick    # ~5 s

Cases (ours vs the torch baseline):
  import     Tensor.from_dlpack(name, x) of a torch CUDA tensor: scope to its device, proxy
             stream, producer's __dlpack__(stream=proxy), host sync on the proxy stream
             vs torch.from_dlpack(x) (torch's own consumer: stream wait, no host sync)
  capsule    Tensor.from_dlpack(name, to_dlpack(x)) (no CUDA call) vs torch.from_dlpack(capsule)
  export     torch.from_dlpack(tensor) vs torch.from_dlpack(x)
  to_host    tensor.to_host() vs x.cpu(), at 4 KiB and 4 MiB
  (cupy)     Tensor.from_dlpack(name, cupy array) vs cupy.from_dlpack(cupy array), if installed

Method: each statement is a ``timeit`` loop calibrated with ``autorange`` (scaled to about
``--target`` seconds per sample); cases are sampled in interleaved rounds so noise hits them
alike; the table shows median microseconds per call and ours/baseline ratios of those medians.
Without a GPU (or torch with CUDA) it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
import timeit
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pb_tensor import Tensor, cuda


def _optional(name: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except Exception:
            return None


@dataclass
class Case:
    name: str
    ours: Callable[[], object]
    baseline: Callable[[], object]
    baseline_name: str
    number: int = 0
    samples: dict[str, list[float]] = field(default_factory=lambda: {"ours": [], "base": []})


def calibrate(fn: Callable[[], object], target: float) -> int:
    timer = timeit.Timer(fn)
    number, elapsed = timer.autorange()  # at least 0.2 s
    return max(1, int(number * target / max(elapsed, 1e-9)))


def sample(case: Case) -> None:
    for key, fn in (("ours", case.ours), ("base", case.baseline)):
        elapsed = timeit.Timer(fn).timeit(case.number)
        case.samples[key].append(elapsed / case.number * 1e6)


def build_cases(torch: Any, cupy: Any) -> list[Case]:
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(256, dtype=torch.float32, device=device)
    pb = Tensor.from_dlpack("x", x)
    small = torch.ones(1024, dtype=torch.float32, device=device)  # 4 KiB
    big = torch.ones(1 << 20, dtype=torch.float32, device=device)  # 4 MiB
    pb_small = Tensor.from_dlpack("small", small)
    pb_big = Tensor.from_dlpack("big", big)
    to_dlpack = torch.utils.dlpack.to_dlpack
    cases = [
        Case("import (protocol)", lambda: Tensor.from_dlpack("x", x),
             lambda: torch.from_dlpack(x), "torch.from_dlpack(x)"),
        Case("import (capsule)", lambda: Tensor.from_dlpack("x", to_dlpack(x)),
             lambda: torch.from_dlpack(to_dlpack(x)), "torch.from_dlpack(capsule)"),
        Case("export to torch", lambda: torch.from_dlpack(pb),
             lambda: torch.from_dlpack(x), "torch.from_dlpack(x)"),
        Case("to_host 4 KiB", pb_small.to_host, small.cpu, "x.cpu()"),
        Case("to_host 4 MiB", pb_big.to_host, big.cpu, "x.cpu()"),
    ]  # fmt: skip
    if cupy is not None:
        with cupy.cuda.Device(device.index):
            a = cupy.ones(256, dtype=cupy.float32)
        cases.append(
            Case("import cupy (protocol)", lambda: Tensor.from_dlpack("a", a),
                 lambda: cupy.from_dlpack(a), "cupy.from_dlpack(a)")
        )  # fmt: skip
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter samples")
    parser.add_argument("--repeat", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--target", type=float, default=None, help="seconds per sample")
    args = parser.parse_args(argv)
    repeat = args.repeat or (5 if args.quick else 15)
    target = args.target or (0.02 if args.quick else 0.05)

    reason = cuda.unavailable_reason()
    if reason is not None:
        print(f"bench_gpu: no GPU: {reason}; nothing measured")
        return 0
    torch = _optional("torch")
    if torch is None or not torch.cuda.is_available():
        print("bench_gpu: torch with CUDA is not installed; nothing measured")
        return 0
    cupy = _optional("cupy")

    print(
        f"bench_gpu: {torch.cuda.get_device_name()} | torch {torch.__version__}"
        + (f" | cupy {cupy.__version__}" if cupy is not None else "")
        + f" | Python {sys.version.split()[0]} | repeat={repeat} target={target}s"
    )
    cases = build_cases(torch, cupy)
    for case in cases:
        case.ours()
        case.baseline()  # warm up (proxy stream, contexts, caches)
        case.number = calibrate(case.ours, target)
    torch.cuda.synchronize()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for case in cases:
                sample(case)
    finally:
        if gc_was_enabled:
            gc.enable()

    header = f"{'case':<24} {'ours us':>9} {'baseline us':>12} {'ratio':>7}  baseline"
    print(header)
    print("-" * len(header))
    for case in cases:
        ours = statistics.median(case.samples["ours"])
        base = statistics.median(case.samples["base"])
        print(f"{case.name:<24} {ours:9.2f} {base:12.2f} {ours / base:7.2f}  {case.baseline_name}")
    print("ratio = ours / baseline (medians of this run); < 1 means faster than the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
