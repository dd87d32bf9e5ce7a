"""``ShardedIndex`` on one rank: its selection is ``indexer_topk_reference``'s in candidate groups,
its writes are the owned-write rule. The 2- and 4-rank runs through SGLang's indexer are
``qsa-sglang-plugin``'s ``test_sharded_index.py``."""

from __future__ import annotations

import pytest
import torch

from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement
from qsa_kernels import KernelInputError, KernelPath
from qsa_kernels.indexer_topk import indexer_topk_reference
from qsa_kernels.sharded import IndexShard, ShardedIndex, ShardGroup, ZerosOnMeta

BPP, RATIO = QWEN38_FLASH_NEXT.blocks_per_page, QWEN38_FLASH_NEXT.compress_ratio


def _index(max_rows: int, topk: int = 8) -> ShardedIndex:
    shard = ShardGroup(ShardPlacement(1, BPP, RATIO), 0)
    return ShardedIndex(
        shard, block_topk=topk, max_rows=max_rows, device="cpu", path=KernelPath.REFERENCE
    )


def test_selection_in_candidate_groups_equals_the_single_rank_top_k() -> None:
    """Seven rows in groups of three: each row's set is the reference's, ``-1`` padded alike."""
    gen = torch.Generator().manual_seed(7)
    pages = torch.randperm(12, generator=gen)[:6].int()
    table = pages.expand(7, -1).contiguous()
    cache = (torch.randint(-128, 129, (12, BPP, 128), generator=gen) / 64).to(torch.bfloat16)
    q = (torch.randint(0, 129, (7, 4, 128), generator=gen) / 64).to(torch.bfloat16)
    seq_lens = torch.tensor([5, 40, 64, 100, 250, 383, 384])
    got = _index(max_rows=3).select(q, cache, table, seq_lens)
    want = indexer_topk_reference(q, cache, table, seq_lens, topk=8)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


def test_writes_keep_owned_blocks_and_drop_padding() -> None:
    """One rank owns every page: blocks land at their slots; negative slots land nowhere."""
    local = torch.zeros((3, BPP, 128), dtype=torch.bfloat16)
    rows = torch.arange(3 * 128, dtype=torch.float32).view(3, 128).to(torch.bfloat16)
    _index(max_rows=1).write(local, torch.tensor([17, -1, 40]), rows)
    flat = local.view(-1, 128)
    assert torch.equal(flat[17], rows[0])
    assert torch.equal(flat[40], rows[2])
    assert int((flat.float().abs().sum(dim=1) > 0).sum()) == 2


def test_rows_that_do_not_match_the_queries_are_refused_by_shape() -> None:
    index = _index(max_rows=2)
    q = torch.zeros((2, 4, 128), dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"page_table must be \[B=2, P\]"):
        index.select(q, torch.zeros((1, BPP, 128)), torch.zeros((3, 1)), torch.zeros(2))


def test_the_buffer_price_is_what_the_buffers_hold() -> None:
    index = _index(max_rows=5)
    priced = ShardedIndex.buffer_bytes_for(world_size=1, block_topk=8, max_rows=5)
    assert index.buffer_bytes == priced
    engine = _index(max_rows=ShardedIndex.rows_for(5))  # an engine's: a prefill group at least
    assert engine.buffer_bytes == ShardedIndex.candidate_bytes(
        world_size=1, block_topk=8, max_running=5
    )


def test_an_index_shard_holds_ceil_p_over_n_pages_and_refuses_other_pages() -> None:
    """33 blocks are 3 pages of 16: 2 of them on each of 2 ranks; 8-block pages are named."""
    shard = IndexShard.of(2, blocks_per_page=BPP, compress_ratio=RATIO, capacity_blocks=33)
    assert (shard.logical_pages, shard.local_pages, shard.local_blocks) == (3, 2, 2 * BPP)
    assert "(2 of 3 pages of 16 blocks, 4 layers" in shard.describe(layers=4, block_bytes=256)
    flat, views = shard.allocate(layers=3, heads=1, dim=8, dtype=torch.bfloat16, device="cpu")
    assert flat.shape == (3, 2 * BPP * 8)
    assert [v.shape for v in views] == [(2 * BPP, 1, 8)] * 3
    views[2][1, 0, 3] = 1  # each layer's view is its row of the one allocation
    assert flat[2, 8 + 3] == 1
    with pytest.raises(KernelInputError, match=r"16 blocks of 4 tokens; .* has 8 blocks of 4"):
        IndexShard.of(2, blocks_per_page=8, compress_ratio=RATIO, capacity_blocks=33)


