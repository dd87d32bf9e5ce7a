"""Placement adapters, local candidates and static buffers of the sharded path (one process).

Everything here runs in the test process on CPU with pure torch (no collective, no kernel): the
adapters are checked against the scalar :class:`qsa_core.ShardPlacement` rules slot by slot.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_core import ShardPlacement, topk_reference
from qsa_kernels._errors import KernelInputError
from qsa_kernels.indexer_topk import indexer_scores_reference
from qsa_kernels.sharded import (
    HeadLayout,
    ShardedDecodeBuffers,
    ShardGroup,
    local_index_table,
    local_topk_candidates,
    localize_token_slots,
    shard_index_pages,
    shard_raw_kv,
    unshard_index_pages,
    unshard_raw_kv,
)

WORLDS = (1, 2, 3, 4)


def _placement(n: int) -> ShardPlacement:
    return ShardPlacement(n, 16, 4)


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("records", [1, 7, 33])
def test_raw_kv_shards_follow_placement_and_round_trip(n: int, records: int) -> None:
    """Local slot ``l`` of rank ``r`` holds logical slot ``l * N + r``; unshard restores all."""
    placement = _placement(n)
    kv = torch.arange(records * 2 * 4 * 1 * 16, dtype=torch.float32).view(records, 2, 4, 1, 16)
    shards = [shard_raw_kv(kv, placement, r) for r in range(n)]
    assert len({tuple(s.shape) for s in shards}) == 1
    for g in range(records * 4):
        owner, local = placement.raw_owner(g), placement.raw_local(g)
        torch.testing.assert_close(shards[owner][local // 4, :, local % 4], kv[g // 4, :, g % 4])
    assert torch.equal(unshard_raw_kv(shards, placement, records), kv)


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("pages", [1, 5, 12])
def test_index_page_shards_follow_placement_and_round_trip(n: int, pages: int) -> None:
    """Local page ``l`` of rank ``r`` is logical page ``l * N + r``; unshard restores all."""
    placement = _placement(n)
    index = torch.randn(pages, 16, 128).to(torch.bfloat16)
    shards = [shard_index_pages(index, placement, r) for r in range(n)]
    for p in range(pages):
        assert torch.equal(shards[placement.page_owner(p)][p // n], index[p])
        block = p * 16 + 5
        local = placement.block_local(block)
        owner = placement.block_owner(block)
        assert torch.equal(shards[owner].view(-1, 128)[local], index.view(-1, 128)[block])
    assert torch.equal(unshard_index_pages(shards, placement, pages), index)


@given(
    n=st.sampled_from(WORLDS),
    slots=st.lists(st.integers(-1, 10_000), min_size=1, max_size=40),
)
@settings(max_examples=60, deadline=None)
def test_localized_slots_are_owned_local_slots(n: int, slots: list[int]) -> None:
    """Each slot appears on exactly its owner, as ``slot // N``; padding stays ``-1`` everywhere."""
    placement = _placement(n)
    t = torch.tensor([slots], dtype=torch.int32)
    locals_ = [localize_token_slots(t, placement, r)[0].tolist() for r in range(n)]
    for i, g in enumerate(slots):
        got = [(r, locals_[r][i]) for r in range(n) if locals_[r][i] >= 0]
        assert got == ([] if g < 0 else [(placement.raw_owner(g), placement.raw_local(g))])


