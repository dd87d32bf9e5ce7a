"""Bypassed prompts are reported, never keyed; malformed spans are refused with their values."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from qsa_mm_prefix import (
    BypassReason,
    FeatureSource,
    InvalidGridError,
    InvalidPromptError,
    Modality,
    MultimodalItem,
    OverlappingSpansError,
    ProcessorFingerprint,
    SpanOutOfRangeError,
    UnsupportedItemError,
    build_prompt_identity,
    image_key,
)

MakeImage = Callable[[int, tuple[int, int, int], int], MultimodalItem]


def _bypassing_items() -> list[tuple[MultimodalItem, BypassReason]]:
    base = MultimodalItem(Modality.IMAGE, 100, 10, content=b"frames")
    return [
        (dataclasses.replace(base, modality=Modality.VIDEO), BypassReason.VIDEO),
        (dataclasses.replace(base, modality=Modality.AUDIO), BypassReason.AUDIO),
        (
            dataclasses.replace(base, source=FeatureSource.PRECOMPUTED_EMBEDDING),
            BypassReason.PRECOMPUTED_EMBEDDING,
        ),
        (
            dataclasses.replace(base, source=FeatureSource.CALLER_FEATURES),
            BypassReason.CALLER_FEATURES,
        ),
        (dataclasses.replace(base, content=None), BypassReason.MISSING_CONTENT),
    ]


@pytest.mark.parametrize(
    ("item", "reason"), _bypassing_items(), ids=lambda v: getattr(v, "value", "")
)
def test_bypass_is_reported_with_reason_and_item(
    processor: ProcessorFingerprint,
    make_image: MakeImage,
    item: MultimodalItem,
    reason: BypassReason,
) -> None:
    """One bypassing item among images: not reusable, the item named, no keys made."""
    images = [make_image(0, (1, 8, 8), 1), make_image(200, (1, 8, 8), 2)]
    identity = build_prompt_identity(300, [images[0], item, images[1]], processor=processor)
    assert not identity.reusable
    assert identity.bypass_reason is reason
    assert identity.bypass is not None
    assert identity.bypass.item_index == 1
    assert identity.page_identities == ()
    assert identity.image_keys == ()
    with pytest.raises(UnsupportedItemError, match=reason.value):
        image_key(item, order=0, processor=processor)


def test_first_bypassing_item_is_the_one_reported(processor: ProcessorFingerprint) -> None:
    """With several bypassing items, the first in the engine's order is reported."""
    (video, _), (audio, _) = _bypassing_items()[:2]
    identity = build_prompt_identity(
        300, [audio, dataclasses.replace(video, start=0)], processor=processor
    )
    assert identity.bypass_reason is BypassReason.AUDIO
    assert identity.bypass is not None
    assert identity.bypass.item_index == 0


def test_bypass_preempts_span_checks(processor: ProcessorFingerprint) -> None:
    """A video whose span would not fit still bypasses rather than raising."""
    video = MultimodalItem(Modality.VIDEO, 500, 10, content=b"v")
    identity = build_prompt_identity(100, [video], processor=processor)
    assert identity.bypass_reason is BypassReason.VIDEO


