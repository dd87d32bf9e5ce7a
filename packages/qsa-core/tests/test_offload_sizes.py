"""The offload's buffer arithmetic, and the token prices of double sparsity and cache sharding,
each against its formula written out here."""

from __future__ import annotations

import pytest

from qsa_core import (
    WINDOW_LAYERS,
    CapacityError,
    OffloadSizes,
    ds_offload_sizes,
    label_bytes_per_token,
    sharded_token_bytes,
)


def _sizes(**kwargs: object) -> OffloadSizes:
    args: dict[str, object] = {
        "layers": 3,
        "rows": 5,
        "hot_slots": 7,
        "max_blocks": 11,
        "kv_heads": 2,
        "head_dim": 64,
        "element_bytes": 2,
    }
    args.update(kwargs)
    return OffloadSizes(**args)  # type: ignore[arg-type]


def test_an_all_head_record_holds_a_block_of_every_kv_head() -> None:
    """3 layers, 5 rows, 7 slots, 11 blocks, 2 heads of 64 at bf16: a record is 2 KiB."""
    s = _sizes()
    record = 2 * 4 * 2 * 64 * 2
    assert (s.record_heads, s.store_layers, s.record_bytes) == (2, 3, record)
    assert s.max_tokens == 44
    assert s.staging_bytes == 3 * 11 * record
    assert s.cache_bytes == 3 * 5 * (7 + 1) * record
    assert s.table_bytes == 3 * 5 * (7 * 12 + 11 * 4)
    assert s.device_bytes == s.cache_bytes + s.table_bytes
    assert s.arena_bytes() == 5 * 3 * 11 * record == s.verification_bytes
    assert s.arena_bytes(3) == 5 * 3 * 3 * record
    assert s.fixed_device_bytes() == s.staging_bytes + s.cache_bytes + s.table_bytes
    assert s.fixed_device_bytes(verify=True) == s.fixed_device_bytes() + s.arena_bytes()


def test_per_head_records_make_a_record_layer_per_kv_head() -> None:
    """Per-head: 6 record layers of one head each; the same bytes in the arena, twice the
    slots and tails of the hot caches (``hot_slots`` counts one head's slots)."""
    s = _sizes(per_head=True)
    record = 2 * 4 * 1 * 64 * 2
    assert (s.record_heads, s.store_layers, s.record_bytes) == (1, 6, record)
    assert s.staging_bytes == 6 * 11 * record == _sizes().staging_bytes
    assert s.cache_bytes == 6 * 5 * 8 * record
    assert s.table_bytes == 6 * 5 * (7 * 12 + 11 * 4)


def test_a_staging_area_of_several_prompts_holds_each_at_the_longest_context() -> None:
    """Three prompts staged at once: three times one prompt's staging, nothing else changes."""
    one, three = _sizes(), _sizes(staged_prompts=3)
    assert three.staging_bytes == 3 * one.staging_bytes
    assert three.fixed_device_bytes() - one.fixed_device_bytes() == 2 * one.staging_bytes
    assert (three.cache_bytes, three.arena_bytes()) == (one.cache_bytes, one.arena_bytes())
    with pytest.raises(CapacityError, match="staged_prompts=0"):
        _sizes(staged_prompts=0)


def test_for_context_counts_whole_blocks() -> None:
    """4,097 tokens are 1,025 blocks (the last one open)."""
    s = OffloadSizes.for_context(
        layers=1, rows=1, context_len=4097, hot_slots=1, kv_heads=1, head_dim=1, element_bytes=1
    )
    assert s.max_blocks == 1025


def test_ds_offload_keeps_a_hot_cache_no_larger_than_a_context() -> None:
    """Per-head records; 600 hot blocks where a 1,000-token context has 250 blocks: 250."""
    s = ds_offload_sizes(
        layers=2,
        rows=4,
        context_len=1000,
        hot_blocks=600,
        kv_heads=2,
        head_dim=64,
        element_bytes=2,
    )
    assert (s.per_head, s.hot_slots, s.max_blocks, s.store_layers) == (True, 250, 250, 4)
    wide = ds_offload_sizes(
        layers=2,
        rows=4,
        context_len=4096,
        hot_blocks=600,
        kv_heads=2,
        head_dim=64,
        element_bytes=2,
    )
    assert wide.hot_slots == 600


def test_label_rows_and_the_sharded_raw_share_of_a_token() -> None:
    """Labels: layers x heads x channels x element; sharding: index + ceil(raw / N)."""
    assert label_bytes_per_token(28, 4, 16, 2) == 28 * 4 * 16 * 2
    assert sharded_token_bytes(6144, 768, 4) == 768 + 1536
    assert sharded_token_bytes(10, 3, 4) == 3 + 3
    assert sharded_token_bytes(6144, 768, 1) == 6144 + 768


def test_an_index_sharded_by_page_costs_its_share_too() -> None:
    """D2: ceil(index / N) + ceil(raw / N); unsharded (N = 1) the same as without."""
    assert sharded_token_bytes(6144, 768, 4, index_sharded=True) == 192 + 1536
    assert sharded_token_bytes(10, 3, 4, index_sharded=True) == 1 + 3
    assert sharded_token_bytes(6144, 768, 1, index_sharded=True) == 6144 + 768


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"rows": -1}, r"rows=-1 .*>= 0"),
        ({"hot_slots": 0}, r"hot_slots=0 "),
        ({"element_bytes": 1.0}, r"element_bytes=1.0 "),
        ({"per_head": 1}, r"per_head=1 .*True or False"),
    ],
)
def test_a_size_out_of_range_is_refused_by_name(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(CapacityError, match=pattern):
        _sizes(**kwargs)


def test_a_windowed_staging_area_holds_two_layers_of_one_prompt_and_the_open_blocks() -> None:
    """Llama-3.1-8B's shape at 128K: 16 GiB staged whole, 1 GiB (and 512 KiB) windowed."""
    shape: dict[str, int] = {
        "layers": 32,
        "rows": 1,
        "context_len": 131072,
        "hot_blocks": 1023,
        "kv_heads": 8,
        "head_dim": 128,
        "element_bytes": 2,
    }
    whole = ds_offload_sizes(**shape, windowed_staging=False)
    window = ds_offload_sizes(**shape)  # type: ignore[arg-type]
    assert window.windowed_staging
    assert whole.staging_bytes == 32 * 131072 * 8 * 128 * 2 * 2 == 16 << 30
    layer = 131072 * 8 * 128 * 2 * 2  # one layer of one prompt, K and V
    open_blocks = 32 * 8 * whole.record_bytes
    assert window.staging_bytes == WINDOW_LAYERS * layer + open_blocks == (1 << 30) + (512 << 10)
    assert whole.device_bytes == window.device_bytes
    assert whole.fixed_device_bytes() - window.fixed_device_bytes() == (15 << 30) - (512 << 10)


def test_a_windowed_staging_area_holds_one_prompt() -> None:
    """Windowed staging with two prompts, or a flag that is not a bool: refused by name."""
    with pytest.raises(CapacityError, match=r"staged_prompts=2 with windowed_staging"):
        _sizes(staged_prompts=2, windowed_staging=True)
    with pytest.raises(CapacityError, match=r"windowed_staging=1 is not allowed"):
        _sizes(windowed_staging=1)
