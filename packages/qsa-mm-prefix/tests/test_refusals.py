"""Every public call succeeds, bypasses with a reason, or refuses with this package's error
naming the value it refused; never a bare ``TypeError`` or ``AttributeError`` from inside.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_mm_prefix import (
    Modality,
    MultimodalItem,
    MultimodalPrefixError,
    ProcessorFingerprint,
    build_prompt_identity,
    content_digest,
    image_key,
)

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**20), max_value=2**20),
    st.sampled_from([2**31, 2**63, 2**64, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.sampled_from([(), [], (1, 2), (1, 2, 3), b"x", object()]),
)

PROCESSOR = ProcessorFingerprint.create("P", "v1", {"size": 14})
ITEM_ARGS: Mapping[str, Any] = {
    "modality": Modality.IMAGE,
    "start": 4,
    "length": 4,
    "content": bytes(64),  # 16 float32 values
    "grid": (1, 4, 4),
    "dtype": "float32",
    "shape": (16, 1),
}


def _identity(**kw: Any) -> object:
    item = MultimodalItem(**{k: kw[k] for k in ITEM_ARGS})
    return build_prompt_identity(
        kw["num_tokens"], [item], processor=PROCESSOR, page_size=kw["page_size"]
    )


CASES: tuple[tuple[str, Callable[..., object], Mapping[str, Any]], ...] = (
    ("content_digest", content_digest, {"content": b"abc"}),
    (
        "ProcessorFingerprint.create",
        ProcessorFingerprint.create,
        {"name": "P", "version": "v1", "args": {"size": 14}},
    ),
    (
        "image_key",
        lambda **kw: image_key(
            MultimodalItem(Modality.IMAGE, 0, 4, content=b"x"),
            order=kw["order"],
            processor=PROCESSOR,
        ),
        {"order": 0},
    ),
    ("build_prompt_identity", _identity, {**ITEM_ARGS, "num_tokens": 16, "page_size": 4}),
)
PARAMETERS = [(name, call, valid, arg) for name, call, valid in CASES for arg in valid]


def _shows(message: str, value: object) -> bool:
    if isinstance(value, float) and math.isnan(value):
        return "nan" in message.lower()
    if isinstance(value, bytes):  # content is shown by its size, not dumped
        return f"{len(value)} content bytes" in message or repr(value) in message
    shown = (repr(value), reprlib.repr(value))  # a long value may be shown shortened
    return any(r in message for r in shown) or (isinstance(value, str) and value in message)


def _refusal(
    call: Callable[..., object], kwargs: Mapping[str, Any]
) -> MultimodalPrefixError | None:
    try:
        call(**kwargs)
    except MultimodalPrefixError as exc:
        return exc
    return None


@pytest.mark.parametrize(
    ("call", "valid", "arg"),
    [(call, valid, arg) for _, call, valid, arg in PARAMETERS],
    ids=[f"{name}-{arg}" for name, _, _, arg in PARAMETERS],
)
@settings(deadline=None, max_examples=60)
@given(value=ANY_VALUE)
def test_a_call_succeeds_or_refuses_with_the_package_error_naming_the_value(
    call: Callable[..., object], valid: Mapping[str, Any], arg: str, value: object
) -> None:
    assert _refusal(call, valid) is None
    refused = _refusal(call, {**valid, arg: value})
    assert refused is None or _shows(str(refused), value), (arg, value, str(refused))
