"""CP collectives and CP sparse prefill over real gloo process groups, against one rank's result.

One module fixture starts 4 worker processes (this file run as a script) that meet over TCP on
127.0.0.1 and build CP groups of C = 1, 2, 3 and 4 ranks from them. For every C and case, each
member rank rebuilds the same random case from its seed, runs the collectives and the CP attention
on its own zigzag rows, and saves what it got; the tests here rebuild the case and compare each
rank's result with the single-rank computation: bit for bit for the gathers and the
integer-valued reduce-scatter, fp32 tolerance for attention.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from qsa_core import ZigzagLayout
from qsa_kernels._errors import KernelInputError
from qsa_kernels.cp import (
    CPRowPlan,
    all_gather_global,
    cp_sparse_prefill_reference,
    reduce_scatter_rank_major,
    sparse_prefill_reference,
    zigzag_shard,
    zigzag_unshard,
)

WORLD = 4
CP_SIZES = (1, 2, 3, 4)
CASES = ("shorter-than-blocks", "one-long", "three-mixed", "five-with-ones")
HQ, HKV, D = 6, 2, 12
TOPK_BLOCKS = 3
WIDTH = 4 * TOPK_BLOCKS + 3 + 1  # expanded blocks, the incomplete-group tail, one future entry


@dataclass(frozen=True, slots=True)
class Case:
    """One random CP prefill case; every process rebuilds it identically from the seed."""

    layout: ZigzagLayout
    x: torch.Tensor  # [N, 3, 5] fp32, arbitrary finite values (the gathered rows)
    x_bf16: torch.Tensor  # [N, 128] bf16 (raw index-K shaped)
    partials: torch.Tensor  # [C, N, 4] fp32 integer-valued partial sums (exact in any order)
    partials_float: torch.Tensor  # [C, N, 4] fp32 random partial sums
    q: torch.Tensor  # [N, HQ, D]
    k: torch.Tensor  # [N, HKV, D]
    v: torch.Tensor  # [N, HKV, D]
    index: torch.Tensor  # [N, WIDTH] int32 in-request positions, -1 padding


def _odd(g: torch.Generator, low: int, high: int) -> int:
    """A random odd integer in ``[low, high]`` (``low`` odd)."""
    return low + 2 * int(torch.randint(0, (high - low) // 2 + 1, (1,), generator=g))


def _lengths(case: str, cp_size: int, g: torch.Generator) -> tuple[int, ...]:
    if case == "shorter-than-blocks":  # fewer tokens than 2C blocks: empty blocks and ranks
        return (_odd(g, 1, max(1, 2 * cp_size - 1)),)
    if case == "one-long":
        return (_odd(g, 41, 67),)
    if case == "three-mixed":
        return tuple(_odd(g, 3, 37) for _ in range(3))
    return (1, _odd(g, 9, 29), 1, _odd(g, 5, 23), _odd(g, 1, 11))


def _qsa_selection(layout: ZigzagLayout, g: torch.Generator) -> torch.Tensor:
    """QSA-shaped rows: random complete blocks as tokens, the tail, one future entry."""
    rows: list[list[int]] = []
    for length in layout.seq_lens:
        for pos in range(length):
            complete = (pos + 1) // 4
            blocks = torch.randperm(complete, generator=g)[:TOPK_BLOCKS].tolist()
            picked = [4 * b + t for b in blocks for t in range(4)]
            picked += list(range(complete * 4, pos + 1))  # the incomplete group, own row included
            if pos + 1 < length:
                picked.append(pos + 1)  # a future token: the causal mask must drop it
            rows.append(picked + [-1] * (WIDTH - len(picked)))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, WIDTH)


def make_case(cp_size: int, case: str) -> Case:
    """The case ``case`` for ``cp_size`` ranks, from a seed both sides derive the same way."""
    g = torch.Generator().manual_seed(1000 * cp_size + CASES.index(case))
    layout = ZigzagLayout(cp_size, _lengths(case, cp_size, g))
    n = layout.total_rows
    return Case(
        layout=layout,
        x=torch.randn(n, 3, 5, generator=g) * 1e3,
        x_bf16=torch.randn(n, 128, generator=g).to(torch.bfloat16),
        partials=torch.randint(-512, 512, (cp_size, n, 4), generator=g).float(),
        partials_float=torch.randn(cp_size, n, 4, generator=g),
        q=torch.randn(n, HQ, D, generator=g),
        k=torch.randn(n, HKV, D, generator=g),
        v=torch.randn(n, HKV, D, generator=g),
        index=_qsa_selection(layout, g),
    )


def _run_rank(
    cp_size: int, case_name: str, rank: int, pg: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of a CP group of ``cp_size`` gets from every op on ``case_name``."""
    case = make_case(cp_size, case_name)
    plan = CPRowPlan.from_layout(case.layout)
    out, lse = cp_sparse_prefill_reference(
        zigzag_shard(case.q, plan, rank),
        zigzag_shard(case.k, plan, rank),
        zigzag_shard(case.v, plan, rank),
        zigzag_shard(case.index, plan, rank, pad=-1),
        plan,
        group=pg,
    )
    return {
        "gather": all_gather_global(zigzag_shard(case.x, plan, rank), plan, group=pg),
        "gather_bf16": all_gather_global(zigzag_shard(case.x_bf16, plan, rank), plan, group=pg),
        "rs": reduce_scatter_rank_major(case.partials[rank], plan, group=pg),
        "rs_float": reduce_scatter_rank_major(case.partials_float[rank], plan, group=pg),
        "attn_out": out,
        "attn_lse": lse,
    }


