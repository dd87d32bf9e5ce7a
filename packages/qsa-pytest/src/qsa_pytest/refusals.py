"""Helpers of the property tests that every public call succeeds or refuses properly.

A refusal is proper when it raises the package's own error and its message shows the refused
value. Each package's ``tests/test_refusals.py`` draws values from :func:`any_value` for one
argument at a time and checks :func:`refusal` and :func:`shows`.
"""

from __future__ import annotations

import math
import re
import reprlib
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import strategies as st

from qsa_pytest.processes import hang_guard_s

__all__ = (
    "Case",
    "FreshRefusal",
    "any_value",
    "check_refusal",
    "each_argument",
    "malformed_json",
    "refusal",
    "refusal_in_fresh_interpreter",
    "shows",
)

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


def malformed_json() -> st.SearchStrategy[bytes]:
    """Contents of a file that a bounded JSON reader must refuse by name, not crash on.

    Bytes that are not UTF-8, integers beyond int64 and beyond CPython's 4,300-digit conversion
    limit, nesting past any sane depth and past the interpreter's recursion limit, the non-JSON
    constants, floats that overflow, truncated and empty documents.
    """
    digits = st.integers(min_value=20, max_value=6000)
    depth = st.integers(min_value=65, max_value=200_000)
    return st.one_of(
        st.binary(min_size=1, max_size=16).map(lambda b: b'{"k": "' + b"\xff" + b + b'"}'),
        st.sampled_from([b"\xc3\x28", b"\xed\xa0\x80", b"\x80"]).map(lambda b: b"[" + b + b"]"),
        digits.map(lambda n: b'{"n": ' + b"9" * n + b"}"),
        digits.map(lambda n: b"[-" + b"1" * n + b"]"),
        depth.map(lambda n: b"[" * n + b"]" * n),
        depth.map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
        st.sampled_from([b"[NaN]", b'{"x": Infinity}', b"-Infinity", b"[1e999]", b"[-1e400]"]),
        st.sampled_from([b"", b" ", b"{", b'{"a": [1, 2', b'{"a": 1,}', b"\x00", b"nul"]),
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


#: Marks the line on which the fresh interpreter lists the watched modules it had imported.
_IMPORTED = "#qsa-imported:"


@dataclass(frozen=True, slots=True)
class FreshRefusal:
    """How a command-line entry point ended in a fresh interpreter.

    Attributes:
        returncode: its exit status (argparse refusals exit 2).
        stderr: what it wrote to standard error.
        imported: which of the watched modules had been imported when it exited.
    """

    returncode: int
    stderr: str
    imported: frozenset[str]


def refusal_in_fresh_interpreter(
    entry: str, argv: Sequence[str], *, watched: Sequence[str] = ("torch",)
) -> FreshRefusal:
    """Run ``main(argv)`` of module ``entry`` in a new Python process.

    A refusal that needs no model or device must come before the slow imports: the result says
    which of ``watched`` were loaded by the time ``main`` exited.
    """
    script = "\n".join(
        (
            "import sys",
            f"from {entry} import main",
            "try:",
            f"    main({list(argv)!r})",
            "finally:",
            f"    loaded = [m for m in {list(watched)!r} if m in sys.modules]",
            f"    print('\\n{_IMPORTED}', *loaded)",
        )
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
        timeout=hang_guard_s(),
    )
    report = done.stdout.rpartition(_IMPORTED)[2] if _IMPORTED in done.stdout else ""
    return FreshRefusal(done.returncode, done.stderr, frozenset(report.split()))
