"""The index sharded by page (D2) on one device: every rank's candidates, merged, are the
single-rank top-k, bit for bit, with general (inexact) keys.

The gloo tests (``test_sharded.py`` and the plugin's ``test_sharded_index.py``) draw keys whose
dot products are exact, because the CPU reference's BLAS product may round a block differently
depending on how many blocks one call holds. Exactness of the distributed selection rests on the
Triton scorer computing each block from its key and the query alone, whichever shard holds it; on
a GPU this test checks that with ``randn`` keys. The ranks run one after another on one device,
each through the public pieces of :func:`qsa_kernels.sharded.sharded_indexer_topk` (its shard of
the pages, its local table, the scorer, its local top-k); their stacked candidates are what that
function's all-gather delivers, and :func:`qsa_kernels.topk_merge.merge_candidates` merges them.
"""

from __future__ import annotations

import pytest
import torch

from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement
from qsa_kernels.indexer_topk import indexer_scores, indexer_topk
from qsa_kernels.sharded import local_index_table, local_topk_candidates, shard_index_pages
from qsa_kernels.topk_merge import merge_candidates

BPP, RATIO = QWEN38_FLASH_NEXT.blocks_per_page, QWEN38_FLASH_NEXT.compress_ratio
PAGE_TOKENS = BPP * RATIO
TOPK = 64
#: Tokens per request: several pages past the top-k, fewer blocks than the top-k, a partial last
#: page, one page; the last request's pages all belong to one rank.
LENGTHS = (20_000, 700, 4_097, 64, 9_000)


def _case(ranks: int, device: str) -> tuple[torch.Tensor, ...]:
    """``(q [B, 4, 128], index [NP, 16, 128], page_table [B, P], seq_lens [B])`` on ``device``."""
    g = torch.Generator().manual_seed(40 + ranks)
    pages = [-(-n // PAGE_TOKENS) for n in LENGTHS]
    pool = ranks * (sum(pages) + 3)
    order = torch.randperm(pool, generator=g)
    table = torch.zeros((len(LENGTHS), max(pages)), dtype=torch.int32)
    used = 0
    for row, count in enumerate(pages[:-1]):
        table[row, :count] = order[used : used + count].to(torch.int32)
        used += count
    last_rank = order[used:][order[used:] % ranks == ranks - 1]  # one rank owns them all
    table[-1, : pages[-1]] = last_rank[: pages[-1]].to(torch.int32)
    q = torch.randn((len(LENGTHS), 4, 128), generator=g).to(torch.bfloat16)
    index = torch.randn((pool, BPP, 128), generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32)
    return q.to(device), index.to(device), table.to(device), seq_lens.to(device)


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_ranks_candidates_merged_are_the_single_rank_top_k_bit_for_bit(
    ranks: int, kernel_device: str
) -> None:
    q, index, table, seq_lens = _case(ranks, kernel_device)
    placement = ShardPlacement(ranks, BPP, RATIO)
    scores, ids = [], []
    for rank in range(ranks):
        local = local_index_table(table, seq_lens, placement, rank)
        shard = shard_index_pages(index, placement, rank)
        rank_scores, rank_ids = local_topk_candidates(
            indexer_scores(q, shard, local.page_table, local.seq_lens), local, TOPK
        )
        scores.append(rank_scores)
        ids.append(rank_ids)
    merged = merge_candidates(torch.stack(scores), torch.stack(ids), topk=TOPK)

    want = indexer_topk(q, index, table, seq_lens, topk=TOPK)
    whole = indexer_scores(q, index, table, seq_lens)
    assert torch.equal(merged.ids.sort(dim=1).values, want.sort(dim=1).values)
    live = merged.ids >= 0
    expected = whole.gather(1, merged.ids.clamp(min=0).long())
    # Each selected block has the score the whole index gives it, to the last bit.
    assert torch.equal(merged.scores[live], torch.where(expected == 0, 0.0, expected)[live])
    blocks = torch.div(seq_lens, RATIO, rounding_mode="floor").clamp(max=TOPK)
    assert live.sum(dim=1).tolist() == blocks.tolist()


@pytest.mark.gpu
def test_a_captured_decode_selection_replays_as_eager_on_new_queries_and_lengths() -> None:
    """``ShardedIndex.select_decode`` (one rank: its buffers and kernels, the all-gather a copy)
    captured in a CUDA graph, then replayed after the queries, the index and the lengths changed
    in place, equals the eager selection of the new inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from qsa_kernels.sharded import ShardedIndex, ShardGroup

    q, index, table, seq_lens = _case(1, "cuda")
    index_buffer = index.view(-1, 1, 128)  # upstream's [16 P, H, D] layout of one layer
    closed = torch.div(seq_lens, RATIO, rounding_mode="floor")
    sharded = ShardedIndex(
        ShardGroup(ShardPlacement(1, BPP, RATIO), 0),
        block_topk=TOPK,
        max_rows=len(LENGTHS),
        device="cuda",
    )

    def select() -> torch.Tensor:
        return sharded.select_decode(q, index_buffer, table, closed, heads=4)

    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        select()  # compiles and warms the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = select()
    graph.replay()
    first = captured.clone()
    q2, index2, _, _ = _case(2, "cuda")
    q.copy_(q2)
    index.copy_(index2[: index.shape[0]])
    closed.sub_(torch.tensor([1000, 0, 300, 5, 7], dtype=closed.dtype, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, first)  # the new inputs change the selection
    assert torch.equal(captured.sort(dim=1).values, select().sort(dim=1).values)
