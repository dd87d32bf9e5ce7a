"""Zigzag CP permutations against qsa_core's layout, and the sparse prefill reference (1 process).

The permutations are pinned bit for bit against :class:`qsa_core.ZigzagLayout`'s list arithmetic
over random CP sizes and request lengths; the reduce-scatter invariant is checked here with the
reduction done in-process (the multi-process run is ``test_cp_gloo.py``). The attention reference
is pinned against dense causal SDPA and against a per-row loop.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_core import ZigzagLayout
from qsa_kernels._errors import KernelInputError
from qsa_kernels.cp import (
    CPRowPlan,
    all_gather_global,
    cp_sparse_prefill_reference,
    reduce_scatter_rank_major,
    sparse_prefill_reference,
    zigzag_positions,
    zigzag_shard,
    zigzag_to_rank_major,
    zigzag_unshard,
)

_LAYOUTS = st.builds(
    ZigzagLayout,
    st.integers(min_value=1, max_value=6),
    st.lists(st.integers(min_value=0, max_value=41), min_size=0, max_size=5).map(tuple),
)
_FAST = settings(max_examples=60, deadline=None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a 32-bit tensor, so NaN payloads and -0.0 compare exactly."""
    return t.view(torch.int32)


def _random_bits(rows: int, seed: int) -> torch.Tensor:
    """``[rows, 3]`` fp32 with arbitrary bit patterns (NaNs, infs, -0.0, denormals included)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**31), 2**31 - 1, (rows, 3), generator=g, dtype=torch.int64)
    return raw.to(torch.int32).view(torch.float32)


@_FAST
@given(_LAYOUTS)
def test_shard_matches_core_layout_rows(layout: ZigzagLayout) -> None:
    """zigzag_shard of global row ids gives each rank exactly the core layout's padded rows."""
    plan = CPRowPlan.from_layout(layout)
    ids = torch.arange(layout.total_rows, dtype=torch.int64)
    for rank in range(layout.cp_size):
        expected = layout.shard(list(range(layout.total_rows)), rank, pad=-1)
        assert zigzag_shard(ids, plan, rank, pad=-1).tolist() == expected


@_FAST
@given(_LAYOUTS)
def test_rank_major_is_the_concatenation_of_shards(layout: ZigzagLayout) -> None:
    """The rank-major permutation is every rank's shard in rank order, bit for bit."""
    plan = CPRowPlan.from_layout(layout)
    x = _random_bits(layout.total_rows, seed=layout.total_rows)
    rank_major = zigzag_to_rank_major(x, plan)
    assert rank_major.shape == (layout.cp_size * layout.rows_per_rank, 3)
    shards = [zigzag_shard(x, plan, r) for r in range(layout.cp_size)]
    assert torch.equal(_bits(rank_major), _bits(torch.cat(shards)))
    ids = torch.arange(layout.total_rows)
    assert zigzag_to_rank_major(ids, plan, pad=-1).tolist() == list(layout.rank_major_index())


@_FAST
@given(_LAYOUTS)
def test_unshard_inverts_the_shards_whatever_the_padding_holds(layout: ZigzagLayout) -> None:
    """Unshard of the concatenated shards restores the global rows bit for bit, dropping padding."""
    plan = CPRowPlan.from_layout(layout)
    x = _random_bits(layout.total_rows, seed=7 + layout.total_rows)
    rank_major = zigzag_to_rank_major(x, plan, pad=float("nan"))
    assert torch.equal(_bits(zigzag_unshard(rank_major, plan)), _bits(x))


@_FAST
@given(_LAYOUTS, st.integers(min_value=0, max_value=2**16))
def test_summed_rank_major_chunk_is_the_shard_of_the_sum(layout: ZigzagLayout, seed: int) -> None:
    """RS invariant in-process: chunk r of sum_i rank_major(x_i) equals shard(sum_i x_i, r)."""
    plan = CPRowPlan.from_layout(layout)
    g = torch.Generator().manual_seed(seed)
    partials = torch.randint(-64, 64, (layout.cp_size, layout.total_rows, 2), generator=g).float()
    summed = torch.stack([zigzag_to_rank_major(p, plan) for p in partials]).sum(0)
    total = partials.sum(0)
    for rank in range(layout.cp_size):
        chunk = summed[plan.local_slice(rank)]
        assert torch.equal(chunk, zigzag_shard(total, plan, rank))