@given(
    n=st.sampled_from(WORLDS),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_local_index_tables_partition_the_visible_blocks(n: int, data: st.DataObject) -> None:
    """Over the ranks, the local columns cover each row's visible blocks exactly once."""
    placement = _placement(n)
    rows = data.draw(st.integers(1, 3))
    width = data.draw(st.integers(1, 6))
    lens = data.draw(st.lists(st.integers(0, width * 64 + 9), min_size=rows, max_size=rows))
    pool = data.draw(st.permutations(range(width * rows + 3)))
    pt = torch.tensor(pool[: rows * width], dtype=torch.int32).view(rows, width)
    seq = torch.tensor(lens, dtype=torch.int32)
    covered: list[list[int]] = [[] for _ in range(rows)]
    for r in range(n):
        table = local_index_table(pt, seq, placement, r)
        for b in range(rows):
            nb = int(table.seq_lens[b]) // 4
            for c in range(nb):
                req_page = int(table.request_pages[b, c // 16])
                local_page = int(table.page_table[b, c // 16])
                assert int(pt[b, req_page]) == local_page * n + r  # logical = local * N + rank
                covered[b].append(req_page * 16 + c % 16)
    for b in range(rows):
        assert sorted(covered[b]) == list(range(min(lens[b] // 4, width * 16)))


def test_local_index_table_rejects_rows_wider_than_width() -> None:
    """A row owning more pages than ``width`` is refused with the count in the message."""
    pt = torch.tensor([[0, 2, 4]], dtype=torch.int32)  # all on rank 0 of 2
    with pytest.raises(KernelInputError, match="owns 3 pages"):
        local_index_table(pt, torch.tensor([192]), _placement(2), 0, width=2)


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("topk", [1, 8, 40])
def test_local_candidates_are_the_owned_topk_in_merge_order(n: int, topk: int) -> None:
    """Each rank's candidates are ``topk_reference`` over its owned blocks (ties included)."""
    g = torch.Generator().manual_seed(7 * n + topk)
    pages = 9
    index = torch.randint(-1, 2, (pages, 16, 128), generator=g).to(torch.bfloat16)
    q = torch.randint(0, 2, (2, 4, 128), generator=g).to(torch.bfloat16)
    pt = torch.randperm(pages, generator=g)[:8].view(2, 4).to(torch.int32)
    seq = torch.tensor([4 * 61 + 3, 4 * 17], dtype=torch.int32)
    full = indexer_scores_reference(q, index, pt, seq)
    placement = _placement(n)
    for r in range(n):
        table = local_index_table(pt, seq, placement, r)
        local_scores = indexer_scores_reference(
            q, shard_index_pages(index, placement, r), table.page_table, table.seq_lens
        )
        scores, ids = local_topk_candidates(local_scores, table, topk)
        for b in range(2):
            owned = [
                j for j in range(int(seq[b]) // 4) if placement.page_owner(int(pt[b, j // 16])) == r
            ]
            want = topk_reference([float(full[b, j]) for j in owned], owned, topk)
            got = sorted(
                ((float(s), int(i)) for s, i in zip(scores[b], ids[b], strict=True) if i >= 0),
                key=lambda c: (-c[0], c[1]),
            )
            assert got == [(c.score, c.global_id) for c in want]
            assert all(
                math.isinf(float(s)) for s, i in zip(scores[b], ids[b], strict=True) if i < 0
            )


def test_buffers_report_qwen_collective_bytes() -> None:
    """B=1, topk 512, 12 heads, D 256, N 4: 4 KiB candidates, 1.5 KiB queries, 12,336 B partials."""
    sharded = ShardedDecodeBuffers.allocate(
        world_size=4, max_rows=8, topk=512, q_heads=12, head_dim=256,
        layout=HeadLayout.SHARDED, device="cpu",
    )  # fmt: skip
    b = sharded.collective_bytes(1)
    assert (b.candidates_send, b.candidates_recv) == (4096, 16384)
    assert (b.queries_send, b.queries_recv) == (1536, 6144)
    assert (b.partials_send, b.partials_recv) == (12336, 12336)
    replicated = ShardedDecodeBuffers.allocate(
        world_size=4, max_rows=8, topk=512, q_heads=12, head_dim=256,
        layout=HeadLayout.REPLICATED, device="cpu",
    )  # fmt: skip
    r = replicated.collective_bytes(1)
    assert (r.queries_send, r.partials_recv) == (0, 4 * 12336)
    assert replicated.nbytes == sum(
        t.numel() * t.element_size()
        for t in (
            replicated.candidate_send,
            replicated.candidate_recv,
            replicated.positions,
            replicated.local_slots,
            replicated.partial_send,
            replicated.partial_recv,
        )
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size=0"),
        ({"topk": -1}, "topk=-1"),
        ({"q_heads": 12, "world_size": 5, "layout": HeadLayout.SHARDED}, "multiple of world_size"),
        ({"layout": "sharded"}, "layout='sharded'"),
    ],
)
def test_buffers_reject_bad_geometry(kwargs: dict[str, object], match: str) -> None:
    """Non-positive sizes, indivisible head shards and a non-enum layout are refused."""
    args: dict[str, object] = {
        "world_size": 2, "max_rows": 2, "topk": 8, "q_heads": 12, "head_dim": 256,
        "layout": HeadLayout.REPLICATED, "device": "cpu",
    }  # fmt: skip
    args.update(kwargs)
    with pytest.raises(KernelInputError, match=match):
        ShardedDecodeBuffers.allocate(**args)  # type: ignore[arg-type]


def test_buffers_reject_more_rows_than_allocated() -> None:
    """A step wider than ``max_rows`` is refused rather than reading past the buffers."""
    buffers = ShardedDecodeBuffers.allocate(
        world_size=2, max_rows=3, topk=8, q_heads=12, head_dim=256,
        layout=HeadLayout.REPLICATED, device="cpu",
    )  # fmt: skip
    with pytest.raises(KernelInputError, match="rows=4"):
        buffers.collective_bytes(4)


def test_shard_group_rejects_bad_rank_and_missing_process_group() -> None:
    """Rank outside 0..N-1 is refused; N > 1 without torch.distributed is refused."""
    with pytest.raises(KernelInputError, match=r"allowed: 0\.\.0"):
        ShardGroup(_placement(1), 1)
    with pytest.raises(KernelInputError, match="initialised"):
        ShardGroup(_placement(2), 0)
