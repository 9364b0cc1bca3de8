"""An in-process ensemble's steps get their own copies of their inputs, as Triton copies each
step's inputs into shared memory: a step writing into its input arrays changes nothing that
another step, the caller or the ensemble's response sees. The ensemble copies the caller's
arrays once and hands an input that exactly one step input reads to that step as it is; every
tensor with more than one reader, and every tensor a step made, is copied for each step."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pb_tensor.runtime import ModelRepository

pytest.importorskip("google.protobuf")

HEADER = """
import numpy as np
import triton_python_backend_utils as pb_utils
"""

# OUT = IN + 1, then IN's array is overwritten with 99.
SPOIL = (
    """
    backend: "python"
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
    """
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                result = x + 1
                x[...] = 99
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", result)]))
            return out
    """,
)

# SUM = A + B, B read after A's array was overwritten with 99.
SPOIL2 = (
    """
    backend: "python"
    input [ { name: "A" data_type: TYPE_INT32 dims: [ -1 ] },
            { name: "B" data_type: TYPE_INT32 dims: [ -1 ] } ]
    output [ { name: "SUM" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
    """
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                a = pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
                first = a.copy()
                a[...] = 99
                b = pb_utils.get_input_tensor_by_name(r, "B").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", first + b)]))
            return out
    """,
)

# OUT = the same array every time (a table the model keeps), whatever IN holds.
TABLE = (
    SPOIL[0],
    """
    class TritonPythonModel:
        def initialize(self, args):
            self.table = np.array([10, 20, 30], np.int32)

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", self.table)])
                    for r in requests]
    """,
)


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1{maps} }}'


def ensemble(steps: list[str], outputs: list[str]) -> str:
    out = ", ".join(f'{{ name: "{o}" data_type: TYPE_INT32 dims: [ -1 ] }}' for o in outputs)
    return ('platform: "ensemble"\n'
            'input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
            f"output [ {out} ]\n"
            f"ensemble_scheduling {{ step [ {', '.join(steps)} ] }}\n")  # fmt: skip


MODELS: dict[str, tuple[str, str | None] | str] = {
    "spoil": SPOIL,
    "spoil2": SPOIL2,
    "table": TABLE,
    # IN read by one step only: handed over as the ensemble's own copy.
    "alone": ensemble([step("spoil", {"IN": "IN"}, {"OUT": "OUT"})], ["OUT"]),
    # IN read by two steps; the first (in file and dataflow order) spoils its copy.
    "two_steps": ensemble([step("spoil", {"IN": "IN"}, {"OUT": "s"}),
                           step("spoil2", {"A": "s", "B": "IN"}, {"SUM": "OUT"})],
                          ["OUT"]),
    # IN mapped to both inputs of one step, which spoils A before reading B.
    "twice_in_one": ensemble([step("spoil2", {"A": "IN", "B": "IN"}, {"SUM": "OUT"})],
                             ["OUT"]),
    # t (a step's output) read by two steps and also an output of the ensemble.
    "shared_t": ensemble([step("spoil", {"IN": "IN"}, {"OUT": "t"}),
                          step("spoil", {"IN": "t"}, {"OUT": "u"}),
                          step("spoil2", {"A": "u", "B": "t"}, {"SUM": "OUT"})],
                         ["OUT", "t"]),
    # the table model's output spoiled by the only step reading it.
    "table_fed": ensemble([step("table", {"IN": "IN"}, {"OUT": "t"}),
                           step("spoil", {"IN": "t"}, {"OUT": "OUT"})], ["OUT"]),
}


def _write(root: Path, models: dict[str, str | tuple[str, str]]) -> Path:
    """Each model (a configuration, or a configuration and its model.py) under ``root``."""
    for name, spec in models.items():
        config, code = (spec, None) if isinstance(spec, str) else spec
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
        if code is not None:
            (root / name / "1" / "model.py").write_text(HEADER + textwrap.dedent(code))
    return root


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[ModelRepository]:
    with ModelRepository(_write(tmp_path / "models", MODELS)) as r:
        yield r


def test_the_callers_array_is_not_the_only_readers_input(repo: ModelRepository) -> None:
    given = np.array([1, 2, 3], np.int32)
    got = repo.load("alone", isolated=False).infer({"IN": given})
    np.testing.assert_array_equal(got["OUT"], [2, 3, 4])
    np.testing.assert_array_equal(given, [1, 2, 3])


def test_an_input_read_by_two_steps_is_copied_for_each(repo: ModelRepository) -> None:
    given = np.array([1, 2, 3], np.int32)
    got = repo.load("two_steps", isolated=False).infer({"IN": given})
    # s = IN + 1 from the first step; the second step's B is IN as the caller gave it.
    np.testing.assert_array_equal(got["OUT"], [3, 5, 7])
    np.testing.assert_array_equal(given, [1, 2, 3])


def test_an_input_mapped_to_two_inputs_of_a_step_is_copied_for_each(
    repo: ModelRepository,
) -> None:
    given = np.array([1, 2, 3], np.int32)
    got = repo.load("twice_in_one", isolated=False).infer({"IN": given})
    np.testing.assert_array_equal(got["OUT"], [2, 4, 6])
    np.testing.assert_array_equal(given, [1, 2, 3])


def test_a_step_output_with_several_readers_is_copied_for_each(repo: ModelRepository) -> None:
    got = repo.load("shared_t", isolated=False).infer({"IN": np.array([1, 2], np.int32)})
    # t = IN + 1 = [2, 3]; u = t + 1 = [3, 4]; OUT = u + t, and the response's t is t.
    np.testing.assert_array_equal(got["t"], [2, 3])
    np.testing.assert_array_equal(got["OUT"], [5, 7])


def test_a_step_spoiling_its_input_leaves_the_producers_array(repo: ModelRepository) -> None:
    model = repo.load("table_fed", isolated=False)
    for _ in range(2):
        got = model.infer({"IN": np.array([0], np.int32)})
        np.testing.assert_array_equal(got["OUT"], [11, 21, 31])


def test_with_share_inputs_the_steps_get_the_callers_arrays(tmp_path: Path) -> None:
    # ModelRepository(share_inputs=True) opts out of the copies, for the steps too.
    root = _write(tmp_path / "models", {n: MODELS[n] for n in ("spoil", "alone")})
    given = np.array([1, 2, 3], np.int32)
    with ModelRepository(root, share_inputs=True) as repo:
        got = repo.load("alone", isolated=False).infer({"IN": given})
    np.testing.assert_array_equal(got["OUT"], [2, 3, 4])
    np.testing.assert_array_equal(given, [99, 99, 99])


# OUT is IN through DLPack (a legacy capsule: a read-only import), as qa dlpack_io_identity.
DLPACK_ECHO = (
    """
    backend: "python"
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
    """
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN")
                y = pb_utils.Tensor.from_dlpack("OUT", x.to_dlpack())
                out.append(pb_utils.InferenceResponse([y]))
            return out
    """,
)


