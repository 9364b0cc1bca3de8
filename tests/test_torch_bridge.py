"""``Tensor.from_dlpack(name, torch_tensor)`` through torch's own numpy bridge.

A plain CPU ``torch.Tensor`` is imported with ``Tensor.numpy()`` (one C call, the same memory
DLPack would give, and a storage kept alive even if the torch tensor is later ``set_()``
elsewhere). Everything the bridge declines goes through DLPack, so values, dtypes and errors are
those of the DLPack import: each case here is compared with the DLPack path itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

import pb_tensor.tensor as tensor_module
from pb_tensor import MemoryType, Tensor, TritonDtype
from pb_tensor.errors import TritonBufferError, TritonModelException

torch = pytest.importorskip("torch")


@pytest.fixture
def bridge_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the bridge returned for each call (None: declined)."""
    Tensor.from_dlpack("warm", torch.zeros(1))  # binds torch.Tensor on first sight
    assert tensor_module._TorchTensor is torch.Tensor
    calls: list[Any] = []
    real = tensor_module._torch_array

    def spy(t: Any) -> Any:
        result = real(t)
        calls.append(result)
        return result

    monkeypatch.setattr(tensor_module, "_torch_array", spy)
    return calls


@pytest.fixture
def dlpack_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """from_dlpack without the bridge: what DLPack alone makes of a torch tensor."""
    monkeypatch.setattr(tensor_module, "_torch_array", lambda t: None)


def _describe(fn: Any) -> Any:
    try:
        t = fn()
    except (TritonModelException, TritonBufferError) as exc:
        return (type(exc), str(exc))
    view = t.as_numpy() if t.triton_dtype() != TritonDtype.TYPE_BF16 else None
    values = None if view is None else (view.dtype, view.tolist(), view.flags.writeable)
    return (t.name(), t.triton_dtype(), t.shape(), t.memory_type, t.data_ptr, values)


def test_plain_cpu_tensor_shares_memory(bridge_calls: list[Any]) -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    x = Tensor.from_dlpack("x", t)
    assert len(bridge_calls) == 1
    assert bridge_calls[0] is not None
    assert (x.triton_dtype(), x.shape(), x.memory_type) == (TritonDtype.TYPE_FP32, [2, 3],
                                                                MemoryType.CPU)  # fmt: skip
    assert x.data_ptr == t.data_ptr()
    view = x.as_numpy()
    view[1, 2] = 42.0
    assert t[1, 2].item() == 42.0
    back = torch.from_dlpack(x)
    assert back.data_ptr() == t.data_ptr()


DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
          "uint16", "uint32", "uint64"]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_numpy_dtype_matches_dlpack(
    dtype: str, bridge_calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    t = torch.ones((2, 3), dtype=getattr(torch, dtype))
    got = _describe(lambda: Tensor.from_dlpack("x", t))
    monkeypatch.setattr(tensor_module, "_torch_array", lambda t: None)
    assert got == _describe(lambda: Tensor.from_dlpack("x", t))


DECLINED = {
    "requires_grad": lambda: torch.ones(2, requires_grad=True),
    "bfloat16": lambda: torch.ones(2, 3, dtype=torch.bfloat16),
    "complex": lambda: torch.ones(2, dtype=torch.complex64),
    "conjugate bit": lambda: torch.ones(2, dtype=torch.complex64).conj(),
    "negative bit": lambda: torch.ones(2, dtype=torch.complex64).conj().imag,
    "sparse": lambda: torch.ones(2, 2).to_sparse(),
    "meta": lambda: torch.ones(2, device="meta"),
    "not contiguous": lambda: torch.arange(12.0).reshape(3, 4).t(),
    "0-d": lambda: torch.tensor(3.5),
    "empty": lambda: torch.empty((0, 3)),
    "parameter (a subclass)": lambda: torch.nn.Parameter(torch.ones(2), requires_grad=False),
}


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_same_result_as_dlpack(
    case: str, bridge_calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    t = DECLINED[case]()
    got = _describe(lambda: Tensor.from_dlpack("x", t))
    monkeypatch.setattr(tensor_module, "_torch_array", lambda t: None)
    assert got == _describe(lambda: Tensor.from_dlpack("x", t))


def test_declines_what_dlpack_must_decide(bridge_calls: list[Any]) -> None:
    for case in ("requires_grad", "bfloat16", "complex", "conjugate bit", "negative bit",
                 "sparse", "meta"):  # fmt: skip
        t = DECLINED[case]()
        bridge_calls.clear()
        with contextlib.suppress(TritonModelException, TritonBufferError):
            Tensor.from_dlpack("x", t)
        assert bridge_calls == [None], case


def test_storage_outlives_set(run_python: Any) -> None:
    # The view's base is an alias of the torch tensor: moving the tensor to other memory does
    # not free what the Tensor reads (a DLPack import is left with freed memory there, numpy's
    # np.from_dlpack included; in a subprocess, as that would crash).
    result = run_python(
        """
        import gc
        import torch
        from pb_tensor import Tensor
        Tensor.from_dlpack("warm", torch.zeros(1))
        t = torch.arange(1 << 20, dtype=torch.float32)
        x = Tensor.from_dlpack("x", t)
        t.set_(torch.zeros(5))
        del t
        gc.collect()
        noise = [torch.full((1 << 20,), 7.0) for _ in range(16)]
        view = x.as_numpy()
        assert view[0] == 0.0 and view[-1] == (1 << 20) - 1, view[:4]
        print("ok")
        """,
        warnings_as_errors=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


def test_first_import_binds_torch(run_python: Any) -> None:
    result = run_python(
        """
        import pb_tensor.tensor as m
        from pb_tensor import Tensor
        import torch
        assert m._TorchTensor is not torch.Tensor
        t = torch.arange(4, dtype=torch.int32)
        assert Tensor.from_dlpack("x", t).data_ptr == t.data_ptr()  # through DLPack
        assert m._TorchTensor is torch.Tensor
        assert Tensor.from_dlpack("x", t).data_ptr == t.data_ptr()  # through the bridge
        print("ok")
        """,
        warnings_as_errors=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


def test_torch_imported_after_other_producers(run_python: Any) -> None:
    # Imports of other producers before torch exists bind nothing (and do not import torch);
    # the first torch tensor after torch is imported binds the bridge.
    result = run_python(
        """
        import sys
        import numpy as np
        import pb_tensor.tensor as m
        from pb_tensor import Tensor
        from pb_tensor._tensor_import import bind_torch

        class Producer:
            def __init__(self, a): self.a = a
            def __dlpack__(self, **kw): return self.a.__dlpack__(**kw)
            def __dlpack_device__(self): return self.a.__dlpack_device__()

        for _ in range(3):
            assert Tensor.from_dlpack("p", Producer(np.arange(3.0))).as_numpy().tolist() == [
                0.0, 1.0, 2.0]
        assert "torch" not in sys.modules and bind_torch() is None
        assert m._TorchTensor is m._Unbound
        import torch
        t = torch.arange(4, dtype=torch.int32)
        assert Tensor.from_dlpack("x", t).data_ptr == t.data_ptr()
        assert m._TorchTensor is torch.Tensor
        print("ok")
        """,
        warnings_as_errors=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


def test_bound_without_an_exchange_table(run_python: Any) -> None:
    # A torch without __dlpack_c_exchange_api__ takes the Python protocol, and still gets the
    # bridge from its second import on.
    result = run_python(
        """
        import pb_tensor.tensor as m
        from dlpack_ctypes import exchange
        from pb_tensor import Tensor
        import torch
        exchange._BY_TYPE[torch.Tensor] = None
        t = torch.arange(4, dtype=torch.int32)
        assert Tensor.from_dlpack("x", t).data_ptr == t.data_ptr()  # through __dlpack__
        assert m._TorchTensor is torch.Tensor
        print("ok")
        """,
        warnings_as_errors=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


def test_numpy_arrays_never_touch_torch(bridge_calls: list[Any]) -> None:
    a = np.arange(3, dtype=np.float32)
    assert Tensor.from_dlpack("x", a).as_numpy().ctypes.data == a.ctypes.data
    assert bridge_calls == []
