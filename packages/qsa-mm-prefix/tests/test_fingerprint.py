"""Processor fingerprints: a canonical, injective encoding of the preprocessing arguments."""

from __future__ import annotations

import enum
import struct
from collections import OrderedDict
from pathlib import PurePosixPath
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qsa_mm_prefix import (
    InvalidFingerprintError,
    PreprocessArg,
    ProcessorFingerprint,
    UnsupportedArgumentError,
    spatial_merge_size,
)


def _fp(args: dict[str, object]) -> ProcessorFingerprint:
    return ProcessorFingerprint.create("proc", "1.0", args)  # type: ignore[arg-type]


def _canonical(value: object) -> object:
    """What the encoding must distinguish: type class, value, order of sequences, not of maps."""
    if value is None:
        return ("none",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, bytes):
        return ("bytes", value)
    if isinstance(value, dict):
        return ("map", tuple(sorted((k, _canonical(v)) for k, v in value.items())))
    assert isinstance(value, list | tuple)
    return ("seq", tuple(_canonical(v) for v in value))


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.binary(max_size=6)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)
_args = st.dictionaries(st.text(min_size=1, max_size=5), _values, max_size=4)


@given(_args, _args)
def test_encoding_is_equal_exactly_when_arguments_are_equal(
    a: dict[str, object], b: dict[str, object]
) -> None:
    """Two argument sets encode equally iff they are equal up to map order and list/tuple."""
    assert (_fp(a) == _fp(b)) == (_canonical(a) == _canonical(b))


@given(_args)
def test_key_order_does_not_matter(args: dict[str, object]) -> None:
    """Reversed insertion order of the argument mapping gives the same fingerprint."""
    reordered = OrderedDict(reversed(list(args.items())))
    assert _fp(args) == _fp(dict(reordered))
    assert _fp(args).digest == _fp(dict(reordered)).digest


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"x": True}, {"x": 1}),
        ({"x": 1}, {"x": 1.0}),
        ({"x": 0.0}, {"x": -0.0}),
        ({"x": "1"}, {"x": 1}),
        ({"x": b"ab"}, {"x": "ab"}),
        ({"x": None}, {"x": ""}),
        ({"x": ["ab", "c"]}, {"x": ["a", "bc"]}),
        ({"x": [["a"], "b"]}, {"x": [["a", "b"]]}),
        ({"ab": "c"}, {"a": "bc"}),
        ({"x": {"a": 1}}, {"x": [["a", 1]]}),
        ({"x": [1, 2]}, {"x": [2, 1]}),
        ({"x": 255}, {"x": -1}),
        ({"x": 2**64}, {"x": 0}),
        ({}, {"": None}),
    ],
    ids=repr,
)
def test_forged_boundaries_do_not_collide(a: dict[str, object], b: dict[str, object]) -> None:
    """Values that a naive concatenation or str() would confuse encode differently."""
    if b == {"": None}:
        with pytest.raises(InvalidFingerprintError):
            _fp(b)
        return
    assert _fp(a).args_encoding != _fp(b).args_encoding
    assert _fp(a).digest != _fp(b).digest


def test_name_and_version_are_length_prefixed() -> None:
    """Moving characters between name and version changes the digest."""
    a = ProcessorFingerprint.create("ab", "c", {})
    b = ProcessorFingerprint.create("a", "bc", {})
    assert a.digest != b.digest


def test_numpy_scalars_encode_like_python_numbers() -> None:
    """numpy ints and floats are encoded as the int and float they equal."""
    assert _fp({"x": np.int64(7), "y": np.float64(0.5)}) == _fp({"x": 7, "y": 0.5})
    assert _fp({"x": np.float32(0.5)}) == _fp({"x": 0.5})


@pytest.mark.parametrize(
    "value", [{1, 2}, frozenset({"a"}), object(), 1j, np.zeros(2)], ids=lambda v: type(v).__name__
)
def test_values_without_canonical_form_are_rejected(value: object) -> None:
    """Sets (hash-seeded order), objects, complex numbers and arrays raise a TypeError."""
    with pytest.raises(UnsupportedArgumentError, match=r"args\.x") as info:
        _fp({"x": value})
    assert isinstance(info.value, TypeError)


def test_non_string_mapping_keys_are_rejected() -> None:
    """Nested mapping keys must be str; the message names the path and the keys."""
    with pytest.raises(UnsupportedArgumentError, match=r"args\.size.*\[1\]"):
        _fp({"size": {1: 2}})


def test_self_referencing_arguments_are_rejected() -> None:
    """A list that contains itself fails with a clear error, not a crash."""
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(UnsupportedArgumentError, match="deeper than 32"):
        _fp({"x": loop})


@pytest.mark.parametrize(("name", "version"), [("", "1"), ("p", ""), (None, "1")])
def test_empty_name_or_version_is_rejected(name: str, version: str) -> None:
    """Name and version are required and non-empty."""
    with pytest.raises(InvalidFingerprintError, match="non-empty"):
        ProcessorFingerprint.create(name, version, {})


class _Resample(enum.Enum):
    BICUBIC = 3


def test_settings_are_made_canonical_before_they_are_encoded() -> None:
    """An enum member is its class and name, a path its text, a tuple a list: a processor's own
    ``to_dict()`` fingerprints as its canonical arguments would."""
    settings = {"resample": _Resample.BICUBIC, "dir": PurePosixPath("/m/a"), "size": (2, 3)}
    canonical: dict[str, PreprocessArg] = {
        "resample": "_Resample.BICUBIC",
        "dir": "/m/a",
        "size": [2, 3],
    }
    got = ProcessorFingerprint.from_settings("proc", "1.0", {"processor": settings})
    assert got == ProcessorFingerprint.create("proc", "1.0", {"processor": canonical})
    assert got != ProcessorFingerprint.from_settings("proc", "1.0", {"processor": {"size": [2]}})


def test_a_setting_key_that_is_not_a_str_is_named_with_its_path() -> None:
    with pytest.raises(InvalidFingerprintError, match=r"setting key 1 at 'processor.crop'"):
        ProcessorFingerprint.from_settings("proc", "1.0", {"processor": {"crop": {1: "x"}}})


def test_spatial_merge_size_is_read_from_the_vision_config() -> None:
    """Objects and mappings both give the vision merge size; no vision config gives None."""
    obj = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    assert spatial_merge_size(obj) == 2
    assert spatial_merge_size({"vision_config": {"spatial_merge_size": 3}}) == 3
    assert spatial_merge_size({"text_config": {}}) is None
