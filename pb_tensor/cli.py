"""The ``pb-tensor`` / ``python -m pb_tensor`` command line: ``demo``, ``bench``, ``doctor``."""


from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import sys
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["main"]

_DESCRIPTION = (
    "Triton python_backend's pb_utils.Tensor in pure Python. "
    "Without a command, runs the demo."
)

_OK, _FAIL, _SKIP = "ok", "FAILED", "skipped"


class _Table:
    """Rows of (step, status, detail), printed with aligned columns."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.rows: list[tuple[str, str, str]] = []

    def add(self, step: str, status: str, detail: str) -> None:
        self.rows.append((step, status, detail))

    def check(self, step: str, ok: bool, detail: str) -> None:
        self.add(step, _OK if ok else _FAIL, detail)

    def render(self) -> str:
        head = ("step", "result", "what happened")
        rows = [head, *self.rows]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        rule = "-" * (sum(widths) + 4)
        lines = [self.title, rule]
        for i, (s, r, d) in enumerate(rows):
            lines.append(f"{s:<{widths[0]}}  {r:<{widths[1]}}  {d}".rstrip())
            if i == 0:
                lines.append(rule)
        lines.append(rule)
        return "\n".join(lines)

    @property
    def failed(self) -> bool:
        return any(status == _FAIL for _, status, _ in self.rows)


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _aligned_empty(shape: tuple[int, ...], dtype: Any, alignment: int = 64) -> np.ndarray[Any, Any]:
    """A C-contiguous array whose data starts on an ``alignment``-byte boundary."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    out: np.ndarray[Any, Any] = raw[start:start + nbytes].view(dt).reshape(shape)
    return out


def _demo_numpy(table: _Table) -> None:
    from pb_tensor import Tensor

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = Tensor("INPUT0", a)
    table.check("numpy -> Tensor", np.shares_memory(a, t.as_numpy()),
                f"{t!r}; as_numpy() shares the array's memory")
    b = np.from_dlpack(t)
    table.check("Tensor -> np.from_dlpack", np.shares_memory(a, b),
                "numpy imports the tensor without a copy")
    c = np.asfortranarray(a)
    table.check("non-contiguous numpy", not np.shares_memory(c, Tensor("F", c).as_numpy()),
                "a Fortran-ordered array is copied to C order, as Triton does")


def _demo_torch(table: _Table) -> None:
    torch = _optional("torch")
    if torch is None:
        table.add("torch", _SKIP, "torch is not installed (pip install torch).")
        return
    from torch.utils.dlpack import from_dlpack as torch_from_dlpack

    from pb_tensor import Tensor

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = Tensor("INPUT0", a)
    tt = torch_from_dlpack(t)
    table.check("Tensor -> torch", tt.data_ptr() == a.ctypes.data,
                f"torch.from_dlpack(t) shares memory: {tuple(tt.shape)} {tt.dtype}")
    src = torch.arange(4, dtype=torch.int64)
    back = Tensor.from_dlpack("OUTPUT0", src)
    table.check("torch -> Tensor", back.data_ptr == src.data_ptr(),
                f"Tensor.from_dlpack(name, torch_tensor): {back!r}")
    bf = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    tb = Tensor.from_dlpack("BF16", bf)
    again = torch_from_dlpack(tb)
    table.check("BF16 through torch", bool(torch.equal(again, bf)) and
                tb.dtype.wire_name == "BF16",
                f"{tb!r} round-trips to torch unchanged")


def _demo_jax(table: _Table) -> None:
    jax = _optional("jax")
    if jax is None:
        table.add("JAX", _SKIP, "JAX is not installed (pip install jax).")
        return
    import jax.numpy as jnp

    from pb_tensor import Tensor

    a = _aligned_empty((2, 3), np.float32)
    a[...] = np.arange(6).reshape(2, 3)
    j = jnp.from_dlpack(Tensor("INPUT0", a))
    table.check("Tensor -> JAX", j.unsafe_buffer_pointer() == a.ctypes.data,
                "jnp.from_dlpack shares a 64-byte-aligned buffer (JAX copies unaligned ones)")
    src = jnp.arange(4.0)
    back = Tensor.from_dlpack("OUTPUT0", src)
    table.check("JAX -> Tensor", back.data_ptr == src.unsafe_buffer_pointer(),
                f"Tensor.from_dlpack(name, jax_array): {back!r}")


