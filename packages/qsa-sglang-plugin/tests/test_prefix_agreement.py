"""TP ranks agree on every prefix-cache decision: one MIN over the TP group's CPU group (gloo)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from qsa_sglang_plugin._adapters._prefix import agree_min


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank(rank: int, world: int, port: int, views: list[int], out: torch.Tensor) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        out[rank] = agree_min(views[rank], group)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "views",
    [
        [2048, 1024],  # rank 1 evicted the longer checkpoint: both load 1,024 tokens
        [1, 0],  # rank 1 has no room for a publish: nobody publishes
        [3072, 3072, 0, 3072],  # one rank of four missed: all miss
    ],
)
def test_every_rank_gets_the_smallest_view(views: list[int]) -> None:
    out = torch.full((len(views),), -1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
    spawn(_rank, args=(len(views), _free_port(), views, out), nprocs=len(views), join=True)  # type: ignore[no-untyped-call]
    assert out.tolist() == [min(views)] * len(views)


def test_one_rank_decides_alone() -> None:
    assert agree_min(1536, None) == 1536
