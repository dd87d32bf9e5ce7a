"""The price an engine's pool sizing charges under each feature, against its formula."""

from __future__ import annotations

import pytest

from qsa_core import CapacityError, OffloadSizes, PoolPrice, ds_offload_sizes

#: A resident token of 6,912 B: 6,144 B of raw K/V and 768 B of index and state.
RESIDENT, INDEX = 6912, 768


def _sizes() -> OffloadSizes:
    return OffloadSizes.for_context(
        layers=3, rows=5, context_len=44, hot_slots=7, kv_heads=2, head_dim=64, element_bytes=2
    )


def test_an_offloaded_token_costs_its_index_and_the_offloads_buffers_are_fixed() -> None:
    """Staging, hot caches, tails and tables are fixed; verification adds the arena's copy."""
    sizes = _sizes()
    price = PoolPrice.offloaded(sizes, resident_token_bytes=RESIDENT, index_token_bytes=INDEX)
    assert (price.token_bytes, price.fixed_bytes) == (INDEX, sizes.fixed_device_bytes())
    assert price.detail.startswith(f"pool sizing charges {INDEX} B per token (was {RESIDENT} B")
    verified = PoolPrice.offloaded(
        sizes, resident_token_bytes=RESIDENT, index_token_bytes=INDEX, verify=True
    )
    assert verified.fixed_bytes == price.fixed_bytes + sizes.arena_bytes()


def test_a_sharded_token_costs_its_index_and_its_share_of_the_raw_kv() -> None:
    """Over four ranks: 768 B of index plus a quarter of 6,144 B; transport is fixed."""
    price = PoolPrice.sharded(
        resident_token_bytes=RESIDENT,
        index_token_bytes=INDEX,
        sharding_size=4,
        transport_bytes=1 << 20,
    )
    assert (price.token_bytes, price.fixed_bytes) == (INDEX + 1536, 1 << 20)
    assert "6144 B of raw K/V over 4 ranks, 768 B of index and state" in price.detail
    assert price.detail.endswith("plus 1.000 MiB of transport buffers")


def test_a_token_of_a_page_sharded_index_costs_a_share_of_its_index() -> None:
    """D2 over four ranks: a quarter of 768 B of index and a quarter of 6,144 B of raw K/V."""
    price = PoolPrice.sharded(
        resident_token_bytes=RESIDENT,
        index_token_bytes=INDEX,
        sharding_size=4,
        transport_bytes=1 << 20,
        index_sharded=True,
    )
    assert price.token_bytes == INDEX // 4 + 1536
    assert "768 B of index over 4 ranks" in price.detail


def test_an_offloaded_token_of_a_page_sharded_index_costs_a_share_of_its_index() -> None:
    """D2 with the offload over four ranks: a quarter of 768 B per token; the index's candidate
    buffers are fixed beside the offload's own."""
    sizes = _sizes()
    price = PoolPrice.offloaded(
        sizes,
        resident_token_bytes=RESIDENT,
        index_token_bytes=INDEX,
        index_ranks=4,
        index_buffer_bytes=1 << 20,
    )
    assert (price.token_bytes, price.fixed_bytes) == (
        INDEX // 4,
        sizes.fixed_device_bytes() + (1 << 20),
    )
    assert "768 B of index over 4 ranks" in price.detail
    assert price.detail.endswith("and 1.000 MiB of index candidate buffers")
    with pytest.raises(CapacityError, match=r"index_buffer_bytes=1 .*index_ranks=1"):
        PoolPrice.offloaded(
            sizes, resident_token_bytes=RESIDENT, index_token_bytes=INDEX, index_buffer_bytes=1
        )
    with pytest.raises(CapacityError, match=r"index_ranks=0"):
        PoolPrice.offloaded(
            sizes, resident_token_bytes=RESIDENT, index_token_bytes=INDEX, index_ranks=0
        )


def test_labels_add_to_a_resident_token_and_are_all_it_costs_with_ds_offload() -> None:
    """Resident K/V: K/V plus labels, nothing fixed; DS-Offload: labels, the offload fixed."""
    resident = PoolPrice.labelled(kv_token_bytes=1024, label_token_bytes=256)
    assert (resident.token_bytes, resident.fixed_bytes) == (1280, 0)
    assert (
        resident.detail
        == "pool sizing charges 1280 B per token (1024 B of K/V and 256 B of labels)"
    )
    sizes = ds_offload_sizes(
        layers=2, rows=4, context_len=4096, hot_blocks=64, kv_heads=2, head_dim=64, element_bytes=2
    )
    offloaded = PoolPrice.labelled(kv_token_bytes=1024, label_token_bytes=256, offload=sizes)
    assert (offloaded.token_bytes, offloaded.fixed_bytes) == (256, sizes.fixed_device_bytes())
    assert offloaded.detail.startswith("DS-Offload: pool sizing charges 256 B per token of labels")


def test_a_byte_count_out_of_range_is_refused_by_name() -> None:
    """A negative count, an index dearer than the whole token, no ranks: each named."""
    with pytest.raises(CapacityError, match=r"kv_token_bytes=-1 "):
        PoolPrice.labelled(kv_token_bytes=-1, label_token_bytes=2)
    with pytest.raises(CapacityError, match=r"raw_bytes=-6144 "):
        PoolPrice.sharded(
            resident_token_bytes=INDEX,
            index_token_bytes=RESIDENT,
            sharding_size=2,
            transport_bytes=0,
        )
    with pytest.raises(CapacityError, match=r"sharding_size=0 "):
        PoolPrice.sharded(
            resident_token_bytes=RESIDENT,
            index_token_bytes=INDEX,
            sharding_size=0,
            transport_bytes=0,
        )


def test_the_index_sharded_alone_divides_only_the_index() -> None:
    """D2 without D1: a token keeps its raw K/V and pays ``ceil(index / N)``; the candidate
    buffers are the fixed bytes."""
    price = PoolPrice.index_sharded(
        resident_token_bytes=6144 + 770, index_token_bytes=770, index_ranks=4,
        index_buffer_bytes=4096,
    )  # fmt: skip
    assert (price.token_bytes, price.fixed_bytes) == (6144 + 193, 4096)
    assert "770 B of index over 4 ranks" in price.detail
    with pytest.raises(CapacityError, match="index_ranks=0"):
        PoolPrice.index_sharded(
            resident_token_bytes=10, index_token_bytes=3, index_ranks=0, index_buffer_bytes=0
        )
