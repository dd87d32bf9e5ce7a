"""SGLang's real multimodal items -> qsa-mm-prefix items and page identities; fingerprints of a
real HF processor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from qsa_mm_prefix import (
    Bypass,
    BypassReason,
    InvalidFingerprintError,
    Modality,
    ProcessorFingerprint,
    PromptIdentity,
    content_digest,
)
from qsa_pytest.processes import hang_guard_s
from qsa_sglang_plugin import mm_items_from_sglang, prompt_identity_from_sglang
from qsa_sglang_plugin._adapters._multimodal import PROCESSING_PACKAGES

MERGE = 2
PROCESSOR = ProcessorFingerprint.create("Qwen2VLImageProcessorFast", "test", {"max_pixels": 1024})


@pytest.fixture(scope="module")
def sgl() -> ModuleType:
    """SGLang's schedule-batch module (imported once; its import warns about CPU-only kernels)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.managers import schedule_batch
    module: ModuleType = schedule_batch
    return module


def _pixels(rows: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 12, generator=gen).to(dtype)


def _image(sgl: ModuleType, first: int, last: int, seed: int = 0, **kwargs: Any) -> Any:
    """A real ``MultimodalDataItem`` whose grid agrees with its span under merge size 2."""
    length = last - first + 1
    grid = torch.tensor([[1, MERGE, MERGE * length]])
    fields: dict[str, Any] = {
        "modality": sgl.Modality.IMAGE,
        "offsets": [(first, last)],
        "feature": _pixels(MERGE * MERGE * length, seed),
        "model_specific_data": {"image_grid_thw": grid},
    }
    fields.update(kwargs)
    return sgl.MultimodalDataItem(**fields)


def _req(sgl: ModuleType, num_tokens: int, *items: Any) -> SimpleNamespace:
    mm = sgl.MultimodalInputs(mm_items=list(items)) if items else None
    return SimpleNamespace(origin_input_ids=list(range(num_tokens)), multimodal_inputs=mm)


def _identity(sgl: ModuleType, num_tokens: int, *items: Any) -> PromptIdentity:
    result = prompt_identity_from_sglang(
        _req(sgl, num_tokens, *items), processor=PROCESSOR, spatial_merge_size=MERGE
    )
    assert isinstance(result, PromptIdentity)
    return result


def test_image_item_maps_odd_span_grid_and_bf16_bytes(sgl: ModuleType) -> None:
    """Inclusive offsets (5, 11) give start 5, length 7; bf16 pixels are hashed as their bytes."""
    item = _image(sgl, 5, 11, seed=3)
    items = mm_items_from_sglang(sgl.MultimodalInputs(mm_items=[item]))
    assert not isinstance(items, Bypass)
    (mapped,) = items
    assert (mapped.modality, mapped.start, mapped.length) == (Modality.IMAGE, 5, 7)
    assert mapped.grid == (1, 2, 14)
    assert mapped.dtype == "bfloat16"
    assert mapped.shape == (28, 12)
    expected = item.feature.view(torch.int16).numpy().tobytes()
    assert content_digest(mapped.content) == content_digest(expected)


def test_bf16_and_int16_views_of_same_bytes_get_different_keys(sgl: ModuleType) -> None:
    """The dtype is part of the key: the same bytes read as int16 are another image."""
    bf16 = _image(sgl, 0, 5, seed=1)
    as_int16 = _image(sgl, 0, 5, feature=bf16.feature.view(torch.int16).clone())
    a, b = _identity(sgl, 64, bf16), _identity(sgl, 64, as_int16)
    assert a.image_keys[0].content_digest == b.image_keys[0].content_digest
    assert a.page_identities != b.page_identities


def test_numpy_and_non_contiguous_features_key_like_their_contiguous_tensor(
    sgl: ModuleType,
) -> None:
    """A float32 numpy feature and a transposed view key like the contiguous tensor they equal."""
    base = _pixels(24, 7, torch.float32)
    strided = base.t().contiguous().t()
    assert not strided.is_contiguous()
    keys = {
        _identity(sgl, 70, _image(sgl, 3, 8, feature=f)).page_identities
        for f in (base, strided, base.numpy())
    }
    assert len(keys) == 1


def test_two_images_keep_engine_order_and_straddle_pages(sgl: ModuleType) -> None:
    """Two images in odd spans across page 0/1/2 boundaries; pages after them stay text."""
    first, second = _image(sgl, 37, 99, seed=1), _image(sgl, 101, 140, seed=2)
    ident = _identity(sgl, 300, first, second)
    assert [(k.order, k.start, k.length) for k in ident.image_keys] == [(0, 37, 63), (1, 101, 40)]
    assert [p != b"" for p in ident.page_identities] == [True, True, True, False, False]
    assert len(set(ident.page_identities[:3])) == 3


