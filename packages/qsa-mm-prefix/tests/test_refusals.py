"""Every public call succeeds, bypasses with a reason, or refuses with this package's error
naming the value it refused; never a bare ``TypeError`` or ``AttributeError`` from inside.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hypothesis import given, settings

from qsa_mm_prefix import (
    Modality,
    MultimodalItem,
    MultimodalPrefixError,
    ProcessorFingerprint,
    build_prompt_identity,
    content_digest,
    image_key,
)
from qsa_pytest.refusals import Case, any_value, check_refusal, each_argument

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


CASES: tuple[Case, ...] = (
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


@each_argument(CASES)
@settings(deadline=None, max_examples=60)
@given(value=any_value(extra=[(1, 2), (1, 2, 3)]))
def test_a_call_succeeds_or_refuses_with_the_package_error_naming_the_value(
    call: Callable[..., object], valid: Mapping[str, Any], arg: str, value: object
) -> None:
    check_refusal(call, valid, arg, value, MultimodalPrefixError)
