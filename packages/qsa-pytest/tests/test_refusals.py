"""The refusal helpers: what counts as showing a value, and what counts as a refusal."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import find

from qsa_pytest.refusals import HUGE_INTS, any_value, check_refusal, refusal, shows


@pytest.mark.parametrize(
    ("message", "value", "shown"),
    [
        ("x=3 is not allowed", 3, True),
        ("x=3 is not allowed", 33, False),
        ("name='ab' is not allowed", "ab", True),
        ("got 'bool'", False, False),
        ("score is NaN for id 0", float("nan"), True),
        ("shape (16,) cannot describe 1 content bytes", b"x", True),
        ("a checkpoint of 2 bytes", b"ab", True),
        ("a checkpoint of 12 bytes", b"ab", False),
        (
            f"tokens {__import__('reprlib').repr('abcdefghijklmnopqrstuvwxyz' * 3)}",
            "abcdefghijklmnopqrstuvwxyz" * 3,
            True,
        ),
    ],
)
def test_shows_accepts_the_value_in_its_spellings_only(
    message: str, value: object, shown: bool
) -> None:
    assert shows(message, value) is shown


def test_refusal_returns_the_packages_error_and_lets_any_other_through() -> None:
    def call(x: object) -> None:
        if x == 1:
            raise ValueError(f"x={x!r}")
        if x == 2:
            raise KeyError(x)

    assert refusal(call, {"x": 0}, ValueError) is None
    assert isinstance(refusal(call, {"x": 1}, ValueError), ValueError)
    with pytest.raises(KeyError):
        refusal(call, {"x": 2}, ValueError)


@pytest.mark.parametrize(
    ("kind", "condition"),
    [
        ("None", lambda v: v is None),
        ("a bool", lambda v: isinstance(v, bool)),
        ("a negative int", lambda v: type(v) is int and v < 0),
        ("an int beyond 64 bits", lambda v: type(v) is int and v > 2**64),
        ("NaN", lambda v: isinstance(v, float) and math.isnan(v)),
        ("text", lambda v: isinstance(v, str) and v != "extra"),
        ("the extra value", lambda v: v == "extra"),
    ],
)
def test_any_value_draws_every_kind(kind: str, condition: Callable[[object], bool]) -> None:
    assert condition(find(any_value(extra=["extra"]), condition)), kind


def test_huge_ints_reach_past_64_bits_and_below_zero() -> None:
    assert max(HUGE_INTS) > 2**64
    assert min(HUGE_INTS) < 0


def test_check_refusal_passes_a_proper_refusal_and_names_an_improper_one() -> None:
    def size(n: object) -> None:
        if not isinstance(n, int):
            raise ValueError("size must be an int")  # does not show the value
        if n < 0:
            raise ValueError(f"size={n!r} is negative")

    check_refusal(size, {"n": 1}, "n", -5, ValueError)
    with pytest.raises(AssertionError, match=r"n='x' was refused without showing the value"):
        check_refusal(size, {"n": 1}, "n", "x", ValueError)
    with pytest.raises(AssertionError, match=r"the valid call \{'n': -1\} was refused"):
        check_refusal(size, {"n": -1}, "n", 2, ValueError)