@_FAST
@given(_LAYOUTS)
def test_positions_are_in_request_offsets_of_the_local_rows(layout: ZigzagLayout) -> None:
    """zigzag_positions names each local row's request and its token offset in that request."""
    plan = CPRowPlan.from_layout(layout)
    starts = [sum(layout.seq_lens[:i]) for i in range(len(layout.seq_lens))]
    for rank in range(layout.cp_size):
        request, position = zigzag_positions(plan, rank)
        rows = layout.shard(list(range(layout.total_rows)), rank, pad=-1)
        for row, req, pos in zip(rows, request.tolist(), position.tolist(), strict=True):
            if row < 0:
                assert (req, pos) == (-1, -1)
            else:
                assert starts[req] + pos == row
                assert 0 <= pos < layout.seq_lens[req]


def test_single_rank_collectives_run_locally_without_a_process_group() -> None:
    """With C = 1 and no process group, the gather is the identity and the RS returns the rows."""
    plan = CPRowPlan.from_layout(ZigzagLayout(1, (5, 3, 9)))
    x = _random_bits(17, seed=3)
    assert torch.equal(_bits(all_gather_global(x, plan)), _bits(x))
    assert torch.equal(_bits(reduce_scatter_rank_major(x, plan)), _bits(x))


def test_collectives_refuse_a_multi_rank_plan_without_a_process_group() -> None:
    """A plan of C = 2 with no initialised process group raises instead of returning local rows."""
    plan = CPRowPlan.from_layout(ZigzagLayout(2, (5,)))
    with pytest.raises(KernelInputError, match="cp_size=2"):
        all_gather_global(torch.zeros(plan.rows_per_rank, 4), plan)
    with pytest.raises(KernelInputError, match="cp_size=2"):
        reduce_scatter_rank_major(torch.zeros(5, 4), plan)


def test_permutations_reject_wrong_row_counts_and_ranks() -> None:
    """Row counts that do not match the plan, and ranks outside 0..C-1, raise KernelInputError."""
    plan = CPRowPlan.from_layout(ZigzagLayout(3, (7, 1)))
    with pytest.raises(KernelInputError, match=r"has 7 rows .* expected 8"):
        zigzag_shard(torch.zeros(7), plan, 0)
    with pytest.raises(KernelInputError, match=r"rank=3 is not allowed; allowed: 0\.\.2"):
        zigzag_shard(torch.zeros(8), plan, 3)
    with pytest.raises(KernelInputError, match="C \\* R"):
        zigzag_unshard(torch.zeros(8), plan)
    with pytest.raises(KernelInputError, match="leading row dim"):
        zigzag_to_rank_major(torch.tensor(1.0), plan)


# -- Attention reference --------------------------------------------------------------------------


def _qkv(rows: int, hq: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, hq, d, generator=g),
        torch.randn(rows, hkv, d, generator=g),
        torch.randn(rows, hkv, d, generator=g),
    )


