"""``run_on_gloo_ranks``: each rank runs the scenario in its own process of one gloo group."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
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


def test_a_rendezvous_port_taken_before_rank_0_binds_it_is_tried_again_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process listens on the chosen port first: that launch stops, the next one runs."""
    from qsa_testing import _gloo

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        chosen: list[int] = []
        real = _gloo._free_port

        def first_the_busy_port() -> int:
            chosen.append(busy if not chosen else real())
            return chosen[-1]

        monkeypatch.setattr(_gloo, "_free_port", first_the_busy_port)
        results = run_on_gloo_ranks(_sum_of_ranks, 2, tmp_path)
    assert results == [{"rank": r, "world": 2, "total": 3, "of": 2} for r in range(2)]
    assert chosen[0] == busy
    assert len(chosen) == 2
