"""Functions that load their module on first call (shared by the Tensor's modules).

A Tensor made from a numpy array needs neither shared memory, nor pickling, nor the BYTES codec,
so the Tensor's modules do not import them. Each such function is a module global that starts as
the stand-in made here: its first call imports the real function, stores it in the caller's
globals under the same name and forwards the call. From then on the hot paths call the real
function directly (no check, no import statement per call).
"""

from __future__ import annotations

from typing import Any

__all__ = ["first_use"]


def first_use(namespace: dict[str, Any], name: str, module: str, attr: str) -> Any:
    """A stand-in for ``namespace[name]`` that binds ``module.attr`` there on its first call.

    Race-free: the import system serialises the imports and every thread stores the same object.
    Typed ``Any`` so that the global it initialises keeps its declared callable type.

    Raises:
        ImportError: on the first call, if ``module`` cannot be imported (nothing is bound).
    """

    def first(*args: Any, **kwargs: Any) -> Any:
        # __import__ (the import statement's machinery), so -X importtime reports the module.
        real = getattr(__import__(module, fromlist=[attr]), attr)
        namespace[name] = real
        return real(*args, **kwargs)

    first.__qualname__ = first.__name__ = f"first_use({module}.{attr})"
    return first