def _demo_bytes(table: _Table) -> None:
    from pb_tensor import Tensor, deserialize_bytes_tensor

    words = np.array([b"hello", "w\u00f6rld", b"nul\x00inside", 42], dtype=object)
    t = Tensor("TEXT", words)
    wire = bytes(t._serialized) if t._serialized is not None else b""
    decoded = deserialize_bytes_tensor(wire)
    expected = [b"hello", "w\u00f6rld".encode(), b"nul\x00inside", b"42"]
    table.check("BYTES round trip", list(decoded) == expected,
                f"{t.byte_size} wire bytes decode to {list(decoded)!r}")


def _demo_errors(table: _Table) -> None:
    from pb_tensor import Tensor, TritonModelException

    try:
        Tensor("", np.zeros(1))
    except TritonModelException as exc:
        table.check("faithful error", str(exc) == "Tensor name cannot be an empty string.",
                    f"Tensor('', arr) -> TritonModelException({str(exc)!r})")
    else:
        table.check("faithful error", False, "no exception raised")
    try:
        Tensor.from_dlpack("x", np.zeros((4, 4))[:, ::2])
    except TritonModelException as exc:
        table.check("strided DLPack refused", "not contiguous" in str(exc),
                    "a strided view Triton would misread is rejected")
    else:
        table.check("strided DLPack refused", False, "no exception raised")


def _demo_gpu(table: _Table) -> None:
    from pb_tensor import cuda

    reason = cuda.unavailable_reason(short=True)
    if reason is None:
        table.add("CUDA", _OK, f"{cuda.device_count()} device(s) available")
    else:
        # A sentence, but a package name keeps its own spelling ("cuda-python ...").
        first = reason if reason.startswith("cuda-python") else reason[0].upper() + reason[1:]
        table.add("CUDA", _SKIP, first + ".")


def _demo() -> int:
    table = _Table("pb-tensor demo: Triton's pb_utils.Tensor in pure Python")
    for part in (_demo_numpy, _demo_torch, _demo_jax, _demo_bytes, _demo_errors, _demo_gpu,
                 _demo_runtime):
        try:
            part(table)
        except Exception as exc:  # a demo row must report, not abort the tour
            table.add(part.__name__.removeprefix("_demo_"), _FAIL,
                      f"raised {type(exc).__name__} (run with python -X dev for details).")
    import dlpack_ctypes

    table.check("no leaks", dlpack_ctypes.live_exports() == 0,
                "every DLPack export was released exactly once")
    sys.stdout.write(table.render() + "\n")
    return 1 if table.failed else 0


def _median_us(fn: Callable[[], object]) -> float:
    number = 1
    while timeit.timeit(fn, number=number) < 0.02:
        number *= 4
    runs = sorted(timeit.repeat(fn, number=number, repeat=7))
    return runs[len(runs) // 2] / number * 1e6


def _bench() -> int:
    from pb_tensor import Tensor

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = Tensor("x", a)
    rows: list[tuple[str, float]] = [
        ("Tensor('x', a)", _median_us(lambda: Tensor("x", a))),
        ("np.from_dlpack(tensor)", _median_us(lambda: np.from_dlpack(t))),
        ("Tensor.from_dlpack('x', a)", _median_us(lambda: Tensor.from_dlpack("x", a))),
        ("np.from_dlpack(a) (numpy alone)", _median_us(lambda: np.from_dlpack(a))),
    ]
    width = max(len(r[0]) for r in rows)
    sys.stdout.write("quick benchmark, (2, 3) float32, median us per call\n")
    for name, us in rows:
        sys.stdout.write(f"{name:<{width}}  {us:8.3f}\n")
    sys.stdout.write("full benchmarks with same-run baselines: python benchmarks/bench_*.py\n")
    return 0


# Distributions to report, by what they are imported as (first installed name wins).
_DISTRIBUTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("numpy", ("numpy",)),
    ("torch", ("torch",)),
    ("jax", ("jax",)),
    ("jaxlib", ("jaxlib",)),
    ("ml_dtypes", ("ml_dtypes", "ml-dtypes")),
    ("cupy", ("cupy", "cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x")),
    ("cuda-python", ("cuda-python", "cuda-bindings")),
)