def test_same_prompt_with_other_image_changes_only_that_images_pages(sgl: ModuleType) -> None:
    """Identical token ids, a different second image: pages of the first image keep identity."""
    a = _identity(sgl, 300, _image(sgl, 10, 40, seed=1), _image(sgl, 150, 200, seed=2))
    b = _identity(sgl, 300, _image(sgl, 10, 40, seed=1), _image(sgl, 150, 200, seed=9))
    assert a.page_identities[0] == b.page_identities[0]
    assert a.page_identities[2] != b.page_identities[2]
    assert a.page_identities[3] != b.page_identities[3]
    assert a.page_identities[4] == b.page_identities[4] == b""


def test_text_prompt_has_only_empty_page_identities(sgl: ModuleType) -> None:
    """A request without multimodal inputs keeps every page's text-only key."""
    ident = _identity(sgl, 129)
    assert ident.page_identities == (b"", b"", b"")


@pytest.mark.parametrize(
    ("build", "reason", "index"),
    [
        (
            lambda s: [_image(s, 0, 9), s.MultimodalDataItem(modality=s.Modality.VIDEO)],
            BypassReason.VIDEO,
            1,
        ),
        (
            lambda s: [s.MultimodalDataItem(modality=s.Modality.AUDIO, offsets=[(0, 3)])],
            BypassReason.AUDIO,
            0,
        ),
        (
            lambda s: [
                s.MultimodalDataItem(
                    modality=s.Modality.IMAGE,
                    offsets=[(0, 3)],
                    format=s.MultimodalInputFormat.PRECOMPUTED_EMBEDDING,
                    precomputed_embeddings=torch.zeros(4, 8),
                )
            ],
            BypassReason.PRECOMPUTED_EMBEDDING,
            0,
        ),
        (
            lambda s: [_image(s, 0, 3, precomputed_embeddings=torch.zeros(4, 8))],
            BypassReason.PRECOMPUTED_EMBEDDING,
            0,
        ),
        (
            lambda s: [_image(s, 0, 3, format=s.MultimodalInputFormat.PROCESSOR_OUTPUT)],
            BypassReason.CALLER_FEATURES,
            0,
        ),
        (
            lambda s: [_image(s, 0, 9), _image(s, 20, 29, offsets=[(20, 24), (40, 44)])],
            BypassReason.MULTI_SPAN,
            1,
        ),
        (lambda s: [_image(s, 0, 3, offsets=None)], BypassReason.NO_SPAN, 0),
        (lambda s: [_image(s, 0, 3, offsets=[])], BypassReason.NO_SPAN, 0),
        (lambda s: [_image(s, 0, 3, offsets=[(9, 4)])], BypassReason.BAD_SPAN, 0),
        (lambda s: [_image(s, 0, 3, offsets=[(-2, 4)])], BypassReason.BAD_SPAN, 0),
        (
            lambda s: [
                _image(s, 0, 3, model_specific_data={"image_grid_thw": torch.ones(2, 3).long()})
            ],
            BypassReason.BAD_GRID,
            0,
        ),
        (
            lambda s: [
                _image(s, 0, 3, model_specific_data={"image_grid_thw": torch.tensor([1, 0, 4])})
            ],
            BypassReason.BAD_GRID,
            0,
        ),
        (lambda s: [_image(s, 0, 3, feature=None)], BypassReason.MISSING_CONTENT, 0),
        (
            lambda s: [_image(s, 0, 3, feature=torch.empty(16, 12, device="meta"))],
            BypassReason.CONTENT_ON_DEVICE,
            0,
        ),
        (
            lambda s: [_image(s, 0, 3, feature=[torch.zeros(16, 12)])],
            BypassReason.UNSUPPORTED_CONTENT,
            0,
        ),
    ],
    ids=[
        "image+video",
        "audio",
        "precomputed-format",
        "precomputed-field",
        "processor-output",
        "multi-span",
        "no-offsets",
        "empty-offsets",
        "reversed-span",
        "negative-start",
        "two-grid-rows",
        "zero-grid",
        "no-feature",
        "device-feature",
        "list-feature",
    ],
)
def test_unidentifiable_items_bypass_with_reason_and_index(
    sgl: ModuleType, build: Any, reason: BypassReason, index: int
) -> None:
    """Each item the adapter cannot identify exactly bypasses the prompt; no item list leaks."""
    req = _req(sgl, 200, *build(sgl))
    got = prompt_identity_from_sglang(req, processor=PROCESSOR)
    assert isinstance(got, Bypass)
    assert (got.reason, got.item_index, got.reusable) == (reason, index, False)
    assert mm_items_from_sglang(req.multimodal_inputs) == got


