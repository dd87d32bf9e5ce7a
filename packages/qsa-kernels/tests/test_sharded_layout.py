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
from qsa_kernels import KernelPath
from qsa_kernels._errors import KernelInputError
from qsa_kernels.indexer_topk import indexer_scores_reference
from qsa_kernels.sharded import (
    HeadLayout,
    ShardedDecodeBuffers,
    ShardGroup,
    compact_owned_slots,
    index_write_targets,
    local_index_table,
    local_topk_candidates,
    localize_token_slots,
    owned_token_bound,
    owner_sparse_decode,
    raw_write_targets,
    route_write_rows,
    shard_index_pages,
    shard_raw_kv,
    unshard_index_pages,
    unshard_raw_kv,
    write_owned_index_blocks,
    write_owned_raw_kv,
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


# ------------------------------------------------------------------ owned-token compaction


@given(
    n=st.sampled_from(WORLDS),
    rows=st.lists(st.lists(st.integers(-1, 500), min_size=0, max_size=30), min_size=1, max_size=3),
)
@settings(max_examples=80, deadline=None)
def test_compacted_slots_are_owned_slots_in_order_then_padding(
    n: int, rows: list[list[int]]
) -> None:
    """Row ``b`` of rank ``r`` is its owned slots' ``g // N`` in input order, then ``-1``."""
    width = max(len(r) for r in rows)
    padded = [r + [-1] * (width - len(r)) for r in rows]
    t = torch.tensor(padded, dtype=torch.int64).view(len(rows), width)
    placement = _placement(n)
    for rank in range(n):
        local, counts = compact_owned_slots(t, placement, rank)
        assert local.dtype == torch.int32
        assert counts.dtype == torch.int32
        for b, row in enumerate(padded):
            want = [g // n for g in row if g >= 0 and g % n == rank]
            assert local[b].tolist() == want + [-1] * (width - len(want))
            assert int(counts[b]) == len(want)


def test_compaction_writes_into_the_given_buffer() -> None:
    """``out`` is filled in place (the static buffer), and a mismatched ``out`` is refused."""
    slots = torch.tensor([[5, -1, 2, 8, 3]], dtype=torch.int32)
    out = torch.full((1, 5), 77, dtype=torch.int32)
    local, counts = compact_owned_slots(slots, _placement(3), 2, out=out)
    assert local.data_ptr() == out.data_ptr()
    assert out.tolist() == [[1, 0, 2, -1, -1]]
    assert counts.tolist() == [3]
    with pytest.raises(KernelInputError, match="out must be"):
        compact_owned_slots(slots, _placement(3), 2, out=torch.empty((1, 5), dtype=torch.int64))


@pytest.mark.parametrize(
    ("n", "topk", "want"),
    [(1, 512, 2051), (2, 512, 1026), (3, 512, 1025), (4, 512, 513), (4, 1, 2), (3, 7, 15)],
)
def test_owned_token_bound_values(n: int, topk: int, want: int) -> None:
    """``topk * ceil(4 / N) + ceil(3 / N)``; without contiguous blocks it is ``4 * topk + 3``."""
    assert owned_token_bound(_placement(n), topk) == want
    assert owned_token_bound(_placement(n), topk, contiguous_blocks=False) == 4 * topk + 3


@given(n=st.sampled_from(WORLDS), data=st.data())
@settings(max_examples=60, deadline=None)
def test_owned_token_bound_holds_on_page_contiguous_tables(n: int, data: st.DataObject) -> None:
    """Any selection + tail on page-contiguous slots gives no rank more than the bound."""
    topk = data.draw(st.integers(1, 12))
    npages = data.draw(st.integers(1, 3))
    seq_len = data.draw(st.integers(1, npages * 64))
    pages = data.draw(st.permutations(range(npages + 4)))[:npages]
    slot_of = [pages[p // 64] * 64 + p % 64 for p in range(npages * 64)]
    blocks = seq_len // 4
    chosen = data.draw(st.lists(st.integers(0, max(blocks - 1, 0)), max_size=topk, unique=True))
    positions = [4 * j + i for j in chosen if j < blocks for i in range(4)]
    positions += list(range(4 * blocks, seq_len))
    slots = torch.tensor([[slot_of[p] for p in positions] or [-1]], dtype=torch.int64)
    bound = owned_token_bound(_placement(n), topk)
    for rank in range(n):
        _, counts = compact_owned_slots(slots, _placement(n), rank)
        assert int(counts[0]) <= bound


def test_owned_token_bound_is_reached_and_unbounded_tables_need_full_width() -> None:
    """At N = 3 a rank can own 2 of a block's 4 tokens; slots all on one rank need 4k + 3."""
    placement = _placement(3)
    aligned = torch.tensor([[0, 1, 2, 3, 12, 13, 14, 15, 24, 25, 26]])  # blocks 0, 3 + tail 6
    assert compact_owned_slots(aligned, placement, 0)[1].tolist() == [2 + 2 + 1]
    assert owned_token_bound(placement, 2) == 5
    skewed = torch.tensor([[3 * i for i in range(11)]])  # every selected slot on rank 0
    assert compact_owned_slots(skewed, placement, 0)[1].tolist() == [11]
    assert owned_token_bound(placement, 2, contiguous_blocks=False) == 11


def _decode_inputs(topk: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "q": torch.randn((2, 4, 32), generator=g).to(torch.bfloat16),
        "ids": torch.tensor([[0, 5, -1], [1, -1, 0]], dtype=torch.int32)[:, :topk],
        "seq_lens": torch.tensor([27, 9], dtype=torch.int32),
        "slot_table": torch.arange(128, dtype=torch.int32).view(2, 64),
        "kv": torch.randn((32, 2, 4, 1, 32), generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize("width", [None, 15, 11])
def test_single_rank_decode_is_the_same_at_every_sufficient_width(width: int | None) -> None:
    """N = 1: the step's exact width (11), the static bound (15) and width 11 agree bit for bit."""
    x = _decode_inputs(3)
    buffers = ShardedDecodeBuffers.allocate(
        world_size=1, max_rows=2, topk=3, q_heads=4, head_dim=32,
        layout=HeadLayout.REPLICATED, device="cpu",
    )  # fmt: skip
    shard = ShardGroup(_placement(1), 0)
    args = (x["q"], x["ids"], x["seq_lens"], x["slot_table"], x["kv"])
    want = owner_sparse_decode(*args, shard=shard, buffers=buffers, path=KernelPath.REFERENCE)
    got = owner_sparse_decode(
        *args, shard=shard, buffers=buffers, path=KernelPath.REFERENCE, owned_width=width
    )
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize(("width", "match"), [(0, "owned_width=0"), (16, "owned_width=16"),
                                              (10, "owns 11 selected tokens")])  # fmt: skip
def test_owned_width_out_of_range_or_too_narrow_is_refused(width: int, match: str) -> None:
    """A width outside 1..4k+3, or one narrower than a row's owned tokens, raises."""
    x = _decode_inputs(3)  # row 0: blocks 0, 5 + tail 24..26 = 11 tokens; row 1: 8 + tail 8
    buffers = ShardedDecodeBuffers.allocate(
        world_size=1, max_rows=2, topk=3, q_heads=4, head_dim=32,
        layout=HeadLayout.REPLICATED, device="cpu",
    )  # fmt: skip
    with pytest.raises(KernelInputError, match=match):
        owner_sparse_decode(
            x["q"], x["ids"], x["seq_lens"], x["slot_table"], x["kv"],
            shard=ShardGroup(_placement(1), 0), buffers=buffers, path=KernelPath.REFERENCE,
            owned_width=width,
        )  # fmt: skip


# ------------------------------------------------------------------------- write routing


@given(
    n=st.sampled_from(WORLDS),
    slots=st.lists(st.integers(-1, 300), min_size=0, max_size=25),
)
@settings(max_examples=60, deadline=None)
def test_write_targets_follow_placement(n: int, slots: list[int]) -> None:
    """Raw and index write targets match ``ShardPlacement`` row by row; padding owns nothing."""
    placement = _placement(n)
    t = torch.tensor(slots, dtype=torch.int64)
    for rank in range(n):
        raw = raw_write_targets(t, placement, rank)
        idx = index_write_targets(t, placement, rank)
        for i, s in enumerate(slots):
            if s < 0:
                assert (int(raw.local[i]), int(idx.local[i])) == (-1, -1)
                continue
            want_raw = placement.raw_local(s) if placement.raw_owner(s) == rank else -1
            want_idx = placement.block_local(s) if placement.block_owner(s) == rank else -1
            assert (int(raw.local[i]), int(idx.local[i])) == (want_raw, want_idx)
        assert torch.equal(raw.owned, raw.local >= 0)
        assert torch.equal(idx.owned, idx.local >= 0)


@given(n=st.sampled_from(WORLDS), data=st.data())
@settings(max_examples=40, deadline=None)
def test_owned_writes_equal_the_shard_of_the_logical_write(n: int, data: st.DataObject) -> None:
    """Masked in-place writes and routed pairs both give exactly the shard of the logical cache."""
    placement = _placement(n)
    records, pages = 9, 3
    raw_slots = data.draw(st.lists(st.integers(0, 4 * records - 1), max_size=12, unique=True))
    raw = torch.tensor(raw_slots + [-1] * data.draw(st.integers(0, 2)), dtype=torch.int64)
    blocks = data.draw(st.lists(st.integers(0, 16 * pages - 1), max_size=8, unique=True))
    bslots = torch.tensor(blocks + [-1] * data.draw(st.integers(0, 2)), dtype=torch.int64)
    g = torch.Generator().manual_seed(len(raw_slots) * 31 + len(blocks))
    kv = torch.randn((records, 2, 4, 2, 8), generator=g).to(torch.bfloat16)
    index = torch.randn((pages, 16, 16), generator=g).to(torch.bfloat16)
    k = torch.randn((raw.numel(), 2, 8), generator=g).to(torch.bfloat16)
    v = torch.randn((raw.numel(), 2, 8), generator=g).to(torch.bfloat16)
    rows = torch.randn((bslots.numel(), 16), generator=g).to(torch.bfloat16)
    shards = [(shard_raw_kv(kv, placement, r), shard_index_pages(index, placement, r)) for r in
              range(n)]  # fmt: skip
    live = raw >= 0
    kv[raw[live] // 4, 0, raw[live] % 4] = k[live]
    kv[raw[live] // 4, 1, raw[live] % 4] = v[live]
    index.view(-1, 16)[bslots[bslots >= 0]] = rows[bslots >= 0]
    for rank, (local_kv, local_index) in enumerate(shards):
        raw_t = raw_write_targets(raw, placement, rank)
        idx_t = index_write_targets(bslots, placement, rank)
        routed_kv, routed_index = local_kv.clone(), local_index.clone()
        write_owned_raw_kv(local_kv, raw_t, k, v)
        write_owned_index_blocks(local_index, idx_t, rows)
        assert torch.equal(local_kv, shard_raw_kv(kv, placement, rank))
        assert torch.equal(local_index, shard_index_pages(index, placement, rank))
        loc, kr = route_write_rows(raw_t, k)
        _, vr = route_write_rows(raw_t, v)
        routed_kv[loc // 4, 0, loc % 4] = kr
        routed_kv[loc // 4, 1, loc % 4] = vr
        bloc, br = route_write_rows(idx_t, rows)
        routed_index.view(-1, 16)[bloc] = br
        assert torch.equal(routed_kv, local_kv)
        assert torch.equal(routed_index, local_index)


def test_write_owning_nothing_leaves_the_shard_unchanged() -> None:
    """A rank owning none of the rows (or an empty write) changes no byte of its shard."""
    placement = _placement(2)
    local_kv = torch.randn((3, 2, 4, 1, 8)).to(torch.bfloat16)
    before = local_kv.clone()
    targets = raw_write_targets(torch.tensor([0, 2, 4, -1]), placement, 1)
    write_owned_raw_kv(local_kv, targets, torch.ones((4, 1, 8), dtype=torch.bfloat16),
                       torch.ones((4, 1, 8), dtype=torch.bfloat16))  # fmt: skip
    empty = raw_write_targets(torch.empty(0, dtype=torch.int64), placement, 1)
    write_owned_raw_kv(local_kv, empty, torch.ones((0, 1, 8), dtype=torch.bfloat16),
                       torch.ones((0, 1, 8), dtype=torch.bfloat16))  # fmt: skip
    assert torch.equal(local_kv, before)


def test_write_routing_rejects_bad_inputs() -> None:
    """Float slots, mismatched row counts and dtypes are refused with the shapes in the message."""
    placement = _placement(2)
    with pytest.raises(KernelInputError, match="int32 or int64"):
        raw_write_targets(torch.tensor([0.0]), placement, 0)
    with pytest.raises(KernelInputError, match=r"allowed: 0\.\.1"):
        index_write_targets(torch.tensor([0]), placement, 2)
    targets = raw_write_targets(torch.tensor([0, 1]), placement, 0)
    kv = torch.zeros((2, 2, 4, 1, 8), dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"k must be \(2, 1, 8\)"):
        write_owned_raw_kv(kv, targets, torch.zeros((3, 1, 8), dtype=torch.bfloat16),
                           torch.zeros((2, 1, 8), dtype=torch.bfloat16))  # fmt: skip
    with pytest.raises(KernelInputError, match="rows must be"):
        write_owned_index_blocks(torch.zeros((1, 16, 4)), targets, torch.zeros((2, 4)).half())
    with pytest.raises(KernelInputError, match="one row per target"):
        route_write_rows(targets, torch.zeros(3))
