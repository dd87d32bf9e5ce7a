"""``run_on_gloo_ranks``: each rank runs the scenario in its own process of one gloo group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qsa_testing import run_on_gloo_ranks


def _sum_of_ranks(rank: int, world: int) -> dict[str, Any]:
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return {"rank": rank, "world": dist.get_world_size(), "total": int(total), "of": world}


def test_every_rank_runs_the_scenario_in_one_group_and_reports_in_rank_order(
    tmp_path: Path,
) -> None:
    results = run_on_gloo_ranks(_sum_of_ranks, 3, tmp_path)
    assert results == [{"rank": r, "world": 3, "total": 6, "of": 3} for r in range(3)]
