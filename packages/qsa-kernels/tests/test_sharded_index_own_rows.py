"""``ShardedIndex`` prefill with ``own_rows`` (each rank brings its own rows, as context-parallel
ranks bring their zigzag rows), on N gloo processes (N = 1, 2, 4) against one unsharded rank.

One module fixture starts four CPU processes once (``python this_file.py``, gloo over
``127.0.0.1``); they form groups of 1, 2 and 4 ranks. Every rank builds the same unsharded index
of 12 pages (two requests on scattered pages) and keeps its shard of it. Rank ``r`` of a group
of ``n`` brings ``COUNTS[n][r]`` query rows of its own (consecutive runs of one shuffled list of
both requests' rows; a rank of four brings none), so the ranks' rows differ in number and in
content. ``prefill_inputs(..., own_rows=True)`` then ``select_prefill`` must give each rank its
own rows' selections, equal to one rank selecting those rows over the whole index, with
candidate groups of three rows (the union of the group's rows spans several). The row gather
moves bytes: ragged fp8 rows come back byte for byte too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

WORLD = 4
GROUPS = (1, 2, 4)
PAGES, BPP, RATIO, D, HEADS, TOPK = 12, 16, 4, 128, 4, 8
#: Group size -> each rank's own rows (rank 3 of four brings none).
COUNTS = {1: (9,), 2: (9, 4), 4: (9, 4, 6, 0)}
CASES = {"select": None}
SEED = 20261215


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slot table, the whole index ``[16 P, 1, D]``, and the shuffled rows' requests,
    positions and queries ``[R, 6, D]`` (two heads past the indexer's)."""
    gen = torch.Generator().manual_seed(SEED)
    page = BPP * RATIO
    table = torch.full((3, 6 * page), -1)
    for row, pages in ((1, (7, 2, 10, 5, 0)), (2, (3, 11, 8))):
        slots = [torch.arange(p * page, (p + 1) * page) for p in pages]
        table[row, : len(pages) * page] = torch.cat(slots)
    whole = torch.randn((PAGES * BPP, 1, D), generator=gen).to(torch.bfloat16)
    requests = torch.tensor([1] * 11 + [2] * 8)
    positions = torch.cat([torch.randint(8, 5 * page, (11,), generator=gen), torch.arange(8) * 23])
    order = torch.randperm(requests.numel(), generator=gen)
    q = torch.randn((requests.numel(), HEADS + 2, D), generator=gen).to(torch.bfloat16)
    return table, whole, requests[order], positions[order], q[order]


def _ranges(positions: torch.Tensor, requests: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in key ranges: they only have to come back from ``prefill_inputs`` as they went."""
    return requests * 1000, positions + 1


def _run(shard: Any, case: None) -> dict[str, Any]:
    del case
    from qsa_core import ShardPlacement
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import (
        ShardedIndex,
        ShardGroup,
        all_gather_rows,
        group_row_counts,
        shard_index_pages,
    )

    table, whole, requests, positions, q = _case()
    n, rank = shard.world_size, shard.rank
    counts = COUNTS[n]
    mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    local = shard_index_pages(whole.view(PAGES, BPP, D), shard.placement, rank).view(-1, 1, D)
    index = ShardedIndex(
        shard, block_topk=TOPK, max_rows=3, device="cpu", path=KernelPath.REFERENCE
    )
    padded = torch.cat([positions[mine], torch.full((2,), 999)])  # engine padding past the rows
    starts, ends = index.prefill_inputs(
        local, table, padded, requests[mine], row_ranges=_ranges, own_rows=True
    )
    got = index.select_prefill(starts, q[mine], heads=HEADS)
    one = ShardedIndex(
        ShardGroup(ShardPlacement(1, BPP, RATIO), 0),
        block_topk=TOPK,
        max_rows=64,
        device="cpu",
        path=KernelPath.REFERENCE,
    )
    rows = one.prefill_rows(table, requests[mine], positions[mine])
    want = one.select(
        q[mine, :HEADS].contiguous(), one.local_view(whole), rows.page_table, rows.seq_lens
    )
    fp8 = (q[:, :2] * 8).to(torch.float8_e4m3fn)
    gathered = all_gather_rows(shard, fp8[mine], group_row_counts(shard, counts[rank], q.device))
    return {
        "rows": got.shape[0],
        "own_ranges": [starts.tolist(), ends.tolist()],
        "want_ranges": [(requests[mine] * 1000).tolist(), (positions[mine] + 1).tolist()],
        "sets_equal": torch.equal(got.sort(dim=1).values, want.sort(dim=1).values),
        "selected": int((got >= 0).sum()),
        "fp8_gathered": torch.equal(
            gathered.view(torch.uint8), fp8[: sum(counts)].contiguous().view(torch.uint8)
        ),
    }


def _worker(rank: int, port: int, out_dir: Path) -> None:
    from _gloo import write_group_results

    write_group_results(rank, port, out_dir, WORLD, GROUPS, CASES, _run)


# ------------------------------------------------------------------------------ test side


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
    group_runs: Callable[[str, int, Path], dict[tuple[int, int, str], dict[str, Any]]],
) -> dict[tuple[int, int, str], dict[str, Any]]:
    """``{(N, rank, case): result}`` for every rank of every group."""
    return group_runs(__file__, WORLD, tmp_path_factory.mktemp("sharded-index-own-rows"))


def test_every_group_size_ran_on_each_of_its_ranks(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    assert set(runs) == {(n, r, c) for n in GROUPS for r in range(n) for c in CASES}


def test_each_rank_gets_its_own_rows_selected_as_one_rank_over_the_whole_index(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    """Ragged rows (none on one rank of four), several candidate groups of the union: each
    rank's rows select the unsharded rank's sets, and its key ranges are its own rows'."""
    for (n, rank, _), result in runs.items():
        assert result["rows"] == COUNTS[n][rank], (n, rank)
        assert result["sets_equal"], (n, rank)
        assert result["own_ranges"] == result["want_ranges"], (n, rank)
        assert (result["selected"] > 0) == (COUNTS[n][rank] > 0), (n, rank)


def test_the_row_gather_moves_any_dtype_byte_for_byte_in_rank_order(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    for key, result in runs.items():
        assert result["fp8_gathered"], key


def test_counts_that_do_not_match_the_group_or_the_rows_are_refused_by_value() -> None:
    from qsa_core import ShardPlacement
    from qsa_kernels import KernelInputError
    from qsa_kernels.sharded import ShardGroup, all_gather_rows

    shard = ShardGroup(ShardPlacement(1, BPP, RATIO), 0)
    rows = torch.zeros((3, 2))
    assert all_gather_rows(shard, rows, (3,)) is rows
    with pytest.raises(KernelInputError, match=r"world_size=1 ranks' rows with this rank's 3 at 0"):
        all_gather_rows(shard, rows, (3, 1))
    with pytest.raises(KernelInputError, match=r"got \[2\]"):
        all_gather_rows(shard, rows, (2,))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
