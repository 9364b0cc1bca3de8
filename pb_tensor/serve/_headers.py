"""Request headers forwarded as request parameters (tritonserver's
``--http-header-forward-pattern`` and ``--grpc-header-forward-pattern``).

tritonserver puts ``(?i)`` before the pattern (header names are case-insensitive) and
forwards each header whose name the pattern matches anywhere (RE2's ``PartialMatch``) as a
string parameter, refusing the names Triton reserves. The pattern is RE2's; the common
subset is Python's (what RE2 lacks is refused), and a pattern starting with RE2's ``(?-i)``
(which Python accepts only as a scoped group) matches case-sensitively.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pb_tensor.serve._errors import ServeError

__all__ = ["HeaderForwarder"]

# core's kReservedParameterKeys (src/common.h); any name starting with "triton_" too.
_RESERVED = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority",
                       "timeout", "headers", "binary_data_output"})  # fmt: skip


# Python's constructs RE2 refuses: lookahead / lookbehind, named and numbered
# backreferences, conditionals.
_NOT_RE2 = re.compile(r"\(\?(?:=|!|<=|<!|P=|\()|\\[1-9]")


class HeaderForwarder:
    """The request parameters a pattern takes from a request's headers.

    Raises (from the constructor):
        ServeError: the pattern is no regular expression (``flag`` names the option).
    """

    __slots__ = ("_regex",)

    def __init__(self, pattern: str, flag: str) -> None:
        flags = re.IGNORECASE
        if pattern.startswith("(?-i)"):
            pattern, flags = pattern[len("(?-i)"):], re.RegexFlag(0)
        if _NOT_RE2.search(pattern):
            # RE2 has none of these: tritonserver's pattern would forward nothing.
            raise ServeError(f"invalid {flag} '{pattern}': lookarounds, backreferences and "
                             "conditionals are not RE2 syntax")
        try:
            self._regex = re.compile(pattern, flags)
        except re.error as exc:
            raise ServeError(f"invalid {flag} '{pattern}': {exc}") from None

    def parameters(self, headers: Iterable[tuple[str, str]]) -> dict[str, str]:
        """The parameters of the headers (name, value) the pattern matches, in order.

        Raises:
            ServeError: a matching header's name is reserved (Triton's message).
        """
        found: dict[str, str] = {}
        search = self._regex.search
        for name, value in headers:
            if search(name) is None:
                continue
            if name in _RESERVED or name.startswith("triton_"):
                raise ServeError(
                    f"Header '{name}' is reserved for Triton usage and cannot be forwarded."
                )
            found[name] = value
        return found
