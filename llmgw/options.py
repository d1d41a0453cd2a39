"""
Command-line options shared by every C{twistd llmgw} sub-command: typed
parameters whose coercion lives in L{usage.Options} (a coerce function per
option), with errors that name the option.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from twisted.python import usage


class _NamedCoerce(usage.CoerceParameter):
    """
    Like L{usage.CoerceParameter}, but a refused value's error starts with
    the option's name (C{--poll-interval: ...}) instead of "Parameter type
    enforcement failed".
    """

    def dispatch(self, parameterName: str, value: Any) -> None:
        if value is None:
            raise usage.UsageError(f"--{parameterName} requires an argument")
        try:
            coerced = self.coerce(value)
        except (TypeError, ValueError) as e:
            raise usage.UsageError(f"--{parameterName}: {e}") from None
        self.options.opts[parameterName] = coerced


class Options(usage.Options):
    """
    L{usage.Options} whose typed parameters (a coerce function in the fifth
    place of C{optParameters}) refuse bad values with the option named.
    Defaults are written already typed (Twisted does not coerce them).
    """

    def __init__(self) -> None:
        super().__init__()
        for name, d in list(self._dispatch.items()):
            if type(d) is usage.CoerceParameter:
                self._dispatch[name] = _NamedCoerce(self, d.coerce)

    def set_option(self, name: str, value: Any) -> None:
        """
        Set option C{name} (its long name) from C{value} as if it had been
        given on the command line: coerced and checked the same way.

        @raise usage.UsageError: the value is refused.
        """
        dispatch = self._dispatch[name]
        if isinstance(dispatch, usage.CoerceParameter):
            dispatch.dispatch(name, value)
        else:
            dispatch(name, value)


def _number(kind: type, value: Any) -> float:
    text = str(value).strip()
    try:
        n = kind(text)
    except ValueError:
        what = "a number" if kind is float else "a whole number"
        raise ValueError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(n):
        raise ValueError(f"{text!r} is not a finite number")
    return n  # type: ignore[no-any-return]


def _coercer(kind: type, minimum: float, strict: bool, doc: str) -> Callable[[Any], Any]:
    def coerce(value: Any) -> Any:
        n = _number(kind, value)
        if n < minimum or (strict and n == minimum):
            raise ValueError(f"must be {doc.lower().rstrip('.')}, not {n}")
        return n

    coerce.coerceDoc = doc  # type: ignore[attr-defined]
    return coerce


#: Coerce functions for C{optParameters}.
positive_float = _coercer(float, 0, True, "A positive number.")
non_negative_float = _coercer(float, 0, False, "A number, 0 or more.")
positive_int = _coercer(int, 0, True, "A positive whole number.")
non_negative_int = _coercer(int, 0, False, "A whole number, 0 or more.")