def test_prefill_rows_are_each_tokens_request_pages_and_its_position_plus_one() -> None:
    """Page ids from the slot table's page-aligned slots (unset -1 slots read as page 0)."""
    page = BPP * RATIO
    table = torch.full((3, 3 * page), -1)
    table[1, : 2 * page] = torch.cat(
        [torch.arange(5 * page, 6 * page), torch.arange(page, 2 * page)]
    )
    table[2, :page] = torch.arange(7 * page, 8 * page)
    rows = _index(max_rows=2).prefill_rows(
        table, torch.tensor([2, 1, 1]), torch.tensor([0, 64, 70])
    )
    assert rows.page_table.tolist() == [[7, 0, 0], [5, 1, 0], [5, 1, 0]]
    assert rows.seq_lens.tolist() == [1, 65, 71]
    decode = _index(max_rows=2).decode_rows(rows.page_table, torch.tensor([3, 0, 17]))
    assert decode.seq_lens.tolist() == [12, 0, 68]


def test_writes_through_the_local_view_land_in_the_engines_buffer() -> None:
    """A ``[blocks, H, D]`` buffer viewed as pages; ``[M, H, D]`` fp32 rows are cast."""
    buffer = torch.zeros((2 * BPP, 1, 128), dtype=torch.bfloat16)
    index = _index(max_rows=1)
    rows = torch.ones((1, 1, 128))
    index.write(index.local_view(buffer), torch.tensor([BPP + 3]), rows)
    assert index.local_view(buffer).shape == (2, BPP, 128)
    assert torch.equal(buffer[BPP + 3, 0], rows[0, 0].to(torch.bfloat16))
    assert int(buffer.float().abs().sum()) == 128


def test_zeros_of_the_named_shape_go_to_meta_and_nothing_else() -> None:
    with ZerosOnMeta((2, 6)) as divert:
        whole = torch.zeros((2, 6))
        also = torch.zeros(2, 6)
        other = torch.zeros((2, 5))
        ones = torch.ones((2, 6))
    assert [t.is_meta for t in (whole, also, other, ones)] == [True, True, False, False]
    assert divert.diverted == 2


def test_a_stores_index_selects_on_its_group_with_its_width() -> None:
    """``ShardedKVStore.index``: the raw K/V's group, block top-k and path, buffers for every
    decode row or one prefill group."""
    from qsa_kernels.sharded import PREFILL_GROUP_ROWS, ShardedKVStore

    shard = ShardGroup(ShardPlacement(1, BPP, RATIO), 0)
    store = ShardedKVStore(
        shard, {3: 0}, slots=256, kv_heads=1, head_dim=64, dtype=torch.bfloat16, q_heads=4,
        block_topk=8, max_rows=3, device=torch.device("cpu"), path=KernelPath.REFERENCE,
    )  # fmt: skip
    index = store.index(3)
    assert (index.shard, index.block_topk, index.path) == (shard, 8, KernelPath.REFERENCE)
    assert index.buffers.max_rows == max(3, PREFILL_GROUP_ROWS)


def test_the_whole_index_shape_is_ceil_slots_over_ratio_blocks_of_heads_by_dim() -> None:
    """161 slots are 41 blocks of 4 tokens (the last one partly used)."""
    shape = IndexShard.whole_shape(layers=3, slots=161, compress_ratio=RATIO, heads=2, dim=8)
    assert shape == (3, 41 * 2 * 8)
    assert IndexShard.whole_shape(layers=1, slots=160, compress_ratio=RATIO, heads=1, dim=8) == (
        1,
        40 * 8,
    )


