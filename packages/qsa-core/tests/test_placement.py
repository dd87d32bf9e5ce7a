"""Shard placement: owners, local/global round trips, widened capacity and per-rank counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_core import QWEN38_FLASH_NEXT, PlacementError, QSAConfigError, ShardPlacement

_placements = st.builds(
    ShardPlacement,
    world_size=st.integers(1, 8),
    blocks_per_page=st.integers(1, 17),
    compress_ratio=st.integers(2, 8),
)


@settings(max_examples=300, deadline=None)
@given(placement=_placements, slot=st.integers(0, 10**7))
def test_raw_slot_round_trips(placement: ShardPlacement, slot: int) -> None:
    """Every raw slot maps to (owner, local) and back exactly; owner is token-interleaved."""
    owner, local = placement.raw_owner(slot), placement.raw_local(slot)
    assert 0 <= owner < placement.world_size
    assert placement.raw_global(owner, local) == slot
    assert owner == slot % placement.world_size


@settings(max_examples=300, deadline=None)
@given(placement=_placements, block=st.integers(0, 10**7))
def test_compressed_block_round_trips_and_pages_share_an_owner(
    placement: ShardPlacement, block: int
) -> None:
    """Blocks round-trip; every block of one page has that page's owner."""
    owner, local = placement.block_owner(block), placement.block_local(block)
    assert placement.block_global(owner, local) == block
    page = block // placement.blocks_per_page
    assert owner == placement.page_owner(page)
    first = page * placement.blocks_per_page
    assert {placement.block_owner(b) for b in range(first, first + placement.blocks_per_page)} == {
        owner
    }


@settings(max_examples=100, deadline=None)
@given(placement=_placements, local_capacity=st.integers(0, 300))
def test_local_slots_of_every_rank_tile_the_widened_space(
    placement: ShardPlacement, local_capacity: int
) -> None:
    """The local slots of all ranks map one-to-one onto the allocator's widened slot space."""
    n = placement.world_size
    logical = placement.logical_capacity(local_capacity)
    seen = sorted(
        placement.raw_global(r, local) for r in range(n) for local in range(local_capacity)
    )
    assert seen == list(range(logical))
    assert placement.local_capacity(logical) == local_capacity


@settings(max_examples=200, deadline=None)
@given(placement=_placements, count=st.integers(0, 500))
def test_per_rank_counts_match_enumeration(placement: ShardPlacement, count: int) -> None:
    """Counts of owned slots and blocks per rank equal a direct count and sum to the total."""
    n = placement.world_size
    for rank in range(n):
        assert placement.raw_slots_on_rank(count, rank) == sum(
            1 for s in range(count) if placement.raw_owner(s) == rank
        )
        assert placement.blocks_on_rank(count, rank) == sum(
            1 for b in range(count) if placement.block_owner(b) == rank
        )
    assert sum(placement.blocks_on_rank(count, r) for r in range(n)) == count
    assert placement.bytes_per_rank(count, 2048) == -(-count // n) * 2048


def test_qwen_tp8_shard_groups_lie_inside_a_replica_group() -> None:
    """At TP8 with 2 KV heads, shard groups of 1, 2 and 4 ranks are allowed and 8 is not."""
    for size in (1, 2, 4):
        placement = ShardPlacement.for_tp(QWEN38_FLASH_NEXT, 8, size)
        assert placement.world_size == size
        assert placement.blocks_per_page == 16
    with pytest.raises(PlacementError, match=r"sharding_size=8 .*allowed: \[1, 2, 4\]"):
        ShardPlacement.for_tp(QWEN38_FLASH_NEXT, 8, 8)
    with pytest.raises(PlacementError, match=r"allowed: \[1\]"):
        ShardPlacement.for_tp(QWEN38_FLASH_NEXT, 2, 2)
    with pytest.raises(QSAConfigError, match="tp_size=3"):
        ShardPlacement.for_tp(QWEN38_FLASH_NEXT, 3, 1)


def test_tp_shard_groups_partition_each_kv_heads_replica_group() -> None:
    """At TP8 with 2 KV heads (ranks 0-3 hold head 0, 4-7 head 1), groups never mix heads."""
    assert ShardPlacement.tp_groups(QWEN38_FLASH_NEXT, 8, 4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert ShardPlacement.tp_groups(QWEN38_FLASH_NEXT, 8, 2) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert ShardPlacement.tp_groups(QWEN38_FLASH_NEXT, 4, 1) == ((0,), (1,), (2,), (3,))
    for tp, n in ((8, 4), (8, 2), (4, 2)):
        replicas = QWEN38_FLASH_NEXT.kv_replicas(tp)
        for group in ShardPlacement.tp_groups(QWEN38_FLASH_NEXT, tp, n):
            assert len({rank // replicas for rank in group}) == 1  # one K/V head per group
    with pytest.raises(PlacementError, match=r"sharding_size=2 .*allowed: \[1\]"):
        ShardPlacement.tp_groups(QWEN38_FLASH_NEXT, 2, 2)


def test_attention_cp_over_the_tp_group_makes_every_rank_a_replica() -> None:
    """Under CP-TP group sharing (attention TP 1) every rank holds both KV heads: at TP2 a
    group of 2 is allowed (it is not without CP), and the groups are runs of the TP ranks."""
    assert ShardPlacement.kv_replica_ranks(QWEN38_FLASH_NEXT, 2, attn_cp_size=2) == 2
    assert ShardPlacement.for_tp(QWEN38_FLASH_NEXT, 2, 2, attn_cp_size=2).world_size == 2
    assert ShardPlacement.tp_groups(QWEN38_FLASH_NEXT, 8, 4, attn_cp_size=8) == (
        (0, 1, 2, 3),
        (4, 5, 6, 7),
    )
    assert ShardPlacement.tp_groups(QWEN38_FLASH_NEXT, 4, 4, attn_cp_size=4) == ((0, 1, 2, 3),)
    with pytest.raises(PlacementError, match=r"sharding_size=3 .*attn_cp_size=4.*\[1, 2, 4\]"):
        ShardPlacement.for_tp(QWEN38_FLASH_NEXT, 4, 3, attn_cp_size=4)
    with pytest.raises(PlacementError, match=r"attn_cp_size=2 .*tp_size=4; allowed: 1 or 4"):
        ShardPlacement.for_tp(QWEN38_FLASH_NEXT, 4, 2, attn_cp_size=2)


def test_bad_arguments_are_rejected() -> None:
    """Negative slots, out-of-range ranks and empty groups raise with the allowed range."""
    placement = ShardPlacement(4, 16, 4)
    with pytest.raises(PlacementError, match="slot=-1"):
        placement.raw_owner(-1)
    with pytest.raises(PlacementError, match=r"rank=4 .*allowed: 0..3"):
        placement.raw_global(4, 0)
    with pytest.raises(PlacementError, match="world_size=0"):
        ShardPlacement(0, 16, 4)
    assert placement.block_of_slot(4 * 37 + 3) == 37
