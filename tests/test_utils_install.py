"""pb_tensor.utils.install(): ``import triton_python_backend_utils`` without writing files."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

import pb_tensor.utils


def test_install_registers_and_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "triton_python_backend_utils", raising=False)
    assert pb_tensor.utils.install() is pb_tensor.utils
    assert pb_tensor.utils.install() is pb_tensor.utils
    import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

    assert pb_utils is pb_tensor.utils
    assert pb_utils.InferenceResponse is pb_tensor.utils.InferenceResponse


def test_install_refuses_to_replace_another_module(monkeypatch: pytest.MonkeyPatch) -> None:
    other = type(sys)("triton_python_backend_utils")
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", other)
    with pytest.raises(RuntimeError) as e:
        pb_tensor.utils.install()
    assert str(e.value) == (
        f"install(): sys.modules['triton_python_backend_utils'] is already {other!r}; "
        "pass replace=True to replace it"
    )
    assert sys.modules["triton_python_backend_utils"] is other
    assert pb_tensor.utils.install(replace=True) is pb_tensor.utils
    assert sys.modules["triton_python_backend_utils"] is pb_tensor.utils


def test_install_writes_nothing(
    run_python: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    first = run_python(
        """
        import pb_tensor.utils
        pb_tensor.utils.install()
        import triton_python_backend_utils as pb_utils
        assert pb_utils is pb_tensor.utils
        print("ok")
        """
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "ok"
    # A fresh interpreter cannot import it: nothing was installed on disk.
    second = run_python(
        """
        try:
            import triton_python_backend_utils
        except ModuleNotFoundError as e:
            print(e.name)
        """
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "triton_python_backend_utils"


def test_import_is_light(run_python: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """Importing pb_tensor.utils pulls neither asyncio (only async_exec needs it) nor CUDA."""
    result = run_python(
        """
        import sys
        import pb_tensor.utils
        print(sorted(m for m in ("asyncio", "pb_tensor.cuda", "pb_tensor.runtime")
                     if m in sys.modules))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
