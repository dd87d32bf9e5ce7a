"""Every TP rank joins its QSA shard group: the groups of ``ShardPlacement.tp_groups``, created
collectively on 4 gloo ranks, each rank's group exactly its members, in rank order; and the
index-only group (D2 without D1) of every TP rank, whatever the K/V heads."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement

WORLD = 4
#: (sharding size, attention CP size): two heads' replicas cut in pairs; one group of every rank.
CASES = ((2, 1), (4, 4))


def _worker(rank: int, port: int, out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from qsa_kernels.sharded import ShardGroup

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    results: dict[str, Any] = {}
    try:
        tp_ranks = list(range(WORLD))
        none = ShardGroup.join_tp(QWEN38_FLASH_NEXT, tp_ranks, rank, 1)
        results["off"] = none is None
        for sharding, cp in CASES:
            shard = ShardGroup.join_tp(QWEN38_FLASH_NEXT, tp_ranks, rank, sharding, attn_cp_size=cp)
            assert shard is not None
            members = [torch.zeros(1, dtype=torch.int64) for _ in range(shard.world_size)]
            dist.all_gather(members, torch.tensor([rank]), group=shard.group)
            results[f"{sharding}/{cp}"] = {
                "rank": shard.rank,
                "world_size": shard.world_size,
                "members": [int(m) for m in members],
            }
        index = ShardGroup.join_index_tp(tp_ranks, rank, blocks_per_page=16, compress_ratio=4)
        members = [torch.zeros(1, dtype=torch.int64) for _ in range(index.world_size)]
        dist.all_gather(members, torch.tensor([rank]), group=index.group)
        results["index"] = {
            "rank": index.rank,
            "world_size": index.world_size,
            "members": [int(m) for m in members],
            "blocks_per_page": index.placement.blocks_per_page,
        }
        dist.barrier()
    finally:
        dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, spawn_workers: Callable[[str, int, Path], None]
) -> dict[int, dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("join")
    spawn_workers(__file__, WORLD, out_dir)
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)}


@pytest.mark.parametrize(("sharding", "cp"), CASES)
def test_each_rank_joins_the_group_placement_gives_it(
    runs: dict[int, dict[str, Any]], sharding: int, cp: int
) -> None:
    groups = ShardPlacement.tp_groups(QWEN38_FLASH_NEXT, WORLD, sharding, attn_cp_size=cp)
    for rank, result in runs.items():
        (members,) = [list(g) for g in groups if rank in g]
        got = result[f"{sharding}/{cp}"]
        assert got == {
            "rank": members.index(rank),
            "world_size": sharding,
            "members": members,
        }, rank


def test_no_sharding_joins_no_group(runs: dict[int, dict[str, Any]]) -> None:
    assert all(result["off"] for result in runs.values())


def test_the_index_alone_joins_one_group_of_every_tp_rank(runs: dict[int, dict[str, Any]]) -> None:
    for rank, result in runs.items():
        assert result["index"] == {
            "rank": rank,
            "world_size": WORLD,
            "members": list(range(WORLD)),
            "blocks_per_page": 16,
        }, rank


def test_a_tp_rank_outside_the_group_is_refused_by_name_before_any_group_is_made() -> None:
    from qsa_kernels import KernelInputError
    from qsa_kernels.sharded import ShardGroup

    with pytest.raises(KernelInputError, match=r"tp_rank=2 is not allowed; allowed: 0\.\.1"):
        ShardGroup.join_tp(QWEN38_FLASH_NEXT, [0, 1], 2, 2)
    with pytest.raises(KernelInputError, match=r"tp_rank=2 is not allowed; allowed: 0\.\.1"):
        ShardGroup.join_index_tp([0, 1], 2, blocks_per_page=16, compress_ratio=4)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
