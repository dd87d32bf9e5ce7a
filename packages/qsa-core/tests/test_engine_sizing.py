"""An engine's serving flags as a capacity plan, and double sparsity's price on one rank."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from qsa_core import (
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    CapacityError,
    KVDType,
    LabelledCapacity,
    PlanInputs,
    PoolPrice,
    QSAConfigError,
    QSAProfile,
    ds_offload_sizes,
    label_bytes_per_token,
    labelled_capacity,
    plan_capacity,
)

GIB = 1 << 30


def test_flags_resolve_to_the_plan_plan_capacity_prints_for_them() -> None:
    """TP2, fp8, 8 x 262,144 tokens, two staged prompts: the same plan as the direct call."""
    inputs = PlanInputs.from_flags(
        QWEN38_FLASH_NEXT_TEXT_CONFIG,
        tp_size=2,
        kv_cache_dtype="fp8_e4m3",
        context_length=262_144,
        max_running_requests=8,
        prefill_max_requests=2,
    )
    profile = QSAProfile.from_text_config(QWEN38_FLASH_NEXT_TEXT_CONFIG)
    assert inputs == PlanInputs(profile, 2, KVDType.FP8_E4M3, 262_144, 8, 2)
    expected = plan_capacity(
        profile,
        tp_size=2,
        kv_dtype=KVDType.FP8_E4M3,
        gpu_budget_bytes=9 * GIB,
        host_budget_bytes=12 * GIB,
        context_len=262_144,
        num_requests=8,
        staged_prompts=2,
    )
    assert inputs.plan(9 * GIB, 12 * GIB) == expected


def test_unset_flags_take_the_configs_context_bf16_and_one_staged_prompt() -> None:
    """``auto`` is bf16; no context length: ``max_position_embeddings``; no prefill limit: 1."""
    inputs = PlanInputs.from_flags(
        QWEN38_FLASH_NEXT_TEXT_CONFIG, tp_size=1, max_running_requests=1, page_size=32
    )
    assert inputs.kv_dtype is KVDType.BF16
    assert inputs.context_len == QSAProfile.config_context_len(QWEN38_FLASH_NEXT_TEXT_CONFIG)
    assert (inputs.staged_prompts, inputs.profile.page_size) == (1, 32)


def test_query_heads_per_rank_split_over_tp_and_never_fall_below_one() -> None:
    """Query heads over TP ranks, at least one a rank."""
    heads = QSAProfile.from_text_config(QWEN38_FLASH_NEXT_TEXT_CONFIG).num_attention_heads
    for tp, expected in ((1, heads), (2, heads // 2), (2 * heads, 1)):
        inputs = PlanInputs.from_flags(
            QWEN38_FLASH_NEXT_TEXT_CONFIG, tp_size=tp, max_running_requests=1
        )
        assert inputs.q_heads_per_rank == expected


class _HFConfig:
    """An HF-style config object: its fields through ``to_dict()``."""

    def __init__(self, fields: Mapping[str, object]) -> None:
        self._fields = fields

    def to_dict(self) -> dict[str, object]:
        return dict(self._fields)


def test_parsed_flags_are_read_by_name_and_absent_ones_take_from_flags_defaults() -> None:
    """``from_args`` reads the flags' attributes (absent or None: the default) of any object."""
    args = SimpleNamespace(
        tp_size=2, kv_cache_dtype="fp8_e4m3", context_length=262_144, max_running_requests=8
    )
    expected = PlanInputs.from_flags(
        QWEN38_FLASH_NEXT_TEXT_CONFIG,
        tp_size=2,
        kv_cache_dtype="fp8_e4m3",
        context_length=262_144,
        max_running_requests=8,
    )
    assert PlanInputs.from_args(QWEN38_FLASH_NEXT_TEXT_CONFIG, args) == expected
    assert PlanInputs.from_args(_HFConfig(QWEN38_FLASH_NEXT_TEXT_CONFIG), args) == expected
    staged = SimpleNamespace(tp_size=1, max_running_requests=2, prefill_max_requests=3)
    inputs = PlanInputs.from_args(QWEN38_FLASH_NEXT_TEXT_CONFIG, staged)
    assert (inputs.kv_dtype, inputs.num_requests, inputs.staged_prompts) == (KVDType.BF16, 2, 3)


def test_a_config_that_is_neither_an_hf_config_nor_a_mapping_is_refused_by_type() -> None:
    """A config without ``to_dict`` that is no mapping is named by its type."""
    args = SimpleNamespace(tp_size=1, max_running_requests=1)
    with pytest.raises(QSAConfigError, match="HF text config or a mapping, got <class 'list'>"):
        PlanInputs.from_args([], args)