def test_with_share_inputs_a_read_only_step_output_reaches_the_next_step_writable(
    tmp_path: Path,
) -> None:
    # Triton hands every step a buffer of its own: the second step exports its input through
    # DLPack and writes into it, though the first one answered with a read-only import.
    root = _write(tmp_path / "models", {
        "echo": DLPACK_ECHO, "spoil": MODELS["spoil"],
        "chain": ensemble([step("echo", {"IN": "IN"}, {"OUT": "t"}),
                           step("echo", {"IN": "t"}, {"OUT": "u"}),
                           step("spoil", {"IN": "u"}, {"OUT": "OUT"})], ["OUT"])})
    with ModelRepository(root, share_inputs=True) as repo:
        got = repo.load("chain", isolated=False).infer({"IN": np.array([1, 2], np.int32)})
    np.testing.assert_array_equal(got["OUT"], [2, 3])


KINDS = (
    """
    backend: "python"
    input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
    """,
    """
    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                kinds = np.array([type(v).__name__.encode() for v in x.flat], dtype=object)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", kinds)]))
            return out
    """,
)


@pytest.mark.parametrize("share_inputs", [False, True])
def test_a_bytes_step_input_arrives_as_bytes(tmp_path: Path, share_inputs: bool) -> None:
    # str values become the bytes Triton's wire form gives, at the first step and at a step
    # fed by another step's BYTES output, with or without the copies.
    root = _write(tmp_path / "models", {
        "kinds": KINDS,
        "strings": ('platform: "ensemble"\n'
                    'input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
                    'output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
                    "ensemble_scheduling { step [ "
                    + step("kinds", {"IN": "IN"}, {"OUT": "k"}) + ", "
                    + step("kinds", {"IN": "k"}, {"OUT": "OUT"}) + " ] }\n"),
    })
    with ModelRepository(root, share_inputs=share_inputs) as repo:
        got = repo.load("strings", isolated=False).infer(
            {"IN": np.array(["a", "b"], dtype=object)})
    assert list(got["OUT"]) == [b"bytes", b"bytes"]