def _mismatch_refused(cp_size: int, pg: dist.ProcessGroup) -> torch.Tensor:
    """``[1]`` bool: both collectives refuse a plan whose cp_size is not the group's size."""
    plan = CPRowPlan.from_layout(ZigzagLayout(cp_size + 1, (9,)))
    refused = 0
    try:
        all_gather_global(torch.zeros(plan.rows_per_rank, 2), plan, group=pg)
    except KernelInputError as e:
        refused += f"cp_size is {cp_size + 1}" in str(e)
    try:
        reduce_scatter_rank_major(torch.zeros(9, 2), plan, group=pg)
    except KernelInputError as e:
        refused += f"has {cp_size} ranks" in str(e)
    return torch.tensor([refused == 2])


def _worker(rank: int, port: int, out_dir: Path) -> None:
    """One of the ``WORLD`` processes: join, build every CP group, run every case, save results."""
    from _gloo import member_groups

    results: dict[str, torch.Tensor] = {}
    for cp_size, group in member_groups(rank, port, WORLD, CP_SIZES):
        for case_name in CASES:
            for name, value in _run_rank(cp_size, case_name, rank, group).items():
                results[f"{cp_size}/{case_name}/{rank}/{name}"] = value
        results[f"{cp_size}/mismatch/{rank}"] = _mismatch_refused(cp_size, group)
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def gloo_results(
    tmp_path_factory: pytest.TempPathFactory,
    spawn_workers: Callable[[str, int, Path], None],
) -> dict[str, torch.Tensor]:
    """Start the worker processes once, wait for them, and merge what every rank saved."""
    out_dir = tmp_path_factory.mktemp("cp_gloo")
    spawn_workers(__file__, WORLD, out_dir)
    merged: dict[str, torch.Tensor] = {}
    for rank in range(WORLD):
        merged.update(torch.load(out_dir / f"rank{rank}.pt"))
    return merged


_GRID = [pytest.param(c, name, id=f"C{c}-{name}") for c in CP_SIZES for name in CASES]


def _per_rank(
    results: dict[str, torch.Tensor], cp_size: int, case: str, name: str
) -> list[torch.Tensor]:
    return [results[f"{cp_size}/{case}/{rank}/{name}"] for rank in range(cp_size)]