def _prefill_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A slot table of two requests, their keys, five query tokens and the extra heads' queries."""
    gen = torch.Generator().manual_seed(3)
    page = BPP * RATIO
    table = torch.full((2, 4 * page), -1)
    table[0, : 3 * page] = torch.cat([torch.arange(p * page, (p + 1) * page) for p in (4, 1, 6)])
    table[1, :page] = torch.arange(2 * page, 3 * page)
    buffer = (torch.randint(-128, 129, (8 * BPP, 1, 128), generator=gen) / 64).to(torch.bfloat16)
    q = (torch.randint(0, 129, (5, 6, 128), generator=gen) / 64).to(torch.bfloat16)
    return table, buffer, q, torch.tensor([0, 0, 0, 1, 1])


def _ranges(positions: torch.Tensor, requests: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in key ranges: they only have to come back from ``prefill_inputs`` as they went."""
    return requests * 1000, positions + 1


def test_a_held_prefill_selects_as_its_rows_do_and_drops_padding_positions() -> None:
    """``prefill_inputs`` then ``select_prefill``: the selection of ``prefill_rows`` over the
    indexer's first 4 heads; positions past the query rows (engine padding) are dropped."""
    table, buffer, q, requests = _prefill_case()
    positions = torch.tensor([20, 100, 170, 3, 40, 999, 999])
    index = _index(max_rows=2)
    starts, ends = index.prefill_inputs(buffer, table, positions, requests, row_ranges=_ranges)
    assert starts.tolist() == [0, 0, 0, 1000, 1000]
    assert ends.tolist() == [21, 101, 171, 4, 41]
    got = index.select_prefill(starts, q, heads=4)
    rows = index.prefill_rows(table, requests, positions[:5])
    want = index.select(
        q[:, :4].contiguous(), index.local_view(buffer), rows.page_table, rows.seq_lens
    )
    assert torch.equal(got, want)
    assert (got >= 0).sum(dim=1).tolist() == [5, 8, 8, 1, 8]


def test_a_prefill_selection_needs_the_row_starts_its_inputs_returned_once() -> None:
    """Another tensor of equal values, a second selection, or none held: refused."""
    table, buffer, q, requests = _prefill_case()
    positions = torch.tensor([20, 100, 170, 3, 40])
    index = _index(max_rows=2)
    with pytest.raises(KernelInputError, match="not the ones prefill_inputs returned"):
        index.select_prefill(torch.zeros(5), q, heads=4)
    starts, _ = index.prefill_inputs(buffer, table, positions, requests, row_ranges=_ranges)
    with pytest.raises(KernelInputError, match="not the ones prefill_inputs returned"):
        index.select_prefill(starts.clone(), q, heads=4)
    starts, _ = index.prefill_inputs(buffer, table, positions, requests, row_ranges=_ranges)
    index.select_prefill(starts, q, heads=4)
    with pytest.raises(KernelInputError, match="not the ones prefill_inputs returned"):
        index.select_prefill(starts, q, heads=4)


def test_prefill_positions_shorter_than_the_query_rows_are_refused_by_count() -> None:
    table, buffer, _, requests = _prefill_case()
    with pytest.raises(KernelInputError, match=r"positions=4, rows=5"):
        _index(max_rows=2).prefill_inputs(
            buffer, table, torch.arange(4), requests, row_ranges=_ranges
        )


def test_a_decode_selection_reads_the_indexers_heads_of_padded_queries() -> None:
    """Queries padded with two more heads select as the first four do, from closed blocks."""
    table, buffer, q, _ = _prefill_case()
    pages = table[:, :: BPP * RATIO].clamp_min(0) // (BPP * RATIO)
    page_table = pages[[0, 1, 0]]
    closed = torch.tensor([44, 9, 2])
    padded = torch.cat([q[:3, :4], torch.full((3, 2, 128), 9.0, dtype=q.dtype)], dim=1)
    index = _index(max_rows=2)
    got = index.select_decode(padded, buffer, page_table, closed, heads=4)
    local = index.local_view(buffer)
    want = index.select(q[:3, :4].contiguous(), local, page_table, closed * RATIO)
    assert torch.equal(got, want)
    assert (got >= 0).sum(dim=1).tolist() == [8, 8, 2]
