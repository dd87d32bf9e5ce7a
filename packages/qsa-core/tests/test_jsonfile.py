"""A JSON file a user names is parsed within its bounds, or refused with one error that names the
file and what is wrong: never a parser's, decoder's or interpreter's own exception.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsa_core import (
    JSON_MAX_DEPTH,
    JSON_MAX_INT_DIGITS,
    JSONFileError,
    read_json_file,
)
from qsa_pytest.refusals import malformed_json, refusal

WHAT = "--config"


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "file.json"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"a": "\xff\xfe"}', r"not UTF-8 text: byte b'\\xff' at offset 7"),
        (b'{"n": ' + b"7" * 5000 + b"}", "an integer of 5000 digits"),
        (b"[-" + b"1" * (JSON_MAX_INT_DIGITS + 1) + b"]", f"{JSON_MAX_INT_DIGITS + 1} digits"),
        (b"[" * 100_000 + b"]" * 100_000, f"deeper than {JSON_MAX_DEPTH} levels"),
        (b"[" * (JSON_MAX_DEPTH + 1) + b"]" * (JSON_MAX_DEPTH + 1), "deeper than"),
        (b'{"x": NaN}', "'NaN', which JSON does not allow"),
        (b"[-Infinity]", "'-Infinity', which JSON does not allow"),
        (b"[1e400]", "'1e400', which is not a finite float"),
        (b"", "not JSON: Expecting value at line 1, column 1"),
        (b'{"a": 1,}', "not JSON"),
        (b" " * 2048, "larger than 1024 bytes"),
    ],
    ids=[
        "non-utf8",
        "5000-digit-int",
        "20-digit-negative",
        "deep-100000",
        "deep-one-past-the-bound",
        "nan",
        "infinity",
        "float-overflow",
        "empty",
        "trailing-comma",
        "too-large",
    ],
)
def test_a_file_beyond_the_bounds_is_refused_naming_the_flag_file_and_fault(
    tmp_path: Path, data: bytes, message: str
) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(JSONFileError, match=message) as caught:
        read_json_file(path, what=WHAT, max_bytes=1024 if len(data) < 4096 else len(data))
    assert str(caught.value).startswith(f"{WHAT} {str(path)!r}")


def test_the_bounds_themselves_are_accepted(tmp_path: Path) -> None:
    deepest = "[" * JSON_MAX_DEPTH + "]" * JSON_MAX_DEPTH
    widest = -int("9" * JSON_MAX_INT_DIGITS)
    path = _write(tmp_path, json.dumps({"d": json.loads(deepest[1:-1]), "i": widest}).encode())
    assert read_json_file(path, what=WHAT, max_bytes=4096) == {
        "d": json.loads(deepest[1:-1]),
        "i": widest,
    }


def test_missing_directory_and_unreadable_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(JSONFileError, match="no such file"):
        read_json_file(tmp_path / "absent.json", what=WHAT, max_bytes=10)
    with pytest.raises(JSONFileError, match="is a directory"):
        read_json_file(tmp_path, what=WHAT, max_bytes=10)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_an_endless_file_is_read_only_up_to_the_bound() -> None:
    with pytest.raises(JSONFileError, match="larger than 4096 bytes"):
        read_json_file("/dev/zero", what=WHAT, max_bytes=4096)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**25), max_value=10**25)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=20,
)


def _within_bounds(value: object, level: int = 0) -> bool:
    if isinstance(value, dict):
        return level < JSON_MAX_DEPTH and all(_within_bounds(v, level + 1) for v in value.values())
    if isinstance(value, list):
        return level < JSON_MAX_DEPTH and all(_within_bounds(v, level + 1) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return len(str(abs(value))) <= JSON_MAX_INT_DIGITS
    return True


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=JSON_VALUES)
def test_a_value_within_the_bounds_reads_back_equal_and_one_beyond_is_refused(
    tmp_path: Path, value: object
) -> None:
    path = _write(tmp_path, json.dumps(value).encode())
    if _within_bounds(value):
        assert read_json_file(path, what=WHAT, max_bytes=1 << 20) == value
    else:
        with pytest.raises(JSONFileError, match="digits"):
            read_json_file(path, what=WHAT, max_bytes=1 << 20)


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=64))
def test_any_bytes_parse_or_are_refused_with_the_package_error(tmp_path: Path, data: bytes) -> None:
    path = _write(tmp_path, data)
    refused = refusal(read_json_file, {"path": path, "what": WHAT, "max_bytes": 48}, JSONFileError)
    if refused is not None:
        assert str(refused).startswith(f"{WHAT} {str(path)!r}")
    else:
        assert len(data) <= 48
        assert read_json_file(path, what=WHAT, max_bytes=48) == json.loads(data.decode("utf-8"))


@settings(max_examples=80, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=malformed_json())
def test_every_malformed_kind_is_refused_by_name(tmp_path: Path, content: bytes) -> None:
    path = _write(tmp_path, content)
    with pytest.raises(JSONFileError, match=f"^{WHAT} '"):
        read_json_file(path, what=WHAT, max_bytes=1 << 20)
