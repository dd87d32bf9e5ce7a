"""QSAProfile parsing, validation and derived figures."""

from __future__ import annotations

import re

import pytest

from qsa_core import (
    QWEN38_FLASH_NEXT,
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    KVDType,
    QSAConfigError,
    QSAProfile,
)


def _cfg(**overrides: object) -> dict[str, object]:
    cfg = dict(QWEN38_FLASH_NEXT_TEXT_CONFIG)
    cfg.update(overrides)
    return cfg


def test_preset_has_the_checkpoint_geometry() -> None:
    """The preset carries the Qwen3.8-Flash-Next values from the checkpoint config."""
    p = QWEN38_FLASH_NEXT
    assert (p.index_n_heads, p.index_kv_heads, p.index_head_dim) == (4, 1, 128)
    assert (p.budget, p.compress_ratio, p.block_topk) == (2048, 4, 512)
    assert (p.num_attention_heads, p.num_kv_heads, p.head_dim) == (24, 2, 256)
    assert p.qsa_layer_ids == tuple(range(3, 48, 4))
    assert p.num_qsa_layers == 12
    assert p.num_linear_layers == 36
    assert p.page_size == 64
    assert p.blocks_per_page == 16
    assert p.selection_width == 2051
    assert p.ple_layer_ids == (1,)


def test_layer_types_and_interval_give_the_same_layers() -> None:
    """An explicit ``layer_types`` list (any QSA spelling) equals the interval rule."""
    kinds = [
        ("qwen_sparse_attention" if i % 2 else "full_attention")
        if i % 4 == 3
        else "linear_attention"
        for i in range(48)
    ]
    cfg = _cfg(layer_types=kinds)
    del cfg["full_attention_interval"]
    assert QSAProfile.from_text_config(cfg) == QWEN38_FLASH_NEXT


def test_nested_text_config_is_accepted() -> None:
    """A top-level config with the fields under ``text_config`` parses to the same profile."""
    top = {"architectures": ["Qwen4ExpForConditionalGeneration"], "text_config": _cfg()}
    assert QSAProfile.from_text_config(top) == QWEN38_FLASH_NEXT


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    """Without ``head_dim`` the attention head dim is ``hidden_size // num_attention_heads``."""
    cfg = _cfg(hidden_size=3072)
    del cfg["head_dim"]
    assert QSAProfile.from_text_config(cfg).head_dim == 128


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"indexer_kv_heads": 2}, r"index_kv_heads=2 .*allowed: 1"),
        ({"indexer_compress_ratio": 1, "indexer_budget": 512}, r"compress_ratio=1 .*>= 2"),
        ({"indexer_budget": 2050}, r"budget=2050 is not divisible by compress_ratio=4"),
        ({"indexer_budget": 1024}, r"block_topk=.*256.*allowed: \[512, 2048\]"),
        ({"indexer_n_heads": 0}, r"index_n_heads=0 .*positive"),
        ({"num_key_value_heads": 5}, r"num_attention_heads=24 is not a multiple of num_kv_heads=5"),
        ({"indexer_head_dim": "128"}, r"indexer_head_dim='128' .*integer"),
        ({"ple_layer_ids": [0]}, r"ple_layer_ids\[0\]=0 .*one-indexed"),
        ({"full_attention_interval": 0}, r"full_attention_interval=0"),
    ],
)
def test_invalid_fields_are_named_with_value_and_allowed(
    overrides: dict[str, object], pattern: str
) -> None:
    """Each rejected field is named in the error with its value and what is allowed."""
    with pytest.raises(QSAConfigError, match=pattern):
        QSAProfile.from_text_config(_cfg(**overrides))


def test_missing_field_is_named() -> None:
    """A missing required field raises an error that names it."""
    cfg = _cfg()
    del cfg["indexer_budget"]
    with pytest.raises(QSAConfigError, match=re.escape("'indexer_budget' is missing")):
        QSAProfile.from_text_config(cfg)


@pytest.mark.parametrize("page_size", [1, 62, 66])
def test_page_size_must_be_a_multiple_of_the_ratio(page_size: int) -> None:
    """Page sizes that are 1 or not a multiple of the ratio are rejected."""
    with pytest.raises(QSAConfigError, match=f"page_size={page_size}"):
        QSAProfile.from_text_config(_cfg(), page_size=page_size)


def test_block_topk_2048_and_ratio_8_are_accepted() -> None:
    """The other supported width (2048 blocks) and a ratio of 8 with page 128 validate."""
    p = QSAProfile.from_text_config(
        _cfg(indexer_budget=16384, indexer_compress_ratio=8), page_size=128
    )
    assert (p.block_topk, p.blocks_per_page) == (2048, 16)
    assert p.compressed_slot(8 * 37 + 7) == 37