@pytest.mark.parametrize(("cp_size", "case"), _GRID)
def test_all_gather_global_gives_every_rank_the_global_rows(
    gloo_results: dict[str, torch.Tensor], cp_size: int, case: str
) -> None:
    """Every rank's all_gather_global of its zigzag rows is the global tensor, bit for bit."""
    ref = make_case(cp_size, case)
    for got in _per_rank(gloo_results, cp_size, case, "gather"):
        assert torch.equal(got.view(torch.int32), ref.x.view(torch.int32))
    for got in _per_rank(gloo_results, cp_size, case, "gather_bf16"):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), ref.x_bf16.view(torch.int16))


@pytest.mark.parametrize(("cp_size", "case"), _GRID)
def test_reduce_scatter_lands_each_ranks_zigzag_shard_of_the_sum(
    gloo_results: dict[str, torch.Tensor], cp_size: int, case: str
) -> None:
    """RS(rank_major(x_r))[rank] == shard(sum_r x_r)[rank]: exact for integer-valued sums."""
    ref = make_case(cp_size, case)
    plan = CPRowPlan.from_layout(ref.layout)
    total = ref.partials.sum(0)
    total_float = ref.partials_float.sum(0)
    for rank, got in enumerate(_per_rank(gloo_results, cp_size, case, "rs")):
        assert torch.equal(got, zigzag_shard(total, plan, rank))
    for rank, got in enumerate(_per_rank(gloo_results, cp_size, case, "rs_float")):
        torch.testing.assert_close(got, zigzag_shard(total_float, plan, rank), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("cp_size", "case"), _GRID)
def test_cp_sparse_prefill_equals_single_rank_attention(
    gloo_results: dict[str, torch.Tensor], cp_size: int, case: str
) -> None:
    """The unshard of every rank's CP attention equals single-rank attention; padding rows empty."""
    ref = make_case(cp_size, case)
    plan = CPRowPlan.from_layout(ref.layout)
    want_out, want_lse = sparse_prefill_reference(
        ref.q, ref.k, ref.v, ref.index, ref.layout.seq_lens
    )
    outs = _per_rank(gloo_results, cp_size, case, "attn_out")
    lses = _per_rank(gloo_results, cp_size, case, "attn_lse")
    torch.testing.assert_close(
        zigzag_unshard(torch.cat(outs), plan), want_out, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        zigzag_unshard(torch.cat(lses), plan), want_lse, rtol=1e-5, atol=1e-6
    )
    for rank in range(cp_size):
        pad = plan.rank_major_index[plan.local_slice(rank)] < 0
        assert torch.isneginf(lses[rank][pad]).all()
        assert torch.count_nonzero(outs[rank][pad]) == 0


@pytest.mark.parametrize("cp_size", CP_SIZES, ids=lambda c: f"C{c}")
def test_collectives_refuse_a_plan_for_another_group_size(
    gloo_results: dict[str, torch.Tensor], cp_size: int
) -> None:
    """On a real group of C ranks, a plan for C + 1 ranks raises on every rank, moving nothing."""
    for rank in range(cp_size):
        assert bool(gloo_results[f"{cp_size}/mismatch/{rank}"])


def test_every_case_has_rows_and_the_small_case_leaves_ranks_idle() -> None:
    """The grid covers odd lengths, several requests, and a layout where some rank owns no row."""
    layouts = {(c, n): make_case(c, n).layout for c in CP_SIZES for n in CASES}
    assert all(length % 2 == 1 for lay in layouts.values() for length in lay.seq_lens)
    assert all(len(make_case(c, "five-with-ones").layout.seq_lens) == 5 for c in CP_SIZES)
    idle = [
        c
        for c in CP_SIZES
        if any(not layouts[c, "shorter-than-blocks"].rank_rows(r) for r in range(c))
    ]
    assert idle, "no case leaves a rank without rows"


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