def test_reusable_prompt_reports_no_bypass(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """An image-only prompt is reusable with bypass_reason None and one key per image."""
    identity = build_prompt_identity(100, [make_image(0, (1, 4, 4), 1)], processor=processor)
    assert identity.reusable
    assert identity.bypass is None
    assert identity.bypass_reason is None
    assert [k.order for k in identity.image_keys] == [0]


def test_span_past_the_prompt_is_rejected(processor: ProcessorFingerprint) -> None:
    """A span ending after the last token names the item, its span and the prompt length."""
    item = MultimodalItem(Modality.IMAGE, 95, 10, content=b"x")
    with pytest.raises(SpanOutOfRangeError, match=r"item 0 spans tokens \[95, 105\).*100 tokens"):
        build_prompt_identity(100, [item], processor=processor)
    build_prompt_identity(105, [item], processor=processor)  # exactly fits


def test_overlapping_spans_are_rejected_in_any_order(processor: ProcessorFingerprint) -> None:
    """Two spans sharing one token are refused whatever order the engine lists them in."""
    a = MultimodalItem(Modality.IMAGE, 10, 10, content=b"a")
    b = MultimodalItem(Modality.IMAGE, 19, 5, content=b"b")
    for items in ([a, b], [b, a]):
        with pytest.raises(
            OverlappingSpansError, match=r"\[10, 20\).*\[19, 24\)|\[19, 24\).*\[10, 20\)"
        ):
            build_prompt_identity(100, items, processor=processor)


def test_order_is_the_engine_order_not_the_position(processor: ProcessorFingerprint) -> None:
    """Listing the same two images in the other order gives other keys (order is identity)."""
    a = MultimodalItem(Modality.IMAGE, 10, 10, content=b"a")
    b = MultimodalItem(Modality.IMAGE, 30, 5, content=b"b")
    ab = build_prompt_identity(64, [a, b], processor=processor)
    ba = build_prompt_identity(64, [b, a], processor=processor)
    assert [k.order for k in ba.image_keys] == [0, 1]
    assert ba.image_keys[0].start == 30
    assert ab.page_identities[0] != ba.page_identities[0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start": -1, "length": 4}, "start must be an int >= 0, got -1"),
        ({"start": 0, "length": 0}, "length must be an int >= 1, got 0"),
        ({"start": True, "length": 4}, "start"),
        ({"start": 0, "length": 2.0}, "length"),
    ],
)
def test_malformed_item_spans_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    """Negative starts, empty spans and non-int values are refused at construction."""
    with pytest.raises(SpanOutOfRangeError, match=match):
        MultimodalItem(Modality.IMAGE, content=b"x", **kwargs)


@pytest.mark.parametrize("grid", [(1, 2), (0, 2, 2), (1, -2, 2), (1, 2, 2, 2), (1.0, 2, 2)])
def test_malformed_grids_are_rejected(grid: Any) -> None:
    """A grid is exactly three positive ints."""
    with pytest.raises(InvalidGridError, match="three positive ints"):
        MultimodalItem(Modality.IMAGE, 0, 1, content=b"x", grid=grid)


def test_grid_must_match_span_under_merge_size(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """With spatial_merge_size, span length must be t·h·w / merge²; the message shows both."""
    item = make_image(0, (1, 8, 8), 1)  # 16 tokens
    build_prompt_identity(64, [item], processor=processor, spatial_merge_size=2)
    wrong = dataclasses.replace(item, length=17)
    with pytest.raises(InvalidGridError, match=r"\(1, 8, 8\) \(64 patches\).*17"):
        build_prompt_identity(64, [wrong], processor=processor, spatial_merge_size=2)
    odd = dataclasses.replace(item, grid=(1, 3, 3), length=2)
    with pytest.raises(InvalidGridError):
        build_prompt_identity(64, [odd], processor=processor, spatial_merge_size=2)
    build_prompt_identity(64, [wrong], processor=processor)  # unchecked without a merge size


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_tokens": -1}, "num_tokens must be an int >= 0, got -1"),
        ({"num_tokens": 10, "page_size": 0}, "page_size must be an int >= 1, got 0"),
        ({"num_tokens": 10, "spatial_merge_size": 0}, "spatial_merge_size"),
        ({"num_tokens": 10.0}, "num_tokens"),
    ],
)
def test_prompt_arguments_out_of_range_are_rejected(
    processor: ProcessorFingerprint, kwargs: dict[str, Any], match: str
) -> None:
    """Token count, page size and merge size are validated with the rejected value shown."""
    with pytest.raises(InvalidPromptError, match=match):
        build_prompt_identity(items=[], processor=processor, **kwargs)
