"""Reading a JSON file a user names (a model config, a calibration file, token ids): bounded.

Python's parser alone lets a file through that later fails somewhere far away, or fails with its
own words: an integer of more than 4,300 digits raises CPython's conversion limit, nesting deeper
than the interpreter's recursion limit raises ``RecursionError``, bytes that are not UTF-8 raise
``UnicodeDecodeError``, ``NaN`` and ``Infinity`` (not JSON) are accepted, and ``/dev/zero`` is
read until memory runs out. :func:`read_json_file` reads at most ``max_bytes``, accepts integers
of at most :data:`JSON_MAX_INT_DIGITS` digits, finite floats only and nesting of at most
:data:`JSON_MAX_DEPTH` levels, and reports every failure as one :class:`JSONFileError` naming the
file, how the user named it and what is wrong.
"""

from __future__ import annotations

import json
import math
import os

from qsa_core._errors import JSONFileError

__all__ = ("CONFIG_JSON_MAX_BYTES", "JSON_MAX_DEPTH", "JSON_MAX_INT_DIGITS", "read_json_file")

#: Most levels of nested arrays and objects accepted (a model config nests 3 or 4).
JSON_MAX_DEPTH = 64

#: Most digits of an integer, sign excluded (an int64 has 19).
JSON_MAX_INT_DIGITS = 19

#: Most bytes of a model's ``config.json`` (real ones are a few KiB).
CONFIG_JSON_MAX_BYTES = 4 << 20


class _UnboundedError(Exception):
    """Raised from inside the parser's number hooks; carries what was refused."""


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > JSON_MAX_INT_DIGITS:
        msg = (
            f"an integer of {digits} digits ({text[:12]}...); at most {JSON_MAX_INT_DIGITS} allowed"
        )
        raise _UnboundedError(msg)
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        msg = f"the number {text[:24]!r}, which is not a finite float"
        raise _UnboundedError(msg)
    return value


def _no_constant(text: str) -> float:
    msg = f"{text!r}, which JSON does not allow"
    raise _UnboundedError(msg)


def _depth(data: object) -> int:
    """Levels of nested lists and dicts in ``data`` (0 for a scalar); iterative."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if level <= JSON_MAX_DEPTH:  # deeper is refused anyway: stop walking
            stack.extend((child, level + 1) for child in children)
    return deepest


def read_json_file(path: str | os.PathLike[str], *, what: str, max_bytes: int) -> object:
    """Parse the JSON file at ``path``, within bounds.

    Args:
        path: The file.
        what: How the user named it (a flag such as ``"--config"``, or a switch's name); every
            message starts with it and the path.
        max_bytes: Most bytes accepted; a longer file is refused after reading ``max_bytes + 1``.

    Returns:
        The parsed value: dicts, lists, str, int (at most :data:`JSON_MAX_INT_DIGITS`
        digits), finite float, bool or None, nested at most :data:`JSON_MAX_DEPTH` levels.

    Raises:
        JSONFileError: The file is missing, a directory, unreadable, larger than ``max_bytes``,
            not UTF-8, not JSON, or beyond the bounds above.
    """
    named = f"{what} {os.fspath(path)!r}"
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        msg = f"{named}: no such file"
        raise JSONFileError(msg) from None
    except IsADirectoryError:
        msg = f"{named} is a directory; give a JSON file"
        raise JSONFileError(msg) from None
    except OSError as exc:
        msg = f"{named} cannot be read: {exc.strerror or exc}"
        raise JSONFileError(msg) from None
    if len(raw) > max_bytes:
        msg = f"{named} is larger than {max_bytes} bytes, the most accepted"
        raise JSONFileError(msg)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.start + 1]
        msg = f"{named} is not UTF-8 text: byte {bad!r} at offset {exc.start}"
        raise JSONFileError(msg) from None
    try:
        data = json.loads(
            text,
            parse_int=_bounded_int,
            parse_float=_finite_float,
            parse_constant=_no_constant,
        )
    except _UnboundedError as exc:
        msg = f"{named} holds {exc}"
        raise JSONFileError(msg) from None
    except json.JSONDecodeError as exc:
        msg = f"{named} is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        raise JSONFileError(msg) from None
    except RecursionError:
        msg = f"{named} nests deeper than {JSON_MAX_DEPTH} levels, the most accepted"
        raise JSONFileError(msg) from None
    if _depth(data) > JSON_MAX_DEPTH:
        msg = f"{named} nests deeper than {JSON_MAX_DEPTH} levels, the most accepted"
        raise JSONFileError(msg)
    return data