def test_a_transport_callable_is_asked_for_the_plans_own_figures_only_when_sharded() -> None:
    """With sharding the callable gets the plan's rows, heads and top-k; without, it is unused."""
    inputs = PlanInputs.from_flags(
        QWEN38_FLASH_NEXT_TEXT_CONFIG, tp_size=4, context_length=4096, max_running_requests=3
    )
    calls: list[dict[str, object]] = []

    def transport(**figures: Any) -> int:
        calls.append(figures)
        return 12_345

    unsharded = inputs.plan(GIB, GIB, transport_bytes=transport)
    assert calls == []
    assert unsharded == inputs.plan(GIB, GIB)
    sharded = inputs.plan(GIB, GIB, sharding_size=2, index_sharded=True, transport_bytes=transport)
    assert calls == [
        {
            "world_size": 2,
            "max_rows": 3,
            "block_topk": inputs.profile.block_topk,
            "q_heads": inputs.q_heads_per_rank,
            "head_dim": inputs.profile.head_dim,
            "index_sharded": True,
        }
    ]
    expected = inputs.plan(GIB, GIB, sharding_size=2, index_sharded=True, transport_bytes=12_345)
    assert sharded == expected


def test_an_index_buffer_callable_is_asked_only_for_a_sharded_index() -> None:
    """With D2 over a shard group the callable gets the plan's requests and top-k, and its bytes
    are the offloaded layout's fixed candidate buffers; without D2 it is unused."""
    inputs = PlanInputs.from_flags(
        QWEN38_FLASH_NEXT_TEXT_CONFIG, tp_size=4, context_length=4096, max_running_requests=3
    )
    calls: list[dict[str, object]] = []

    def candidates(**figures: Any) -> int:
        calls.append(figures)
        return 4_096

    d1 = inputs.plan(GIB, GIB, sharding_size=2, index_buffer_bytes=candidates)
    assert calls == []
    assert d1 == inputs.plan(GIB, GIB, sharding_size=2)
    d2 = inputs.plan(GIB, GIB, sharding_size=2, index_sharded=True, index_buffer_bytes=candidates)
    assert calls == [{"world_size": 2, "block_topk": inputs.profile.block_topk, "max_running": 3}]
    assert d2 == inputs.plan(
        GIB, GIB, sharding_size=2, index_sharded=True, index_buffer_bytes=4_096
    )
    assert d2.offloaded_price.fixed_bytes == d1.offloaded_price.fixed_bytes + 4_096


NO_CONTEXT = {
    key: value
    for key, value in QWEN38_FLASH_NEXT_TEXT_CONFIG.items()
    if key != "max_position_embeddings"
}
QWEN = QWEN38_FLASH_NEXT_TEXT_CONFIG


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        ({"num_attention_heads": 8}, {"max_running_requests": 1}, "num_hidden_layers"),
        (QWEN, {"kv_cache_dtype": "int4", "max_running_requests": 1}, "int4"),
        (QWEN, {}, "max_running_requests=None"),
        (NO_CONTEXT, {"max_running_requests": 1}, "context_length=None and the config's max_"),
        (QWEN, {"context_length": "8k", "max_running_requests": 1}, r"context_length='8k';"),
    ],
)
def test_flags_without_a_profile_dtype_context_or_request_count_are_refused_by_name(
    config: dict[str, object], flags: dict[str, object], message: str
) -> None:
    """Each missing or unknown value raises QSAConfigError naming it."""
    with pytest.raises(QSAConfigError, match=message):
        PlanInputs.from_flags(config, tp_size=1, **flags)  # type: ignore[arg-type]


def _capacity(**options: Any) -> LabelledCapacity:
    """:func:`labelled_capacity` of 4 layers x 2 KV heads x 64 dims, 8 channels, bf16."""
    return labelled_capacity(
        layers=4,
        kv_heads=2,
        head_dim=64,
        heavy_channels=8,
        kv_element_bytes=2,
        label_element_bytes=2,
        **options,
    )


def test_resident_labels_add_to_the_kv_of_the_geometry_or_the_engines_own_price() -> None:
    """K/V: layers x 2 x heads x dim x element; labels: layers x heads x channels x element."""
    capacity = _capacity()
    kv, labels = 4 * 2 * 2 * 64 * 2, label_bytes_per_token(4, 2, 8, 2)
    assert (capacity.kv_heads, capacity.kv_token_bytes, capacity.label_token_bytes) == (
        2,
        kv,
        labels,
    )
    assert capacity.price == PoolPrice.labelled(kv_token_bytes=kv, label_token_bytes=labels)
    engine = _capacity(kv_token_bytes=5000)
    assert engine.price is not None
    assert (engine.kv_token_bytes, engine.price.token_bytes) == (5000, 5000 + labels)


def test_ds_offload_charges_labels_and_fixes_its_buffers_for_rows_of_a_context() -> None:
    """DS-Offload: the labels per token, ``ds_offload_sizes``' buffers fixed (verify: + arena)."""
    sizes = ds_offload_sizes(
        layers=4, rows=3, context_len=100, hot_blocks=16, kv_heads=2, head_dim=64, element_bytes=2
    )
    for verify in (False, True):
        capacity = _capacity(offload_hot_blocks=16, rows=3, context_len=100, verify=verify)
        assert capacity.price is not None
        assert capacity.price.token_bytes == capacity.label_token_bytes
        assert capacity.price.fixed_bytes == sizes.fixed_device_bytes(verify=verify)


def test_ds_offload_without_rows_has_no_price_and_with_rows_needs_a_context() -> None:
    """No request count: the buffers are unsized (price None); rows and no context: refused."""
    assert _capacity(offload_hot_blocks=16).price is None
    with pytest.raises(CapacityError, match=r"context_len=None with DS-Offload of rows=3"):
        _capacity(offload_hot_blocks=16, rows=3)
