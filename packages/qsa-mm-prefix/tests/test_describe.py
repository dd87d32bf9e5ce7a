"""An engine's item described from plain values; a prompt's page extras or its bypass reason."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from qsa_mm_prefix import (
    Bypass,
    BypassReason,
    FeatureSource,
    InvalidFingerprintError,
    Modality,
    MultimodalItem,
    ProcessorFingerprint,
    SpanOutOfRangeError,
    build_prompt_identity,
    collect_items,
    describe_item,
    prompt_identity,
    prompt_page_extras,
)

MERGE = 2


def pixels(seed: int, grid: tuple[int, int, int]) -> np.ndarray:
    """A float32 pixel tensor ``[t·h·w, 1176]`` with content fixed by ``seed``."""
    t, h, w = grid
    return np.random.default_rng(seed).standard_normal((t * h * w, 1176)).astype(np.float32)


def _describe(index: int = 0, **fields: Any) -> MultimodalItem | Bypass:
    """An image of grid (1, 2, 12) over tokens 5..10, with ``fields`` replaced."""
    values: dict[str, Any] = {
        "modality": "IMAGE",
        "source": FeatureSource.PROCESSOR,
        "offsets": [(5, 10)],
        "grid": np.array([[1, 2, 12]]),
        "feature": pixels(1, (1, 2, 12)),
    }
    values.update(fields)
    return describe_item(index, **values)


def _image(**fields: Any) -> MultimodalItem:
    item = _describe(**fields)
    assert isinstance(item, MultimodalItem)
    return item


def test_an_image_maps_its_inclusive_span_grid_dtype_and_shape() -> None:
    item = _describe()
    assert isinstance(item, MultimodalItem)
    assert (item.modality, item.start, item.length, item.grid) == (Modality.IMAGE, 5, 6, (1, 2, 12))
    assert (item.dtype, item.shape) == ("float32", (24, 1176))
    assert _describe(grid=[1, 2, 12]) == item  # a list, an array: the same grid


def test_a_non_contiguous_array_keys_like_its_contiguous_copy(
    processor: ProcessorFingerprint,
) -> None:
    base = pixels(2, (1, 2, 12))
    strided = np.asfortranarray(base)
    assert not strided.flags.c_contiguous
    keys = {
        build_prompt_identity(
            64, [_image(feature=f)], processor=processor, spatial_merge_size=MERGE
        ).page_identities
        for f in (base, strided)
    }
    assert len(keys) == 1


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"modality": "VIDEO"}, BypassReason.VIDEO),
        ({"modality": "audio"}, BypassReason.AUDIO),
        ({"modality": "MULTI_IMAGES"}, BypassReason.UNKNOWN_MODALITY),
        ({"source": FeatureSource.PRECOMPUTED_EMBEDDING}, BypassReason.PRECOMPUTED_EMBEDDING),
        ({"source": FeatureSource.CALLER_FEATURES}, BypassReason.CALLER_FEATURES),
        ({"offsets": None}, BypassReason.NO_SPAN),
        ({"offsets": []}, BypassReason.NO_SPAN),
        ({"offsets": [(5, 7), (9, 10)]}, BypassReason.MULTI_SPAN),
        ({"offsets": [(9, 4)]}, BypassReason.BAD_SPAN),
        ({"offsets": [(-2, 4)]}, BypassReason.BAD_SPAN),
        ({"offsets": [("a", 4)]}, BypassReason.BAD_SPAN),
        ({"grid": np.ones((2, 3), dtype=np.int64)}, BypassReason.BAD_GRID),
        ({"grid": np.array([1, 0, 4])}, BypassReason.BAD_GRID),
        ({"grid": np.array([1.0, 2.0, 12.0])}, BypassReason.BAD_GRID),
        ({"feature": None}, BypassReason.MISSING_CONTENT),
        ({"feature": [pixels(1, (1, 2, 12))]}, BypassReason.UNSUPPORTED_CONTENT),
        ({"feature": np.array([object()])}, BypassReason.UNSUPPORTED_CONTENT),
    ],
)
def test_each_item_that_cannot_be_described_exactly_bypasses_with_its_reason(
    fields: dict[str, Any], reason: BypassReason
) -> None:
    got = _describe(3, **fields)
    assert isinstance(got, Bypass)
    assert (got.reason, got.item_index, got.reusable, got.bypass_reason) == (
        reason,
        3,
        False,
        reason,
    )
    assert got.detail


def test_the_first_bypass_wins_and_later_items_are_not_read() -> None:
    read: list[int] = []

    def items() -> Any:
        cases: list[dict[str, Any]] = [{}, {"modality": "VIDEO"}, {"feature": None}]
        for index, fields in enumerate(cases):
            read.append(index)
            yield _describe(index, **fields)

    got = collect_items(items())
    assert isinstance(got, Bypass)
    assert (got.reason, got.item_index, read) == (BypassReason.VIDEO, 1, [0, 1])


def test_prompt_level_reasons_come_before_the_items(processor: ProcessorFingerprint) -> None:
    video = [_describe(modality="VIDEO")]
    common: dict[str, Any] = {"processor": processor, "page_size": 64}
    assert prompt_page_extras(64, video, input_embeds=True, **common) is BypassReason.INPUT_EMBEDS
    got = prompt_page_extras(64, video, embed_overrides=True, **common)
    assert got is BypassReason.EMBED_OVERRIDES
    assert prompt_page_extras(64, None, **common) == {}
    assert prompt_page_extras(64, video, processor=None, page_size=64) is BypassReason.NO_PROCESSOR
    assert prompt_page_extras(64, video, **common) is BypassReason.VIDEO


def test_a_reusable_prompt_gives_the_page_extras_of_its_identity(
    processor: ProcessorFingerprint,
) -> None:
    item = _image(offsets=[(70, 75)])
    extras = prompt_page_extras(
        200, [item], processor=processor, page_size=64, spatial_merge_size=MERGE
    )
    identity = build_prompt_identity(
        200, [item], processor=processor, page_size=64, spatial_merge_size=MERGE
    )
    assert extras == identity.page_extras
    assert list(extras) == [1]  # only the page the image overlaps


def test_prompt_identity_of_described_items_or_the_first_bypass(
    processor: ProcessorFingerprint,
) -> None:
    """Reusable items give :func:`build_prompt_identity`'s identity; a bypass is returned as it
    is, and the items after it are not read."""
    item = _image(offsets=[(70, 75)])
    got = prompt_identity(200, iter([item]), processor=processor, spatial_merge_size=MERGE)
    assert got == build_prompt_identity(200, [item], processor=processor, spatial_merge_size=MERGE)
    read: list[int] = []

    def items() -> Any:
        for index, fields in enumerate([{"modality": "VIDEO"}, {}]):
            read.append(index)
            yield _describe(index, **fields)

    bypass = prompt_identity(200, items(), processor=processor)
    assert isinstance(bypass, Bypass)
    assert (bypass.reason, read) == (BypassReason.VIDEO, [0])
    with pytest.raises(SpanOutOfRangeError):
        prompt_identity(62, [_describe(offsets=[(60, 65)])], processor=processor)


def test_items_that_contradict_the_prompt_are_logged_and_bypass(
    processor: ProcessorFingerprint, caplog: pytest.LogCaptureFixture
) -> None:
    past_the_end = [_describe(offsets=[(60, 65)])]
    with caplog.at_level(logging.ERROR, logger="qsa_mm_prefix"):
        got = prompt_page_extras(
            62, past_the_end, processor=processor, page_size=64, holder="req-7"
        )
    assert got is BypassReason.INVALID_MULTIMODAL
    assert caplog.records[0].getMessage() == (
        "prefix cache: the media items of 'req-7' contradict its prompt"
    )
    assert caplog.records[0].exc_info is not None


class _HFLike:
    """A processor that accounts for its settings the way an HF image processor does."""

    def __init__(self, **settings: object) -> None:
        self.settings = {"max_pixels": 1024, **settings}

    def to_dict(self) -> dict[str, object]:
        return dict(self.settings)


class _Payload(_HFLike):
    """A processor with an engine's own fingerprint payload besides ``to_dict``."""

    def preprocess_fingerprint_payload(self) -> dict[str, object]:
        return {"payload": self.settings}


