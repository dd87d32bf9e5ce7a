"""``ShardedIndex`` on one rank: its selection is ``indexer_topk_reference``'s in candidate groups,
its writes are the owned-write rule. The 2- and 4-rank runs through SGLang's indexer are
``qsa-sglang-plugin``'s ``test_sharded_index.py``."""

from __future__ import annotations

import pytest
import torch

from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement
from qsa_kernels import KernelInputError, KernelPath
from qsa_kernels.indexer_topk import indexer_topk_reference
from qsa_kernels.sharded import ShardedIndex, ShardGroup

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