def _installed_version(names: tuple[str, ...]) -> str:
    # importlib.metadata reads the installed metadata: no framework is imported (torch and JAX
    # take seconds to import).
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _doctor() -> int:
    import dlpack_ctypes
    from pb_tensor import __version__, cuda

    flavour = "free-threaded" if "t" in getattr(sys, "abiflags", "") else "with the GIL"
    lines = [
        f"{'pb-tensor':<13} {__version__}",
        f"{'python':<13} {platform.python_version()} ({sys.implementation.name}, {flavour})",
    ]
    lines += [f"{label:<13} {_installed_version(names)}" for label, names in _DISTRIBUTIONS]
    for name, on in dlpack_ctypes.fast_paths().items():
        lines.append(f"{'fast path':<13} {name.replace('_', ' ')}: {'on' if on else 'off'}")
    reason = cuda.unavailable_reason()
    lines.append(f"{'CUDA':<13} {'available' if reason is None else reason}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _demo_runtime(table: _Table) -> None:
    try:
        from pb_tensor.runtime._cli import demo_rows

        rows = demo_rows()
    except ImportError:
        from pb_tensor._hints import install_hint

        table.add("model runtime", _SKIP,
                  f"protobuf is not installed ({install_hint('runtime', 'protobuf')}).")
        return
    except FileNotFoundError:
        table.add("model runtime", _SKIP,
                  "the example model repository is not here (run from a clone).")
        return
    for step, ok, detail in rows:
        table.check(step, ok, detail)


def _parser() -> argparse.ArgumentParser:
    from pb_tensor import __version__
    from pb_tensor.runtime._cli import add_subcommands

    parser = argparse.ArgumentParser(prog="pb-tensor", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"pb-tensor {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("demo", help="a guided tour printed as a table (the default)",
                        description="A guided tour printed as a table; exit status 1 if a row "
                                    "failed.")
    bench = commands.add_parser("bench", help="quick timings of the common calls",
                                description="Quick timings; the benchmarks/ scripts measure "
                                            "baselines in the same run.")
    # The benchmarks/ scripts take --quick; this command is always quick and accepts it too.
    bench.add_argument("--quick", action="store_true", help="accepted; bench is always quick")
    commands.add_parser("doctor", help="versions, fast paths and CUDA on this machine",
                        description="Versions, fast paths and CUDA availability on this "
                                    "machine; imports no framework.")
    add_subcommands(commands)
    from pb_tensor.serve._cli import add_arguments

    serve = commands.add_parser(
        "serve", help="Triton's HTTP / gRPC / metrics server for a model repository",
        description="Serve a Triton model repository with Triton's HTTP, gRPC and metrics "
                    "protocol (tritonserver's flag names; needs the serve extra).",
    )  # fmt: skip
    add_arguments(serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (argparse exits with 2 on bad arguments)."""
    args = _parser().parse_args(argv)
    if args.command in ("run", "check"):
        from pb_tensor.runtime._cli import run_command

        return run_command(args)
    if args.command == "serve":
        from pb_tensor.serve._cli import main as serve_main

        return serve_main(args)
    handlers: dict[str | None, Callable[[], int]] = {
        None: _demo, "demo": _demo, "bench": _bench, "doctor": _doctor,
    }
    return handlers[args.command]()