def test_span_disagreeing_with_grid_is_an_error_not_a_bypass(sgl: ModuleType) -> None:
    """Under merge size 2, a span whose length is not t·h·w/4 is rejected by qsa-mm-prefix."""
    from qsa_mm_prefix import InvalidGridError

    bad = _image(sgl, 0, 9, model_specific_data={"image_grid_thw": torch.tensor([[1, 2, 4]])})
    with pytest.raises(InvalidGridError):
        _identity(sgl, 64, bad)


_CHILD = """
import json, sys
import numpy as np
from qsa_mm_prefix import Modality, MultimodalItem, ProcessorFingerprint, build_prompt_identity
spec = json.loads(sys.argv[1])
items = [
    MultimodalItem(modality=Modality.IMAGE, start=s, length=n, content=bytes.fromhex(raw),
                   grid=tuple(g), dtype="bfloat16", shape=tuple(shape))
    for s, n, raw, g, shape in spec["items"]
]
proc = ProcessorFingerprint.create("Qwen2VLImageProcessorFast", "test", {"max_pixels": 1024})
ident = build_prompt_identity(spec["n"], items, processor=proc, spatial_merge_size=2)
print(json.dumps([p.hex() for p in ident.page_identities]))
"""


def test_same_inputs_in_a_fresh_process_give_the_same_page_identities(sgl: ModuleType) -> None:
    """A process without SGLang or torch, another hash seed, keys the same bytes identically."""
    items = [_image(sgl, 37, 99, seed=1), _image(sgl, 101, 140, seed=2)]
    here = _identity(sgl, 300, *items)
    spec = {
        "n": 300,
        "items": [
            [
                it.offsets[0][0],
                it.offsets[0][1] - it.offsets[0][0] + 1,
                it.feature.view(torch.int16).numpy().tobytes().hex(),
                it.image_grid_thw.reshape(-1).tolist(),
                list(it.feature.shape),
            ]
            for it in items
        ],
    }
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=hang_guard_s(),
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [p.hex() for p in here.page_identities]


def _fingerprint(processor: object, **kwargs: Any) -> ProcessorFingerprint:
    return ProcessorFingerprint.from_processor(processor, packages=PROCESSING_PACKAGES, **kwargs)


@pytest.fixture(scope="module")
def hf_processor_cls(sgl: ModuleType) -> Any:
    """A real HF Qwen2-VL image processor class (constructible offline from its defaults)."""
    del sgl
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import Qwen2VLImageProcessor
    return Qwen2VLImageProcessor


def test_processor_fingerprint_follows_output_changing_settings(hf_processor_cls: Any) -> None:
    """Equal settings fingerprint equally; a resize bound, mean or model type changes it."""
    cfg = {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"]}
    base = _fingerprint(hf_processor_cls(), hf_config=cfg)
    again = _fingerprint(hf_processor_cls(), hf_config=cfg)
    assert base.digest == again.digest
    assert base.name.startswith("transformers.")
    assert base.name.endswith(".Qwen2VLImageProcessor")
    assert "transformers==" in base.version
    assert "sglang==0.5.23" in base.version
    others = [
        _fingerprint(hf_processor_cls(merge_size=4), hf_config=cfg),
        _fingerprint(hf_processor_cls(image_mean=[0.5] * 3), hf_config=cfg),
        _fingerprint(hf_processor_cls(), hf_config={**cfg, "model_type": "qwen2_vl"}),
        _fingerprint(hf_processor_cls(), hf_config=cfg, extra={"rev": "b"}),
    ]
    assert len({base.digest, *(o.digest for o in others)}) == 5


def test_processor_payload_is_preferred_and_must_be_canonical() -> None:
    """SGLang's ``preprocess_fingerprint_payload`` is used; an object without one is refused."""

    class Payload:
        def __init__(self, payload: object) -> None:
            self.payload = payload

        def preprocess_fingerprint_payload(self) -> object:
            return self.payload

    a = _fingerprint(Payload({"image_config": {"max_pixels": 10}}))
    b = _fingerprint(Payload({"image_config": {"max_pixels": 11}}))
    c = _fingerprint(Payload({"dtype": torch.bfloat16, "t": (1, 2)}))
    assert len({a.digest, b.digest, c.digest}) == 3
    with pytest.raises(InvalidFingerprintError, match="exposes neither"):
        _fingerprint(object())
    with pytest.raises(InvalidFingerprintError, match="setting key 1 at 'processor' is not a str"):
        _fingerprint(Payload({1: "x"}))
