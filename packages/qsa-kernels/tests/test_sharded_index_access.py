"""``ShardedIndexAccess``: the whole index by logical row through each rank's shard, on N gloo
processes (N = 1, 2, 4) against the unsharded index.

One module fixture starts four CPU processes once (``python this_file.py``, gloo over
``127.0.0.1``); they form groups of 1, 2 and 4 ranks. Every rank builds the same unsharded index
of three layers over 11 pages (16 blocks of ``[1, 8]`` each, distinct values) and keeps its
shard of it (``shard_index_pages``). A prompt's rows (the blocks of pages 7, 2, 9 and 4, as a
host prefix cache checkpoints them) are read on every rank and compared with the unsharded
rows; then they are written into the rows of other pages (3, 8, 5 and 10, other owners, as a
restore's new slots are) and each rank's shard is compared with its share of the unsharded
index after the same write. Both in bf16 and in fp8 (the rows travel as bytes); a read of rows
that one rank owns alone, and a read of no owned row at all, are checked too.
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
LAYERS, PAGES, BPP, H, D = 3, 11, 16, 1, 8
PUBLISHED = (7, 2, 9, 4)  # pages of the checkpointed prompt
RESTORED = (3, 8, 5, 10)  # pages of the restore's new slots
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
SEED = 20261214


def _blocks(pages: tuple[int, ...]) -> torch.Tensor:
    """``[16 * len(pages)]`` int64 the logical rows of every block of ``pages``, in order."""
    return (torch.tensor(pages)[:, None] * BPP + torch.arange(BPP)).reshape(-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (``torch.equal`` on them compares fp8 as well)."""
    return t.contiguous().view(torch.uint8)


def _run(shard: Any, dtype: torch.dtype) -> dict[str, Any]:
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import ShardedIndex, ShardedIndexAccess, shard_index_pages

    gen = torch.Generator().manual_seed(SEED)
    whole = [  # each layer's unsharded index, [16 * PAGES, H, D]
        (torch.randn((PAGES * BPP, H, D), generator=gen) * 4).to(dtype) for _ in range(LAYERS)
    ]

    def share(buf: torch.Tensor) -> torch.Tensor:
        pages = shard_index_pages(buf.view(PAGES, BPP, H * D), shard.placement, shard.rank)
        return pages.view(-1, H, D)

    local = [share(buf) for buf in whole]
    index = ShardedIndex(shard, block_topk=4, max_rows=1, device="cpu", path=KernelPath.REFERENCE)
    access = ShardedIndexAccess(index, local)
    rows = _blocks(PUBLISHED)
    read = access.read(rows)
    want = torch.stack([buf[rows] for buf in whole], dim=1)
    n = shard.world_size
    alone = _blocks(tuple(p for p in range(PAGES) if p % n == n - 1)[:2])  # the last rank's
    alone_read = access.read(alone)
    alone_want = torch.stack([buf[alone] for buf in whole], dim=1)
    nobody = access.read(torch.tensor([-1, -1]))
    new_rows = _blocks(RESTORED)
    access.write(new_rows, read)
    for layer, buf in enumerate(whole):  # the unsharded restore
        buf[new_rows] = want[:, layer]
    return {
        "read_shape": list(read.shape),
        "read_equal": torch.equal(_bits(read), _bits(want)),
        "alone_equal": torch.equal(_bits(alone_read), _bits(alone_want)),
        "nobody_zero": bool((_bits(nobody) == 0).all()),
        "restored_equal": [
            torch.equal(_bits(got), _bits(share(buf)))
            for got, buf in zip(local, whole, strict=True)
        ],
        "owned_restored_pages": [p for p in RESTORED if p % n == shard.rank],
    }


def _worker(rank: int, port: int, out_dir: Path) -> None:
    from _gloo import write_group_results

    write_group_results(rank, port, out_dir, WORLD, GROUPS, DTYPES, _run)


# ------------------------------------------------------------------------------ test side


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
    group_runs: Callable[[str, int, Path], dict[tuple[int, int, str], dict[str, Any]]],
) -> dict[tuple[int, int, str], dict[str, Any]]:
    """``{(N, rank, dtype): result}`` for every rank of every group."""
    return group_runs(__file__, WORLD, tmp_path_factory.mktemp("sharded-index-access"))


def test_every_group_size_ran_on_each_of_its_ranks(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    assert set(runs) == {(n, r, d) for n in GROUPS for r in range(n) for d in DTYPES}


def test_a_read_returns_the_unsharded_rows_of_every_layer_on_every_rank(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    """The prompt's rows, ``[R, L, H, D]``, byte for byte the unsharded index's, in bf16 and fp8;
    rows one rank owns alone too (the others send padding only)."""
    for key, result in runs.items():
        assert result["read_shape"] == [len(PUBLISHED) * BPP, LAYERS, H, D], key
        assert result["read_equal"], key
        assert result["alone_equal"], key


def test_rows_no_rank_owns_read_as_zeros(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    for key, result in runs.items():
        assert result["nobody_zero"], key


def test_a_write_into_other_pages_leaves_each_shard_as_the_unsharded_restore_shards(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    """Each rank's shard after the write is its share of the unsharded index after the same
    write: the owned new pages hold the rows, every other block is untouched."""
    for key, result in runs.items():
        assert result["restored_equal"] == [True] * LAYERS, key
    for n in GROUPS[1:]:  # the restored pages are spread: every rank of 2 or 4 owns some
        for rank in range(n):
            assert runs[n, rank, "bf16"]["owned_restored_pages"], (n, rank)


def test_buffers_of_unlike_layers_or_partial_pages_are_refused_by_value() -> None:
    from qsa_core import ShardPlacement
    from qsa_kernels import KernelInputError, KernelPath
    from qsa_kernels.sharded import ShardedIndex, ShardedIndexAccess, ShardGroup

    shard = ShardGroup(ShardPlacement(1, BPP, 4), 0)
    index = ShardedIndex(shard, block_topk=4, max_rows=1, device="cpu", path=KernelPath.REFERENCE)
    one = torch.zeros((BPP, H, D), dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"layer 1's index shard .* \(16, 1, 8\)"):
        ShardedIndexAccess(index, [one, torch.zeros((BPP, H, D), dtype=torch.float32)])
    with pytest.raises(KernelInputError, match=r"whole pages of 16 blocks; got 12 blocks"):
        ShardedIndexAccess(index, [one[:12]])
    with pytest.raises(KernelInputError, match=r"values must be \[R=16, L=1, H, D\]; got \(16, 2"):
        ShardedIndexAccess(index, [one]).write(_blocks((0,)), torch.zeros((BPP, 2, H, D)))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