@pytest.mark.parametrize(("tp", "heads"), [(1, 2), (2, 1), (4, 1), (8, 1)])
def test_kv_heads_per_rank_replicates_beyond_kv_heads(tp: int, heads: int) -> None:
    """TP above the KV head count keeps one (replicated) head per rank."""
    assert QWEN38_FLASH_NEXT.kv_heads_per_rank(tp) == heads
    assert QWEN38_FLASH_NEXT.kv_replicas(tp) == max(1, tp // 2)


@pytest.mark.parametrize("tp", [0, 3, 5])
def test_kv_heads_per_rank_rejects_uneven_tp(tp: int) -> None:
    """TP sizes that split the heads unevenly (or are not positive) are rejected."""
    with pytest.raises(QSAConfigError, match=f"tp_size={tp}"):
        QWEN38_FLASH_NEXT.kv_heads_per_rank(tp)


def test_bytes_per_block_matches_reference() -> None:
    """One 4-token block of one layer is 2 KiB per rank at TP2 FP8 and 8 KiB at TP1 BF16."""
    p = QWEN38_FLASH_NEXT
    assert p.bytes_per_block(KVDType.FP8_E4M3, 2) == 2048
    assert p.bytes_per_block(KVDType.BF16, 2) == 4096
    assert p.bytes_per_block(KVDType.BF16, 1) == 8192
    assert p.bytes_per_block(KVDType.FP8_E4M3, 8) == 2048


def test_per_token_bytes_match_reference() -> None:
    """Raw K/V and index bytes per token equal the reference table."""
    p = QWEN38_FLASH_NEXT
    assert p.raw_kv_bytes_per_token(KVDType.BF16, 1) == 24576
    assert p.raw_kv_bytes_per_token(KVDType.BF16, 2) == 12288
    assert p.raw_kv_bytes_per_token(KVDType.FP8_E4M3, 2) == 6144
    assert p.index_bytes_per_token(KVDType.BF16) == 768
    assert p.index_bytes_per_token(KVDType.FP8_E4M3) == 384


def test_compressed_slot_is_floor_division() -> None:
    """A full slot maps to ``slot // ratio``; negative slots are rejected."""
    assert [QWEN38_FLASH_NEXT.compressed_slot(s) for s in (0, 3, 4, 7, 8, 262143)] == [
        0,
        0,
        1,
        1,
        2,
        65535,
    ]
    with pytest.raises(QSAConfigError, match="full_slot=-1"):
        QWEN38_FLASH_NEXT.compressed_slot(-1)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("bf16", KVDType.BF16), ("auto", KVDType.BF16), ("FP8_E4M3", KVDType.FP8_E4M3)],
)
def test_kv_dtype_parses_flag_spellings(name: str, dtype: KVDType) -> None:
    """SGLang's dtype spellings map onto the enum; itemsize follows."""
    assert KVDType.parse(name) is dtype
    assert dtype.itemsize == (2 if dtype is KVDType.BF16 else 1)


def test_kv_dtype_spellings_come_from_the_enum() -> None:
    """The SGLang flag values and torch names of each dtype are the enum's, and parse takes them."""
    assert KVDType.sglang_flag_values() == ("auto", "bf16", "bfloat16", "fp8_e4m3")
    assert [d.torch_name for d in KVDType] == ["bfloat16", "float8_e4m3fn"]
    for dtype in KVDType:
        for name in (*dtype.sglang_names, dtype.torch_name):
            assert KVDType.parse(name) is dtype


def test_kv_dtype_rejects_unknown_names() -> None:
    """An unknown dtype name lists the allowed ones."""
    with pytest.raises(QSAConfigError, match="'int4' is not supported; allowed"):
        KVDType.parse("int4")


def test_profile_is_frozen() -> None:
    """A profile cannot be changed after validation."""
    with pytest.raises(AttributeError):
        QWEN38_FLASH_NEXT.budget = 1024  # type: ignore[misc]


def test_config_context_len_reads_the_text_config_when_there_is_one() -> None:
    """``max_position_embeddings``, under ``text_config`` when the config has one; else None."""
    assert QSAProfile.config_context_len({"max_position_embeddings": 4096}) == 4096
    nested = {"max_position_embeddings": 1, "text_config": {"max_position_embeddings": 8192}}
    assert QSAProfile.config_context_len(nested) == 8192
    assert QSAProfile.config_context_len({"text_config": {}}) is None
    assert QSAProfile.config_context_len({"text_config": None}) is None
    assert QSAProfile.config_context_len({}) is None
