"""Distributed code on one CPU machine: a scenario on ``N`` gloo ranks, their results collected.

The scenario is a module-level function ``(rank, world) -> dict`` (the spawned processes import
it by name); each rank joins a default gloo group on ``127.0.0.1`` with one CPU thread, runs it,
and writes its JSON result, which :func:`run_on_gloo_ranks` returns in rank order. What the NCCL
runs on several GPUs check, the CPU tests check here first.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

__all__ = ("Scenario", "run_on_gloo_ranks")

#: ``(rank, world) -> JSON-serialisable result`` of one rank.
Scenario = Callable[[int, int], dict[str, Any]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank(rank: int, scenario: Scenario, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = scenario(rank, world)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_on_gloo_ranks(scenario: Scenario, world: int, out_dir: Path) -> list[dict[str, Any]]:
    """``scenario(rank, world)`` on ``world`` processes; their results, rank 0 first."""
    args = (scenario, world, _free_port(), str(out_dir))
    spawn(_rank, args=args, nprocs=world, join=True)  # type: ignore[no-untyped-call]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