@pytest.mark.parametrize(
    ("seq_lens", "hq", "hkv", "d"),
    [((1,), 2, 1, 4), ((13, 1, 6), 6, 2, 12), ((31,), 12, 1, 8), ((3, 17, 5, 2), 4, 4, 5)],
    ids=["one-token", "three-requests-gqa3", "gqa12", "mha-odd-dim"],
)
def test_dense_selection_equals_causal_sdpa(
    seq_lens: tuple[int, ...], hq: int, hkv: int, d: int
) -> None:
    """Selecting every position gives causal dense attention per request (torch SDPA)."""
    n = sum(seq_lens)
    q, k, v = _qkv(n, hq, hkv, d, seed=n)
    width = max(seq_lens) + 2  # wider than any request: the extra entries are future or absent
    index = torch.arange(width, dtype=torch.int32).expand(n, width).contiguous()
    out, lse = sparse_prefill_reference(q, k, v, index, seq_lens)
    base = 0
    for length in seq_lens:
        rows = slice(base, base + length)
        qh = q[rows].transpose(0, 1)  # [Hq, L, D]
        kh = k[rows].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        vh = v[rows].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True
        ).transpose(0, 1)
        scores = (qh @ kh.transpose(1, 2)) / math.sqrt(d)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        ref_lse = scores.masked_fill(~causal, float("-inf")).logsumexp(-1).transpose(0, 1)
        torch.testing.assert_close(out[rows], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[rows], ref_lse, rtol=1e-5, atol=1e-5)
        base += length


def test_sparse_selection_matches_a_per_row_loop() -> None:
    """Random selections (padding, future entries, duplicates-free) match a per-row softmax loop."""
    seq_lens = (9, 1, 14)
    hq, hkv, d, width = 6, 2, 7, 6
    n = sum(seq_lens)
    q, k, v = _qkv(n, hq, hkv, d, seed=11)
    g = torch.Generator().manual_seed(5)
    index = torch.stack([torch.randperm(16, generator=g)[:width] - 2 for _ in range(n)])
    out, lse = sparse_prefill_reference(q, k, v, index, seq_lens, scale=0.3)
    starts = [0, 9, 10]
    for row in range(n):
        req = 0 if row < 9 else (1 if row < 10 else 2)
        pos = row - starts[req]
        chosen = [starts[req] + t for t in index[row].tolist() if 0 <= t <= pos]
        for h in range(hq):
            kv_head = h // (hq // hkv)
            if not chosen:
                assert torch.isneginf(lse[row, h])
                assert torch.count_nonzero(out[row, h]) == 0
                continue
            s = torch.stack([q[row, h] @ k[c, kv_head] for c in chosen]) * 0.3
            p = torch.softmax(s, 0)
            ref = sum(p[i] * v[c, kv_head] for i, c in enumerate(chosen))
            torch.testing.assert_close(out[row, h], ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lse[row, h], s.logsumexp(0), rtol=1e-5, atol=1e-6)


def test_cp_reference_with_one_rank_equals_single_rank() -> None:
    """cp_sparse_prefill_reference with C = 1 and no process group is the single-rank reference."""
    seq_lens = (5, 12)
    q, k, v = _qkv(17, 4, 2, 8, seed=2)
    index = torch.randint(-1, 12, (17, 5), generator=torch.Generator().manual_seed(9))
    plan = CPRowPlan.from_layout(ZigzagLayout(1, seq_lens))
    out, lse = cp_sparse_prefill_reference(q, k, v, index, plan)
    ref_out, ref_lse = sparse_prefill_reference(q, k, v, index, seq_lens)
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse)


def test_attention_rejects_bad_heads_lengths_and_scale() -> None:
    """Head counts that do not divide, lengths that do not sum to the rows, and scale <= 0 raise."""
    q, k, v = _qkv(6, 6, 4, 8, seed=1)
    index = torch.zeros(6, 2, dtype=torch.int64)
    with pytest.raises(KernelInputError, match="multiple of Hkv"):
        sparse_prefill_reference(q, k, v, index, (6,))
    q, k, v = _qkv(6, 6, 2, 8, seed=1)
    with pytest.raises(KernelInputError, match=r"sum to 5; q has 6 rows"):
        sparse_prefill_reference(q, k, v, index, (2, 3))
    with pytest.raises(KernelInputError, match=r"scale=0\.0"):
        sparse_prefill_reference(q, k, v, index, (6,), scale=0.0)
    with pytest.raises(KernelInputError, match="token_index has dtype"):
        sparse_prefill_reference(q, k, v, index.float(), (6,))
