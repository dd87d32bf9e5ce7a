"""Helpers of the property tests that every public call succeeds or refuses properly.

A refusal is proper when it raises the package's own error and its message shows the refused
value. Each package's ``tests/test_refusals.py`` draws values from :func:`any_value` for one
argument at a time and checks :func:`refusal` and :func:`shows`.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import strategies as st

__all__ = ("Case", "any_value", "check_refusal", "each_argument", "refusal", "shows")

#: ``(name, call taking keyword arguments, valid keyword arguments)``: one entry point.
Case = tuple[str, Callable[..., object], Mapping[str, Any]]

#: Integers far beyond any size, where a careless check overflows or allocates.
HUGE_INTS = (2**31, 2**32, 2**63, 2**64, 2**70, -(2**63))


def any_value(*, max_int: int = 2**20, extra: Sequence[object] = ()) -> st.SearchStrategy[object]:
    """Any kind of value a caller might pass where an argument belongs.

    Args:
        max_int: ordinary integers are drawn from ``[-max_int, max_int]`` (sizes a call may
            build), besides :data:`HUGE_INTS`, which it must refuse or handle without building.
        extra: values particular to the package (a dtype, an enum member, ...).
    """
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-max_int, max_value=max_int),
        st.sampled_from(HUGE_INTS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=4),
        st.sampled_from([(), [], b"x", object(), *extra]),
    )


def shows(message: str, value: object) -> bool:
    """Whether ``message`` shows ``value``.

    It does by the value's repr (maybe shortened by :mod:`reprlib`), by its text for a str, by its
    size for bytes (a content blob is not dumped), and by any spelling of nan for a NaN.
    """
    if isinstance(value, float) and math.isnan(value):
        return "nan" in message.lower()
    if isinstance(value, bytes) and re.search(rf"\b{len(value)} (?:\w+ )?bytes\b", message):
        return True  # a blob is shown by its size: "6 bytes", "6 content bytes"
    spelled = (repr(value), reprlib.repr(value))
    return any(s in message for s in spelled) or (isinstance(value, str) and value in message)


def refusal(
    call: Callable[..., object],
    kwargs: Mapping[str, Any],
    errors: type[BaseException] | tuple[type[BaseException], ...],
) -> BaseException | None:
    """The error of ``errors`` that ``call(**kwargs)`` raised, or None when it returned.

    Any other exception propagates: a refusal must be one of the package's own errors.
    """
    try:
        call(**kwargs)
    except errors as exc:
        return exc
    return None


def check_refusal(
    call: Callable[..., object],
    valid: Mapping[str, Any],
    arg: str,
    value: object,
    errors: type[BaseException] | tuple[type[BaseException], ...],
) -> None:
    """Check the property of one argument: the valid call succeeds, and the call with ``value``.

    With ``value`` for ``arg`` the call must succeed or raise one of ``errors`` whose message
    shows ``value``.

    Raises:
        AssertionError: naming the argument, the value and the message when it does not hold.
    """
    first = refusal(call, valid, errors)
    if first is not None:
        msg = f"the valid call {dict(valid)!r} was refused: {first}"
        raise AssertionError(msg)
    refused = refusal(call, {**valid, arg: value}, errors)
    if refused is not None and not shows(str(refused), value):
        msg = f"{arg}={value!r} was refused without showing the value: {refused}"
        raise AssertionError(msg)


def each_argument(cases: Sequence[Case]) -> pytest.MarkDecorator:
    """Parametrize a test over ``(call, valid, arg)``: every argument of every case, by name."""
    return pytest.mark.parametrize(
        ("call", "valid", "arg"),
        [
            pytest.param(call, valid, arg, id=f"{name}-{arg}")
            for name, call, valid in cases
            for arg in valid
        ],
    )