def test_a_processor_is_fingerprinted_by_its_settings_config_extras_and_versions() -> None:
    cfg = {"model_type": "qwen4_exp", "architectures": ["X"], "hidden_size": 8}
    base = ProcessorFingerprint.from_processor(_HFLike(), hf_config=cfg)
    assert base.name.endswith("test_describe._HFLike")
    assert base.version == "transformers==absent"  # not installed here
    assert base == ProcessorFingerprint.from_processor(
        _HFLike(), hf_config={**cfg, "hidden_size": 9}
    )  # only model_type and architectures of the config count
    others = [
        ProcessorFingerprint.from_processor(_HFLike(max_pixels=2048), hf_config=cfg),
        ProcessorFingerprint.from_processor(_HFLike(), hf_config={**cfg, "model_type": "x"}),
        ProcessorFingerprint.from_processor(_HFLike(), hf_config=cfg, extra={"rev": "b"}),
        ProcessorFingerprint.from_processor(_HFLike(), hf_config=cfg, packages=("numpy",)),
        ProcessorFingerprint.from_processor(_Payload(), hf_config=cfg),
    ]
    assert len({base.digest, *(o.digest for o in others)}) == 6
    assert others[3].version == f"numpy=={np.__version__}"


def test_a_processor_without_settings_to_read_is_refused() -> None:
    with pytest.raises(InvalidFingerprintError, match="'object' exposes neither"):
        ProcessorFingerprint.from_processor(object())


@pytest.mark.parametrize(
    ("input_format", "embeddings", "source"),
    [
        ("NORMAL", None, FeatureSource.PROCESSOR),
        ("NORMAL", [], FeatureSource.PROCESSOR),
        ("NORMAL", (), FeatureSource.PROCESSOR),
        ("NORMAL", [object()], FeatureSource.PRECOMPUTED_EMBEDDING),
        ("NORMAL", object(), FeatureSource.PRECOMPUTED_EMBEDDING),
        ("PRECOMPUTED_EMBEDDING", None, FeatureSource.PRECOMPUTED_EMBEDDING),
        ("PROCESSOR_OUTPUT", None, FeatureSource.CALLER_FEATURES),
        ("PROCESSOR_OUTPUT", [object()], FeatureSource.PRECOMPUTED_EMBEDDING),
    ],
)
def test_feature_source_of_an_engine_item(
    input_format: str, embeddings: object, source: FeatureSource
) -> None:
    """Embeddings win; then only the processor's own input format yields PROCESSOR."""
    assert FeatureSource.of_item(input_format, embeddings) is source
