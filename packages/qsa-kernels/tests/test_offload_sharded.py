"""The offloaded K/V under a shard group, on N gloo processes (N = 1, 2, 4), against one rank.

One module fixture starts four CPU processes once (``python this_file.py``, gloo over
``127.0.0.1``); they form groups of 1, 2 and 4 ranks holding the same K/V head, with the group's
four query heads split over them (the TP head shard). Each rank builds the same requests from one
seed: a 611-token prompt (152 blocks on pages 0-9), a 258-token prompt admitted as a 160-token
restored prefix plus 98 new tokens, and a 40-token prompt whose blocks all lie on page 0. Nine
decode steps follow (blocks close, page 9 fills; some steps padded to four rows as a CUDA graph
pads them), each layer attending a seeded selection of complete blocks. Every rank runs the
sharded store (its pages only, the open block on rank 0) with the queries all-gathered and the
partials merged (:func:`qsa_kernels.sharded.gather_group_queries`,
:func:`~qsa_kernels.sharded.merge_owner_partials`), and an unsharded store with all four heads,
and compares its own heads.

The three cases an upstream review of QSA cache sharding found broken each have a test: writes
that skip the owner mapping (every rank's arena holds exactly its pages, byte for byte), a rank
without local work that the merge still needs (a row with no block on a rank), and global block
ids read from a rank-local cache (selected ids beyond a rank's arena).
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
SEED = 20261202
LAYERS, ROWS, HQ, HKV, D = 2, 4, 4, 1, 64
TOPK, MAX_BLOCKS = 24, 200  # hot slots = top-k; 800 tokens a row
#: Row -> (prompt tokens, restored prefix blocks).
PROMPTS = {0: (611, 0), 1: (258, 40), 2: (40, 0)}
STEPS = 9
PADDED_STEPS = (2, 5)  # padded to ROWS rows with the free row 3, as a captured graph is
PATHS = ("reference", "triton")
#: Output tolerance per path (rtol 2^-7 on top): both stores round once to bf16 after fp32 merges
#: in different orders; the Triton decode's P.V operands are bf16.
OUT_ATOL = {"reference": 1e-3, "triton": 2**-6}


# ------------------------------------------------------------------------------ worker side


def _selection(gen: torch.Generator, lengths: list[int]) -> torch.Tensor:
    """``[B, TOPK]`` int32: up to TOPK distinct complete blocks per row, any order, -1 padded."""
    out = torch.full((len(lengths), TOPK), -1, dtype=torch.int32)
    for b, length in enumerate(lengths):
        closed = length // 4
        pick = torch.randperm(closed, generator=gen)[:TOPK] if closed else torch.empty(0)
        out[b, : pick.numel()] = pick.to(torch.int32)
    return out


def _run(shard: Any, path_name: str) -> dict[str, Any]:
    """One group size and kernel path on this rank: the scenario, compared with one rank."""
    from _gloo import mismatch  # the workers run as scripts beside it
    from qsa_kernels import KernelPath
    from qsa_kernels.offload import OffloadedKV, OffloadGeometry
    from qsa_kernels.sharded import (
        HeadLayout,
        ShardedDecodeBuffers,
        gather_group_queries,
        merge_owner_partials,
    )

    path = KernelPath(path_name)
    n, rank = shard.world_size, shard.rank
    heads = slice(rank * HQ // n, (rank + 1) * HQ // n)
    geometry = OffloadGeometry(LAYERS, ROWS, TOPK, MAX_BLOCKS, HKV, D, torch.bfloat16)
    cpu = torch.device("cpu")
    sharded = OffloadedKV(geometry, cpu, path=path, shard=shard)
    single = OffloadedKV(geometry, cpu, path=path)
    buffers = ShardedDecodeBuffers.allocate(
        world_size=n,
        max_rows=ROWS,
        topk=TOPK,
        q_heads=HQ,
        head_dim=D,
        layout=HeadLayout.SHARDED,
        device=cpu,
    )
    gen = torch.Generator().manual_seed(SEED)
    total = max(t for t, _ in PROMPTS.values()) + STEPS
    kv = torch.randn((2, ROWS, LAYERS, total, HKV, D), generator=gen).to(torch.bfloat16)
    for row, (tokens, prefix_blocks) in PROMPTS.items():
        first = prefix_blocks * 4
        k, v = kv[0, row, :, first:tokens], kv[1, row, :, first:tokens]
        prefix = None
        if prefix_blocks:
            shape = (LAYERS, prefix_blocks, 4, HKV, D)
            prefix = torch.stack(
                (kv[0, row, :, :first].reshape(shape), kv[1, row, :, :first].reshape(shape)), 2
            )
        for store in (sharded, single):
            store.admit(row, k, v, prefix=prefix)

    rows = sorted(PROMPTS)
    failures: list[str] = []
    empty_partials = 0
    most_selected = 0
    for step in range(STEPS):
        pad_to = ROWS if step in PADDED_STEPS else None
        step_rows = sharded.advance(rows, pad_to=pad_to)
        assert single.advance(rows, pad_to=pad_to) == step_rows
        sharded.begin_step()
        single.begin_step()
        lengths = [sharded.length(r) for r in rows]
        real = len(rows)
        for layer in range(LAYERS):
            new = kv[:, rows, layer, torch.tensor(lengths) - 1]  # [2, B, Hkv, D]
            pad = torch.zeros((2, len(step_rows) - real, HKV, D), dtype=torch.bfloat16)
            k_new, v_new = torch.cat((new, pad), dim=1)
            q = torch.randn((len(step_rows), HQ, D), generator=gen).to(torch.bfloat16)
            blocks = _selection(gen, [*lengths, *([0] * (len(step_rows) - real))])
            most_selected = max(most_selected, int(blocks.max()))
            for store in (sharded, single):
                store.write_token(layer, step_rows, k_new, v_new)
            want, _ = single.attend(layer, step_rows, q, blocks)
            q_full = gather_group_queries(q[:, heads], shard=shard, buffers=buffers)
            out, lse = sharded.attend(layer, step_rows, q_full, blocks, out_dtype=torch.float32)
            empty_partials += int(torch.isneginf(lse[:real]).all(dim=1).sum())
            got, _ = merge_owner_partials(out, lse, shard=shard, buffers=buffers, path=path)
            error = mismatch(
                got[:real].float(),
                want[:real, heads].float(),
                rtol=2**-7,
                atol=OUT_ATOL[path_name],
            )
            if error:
                failures.append(f"step {step} layer {layer}: {error}")

    compared = differing = 0
    lengths_now = [sharded.length(r) for r in rows]
    for row in rows:
        length = sharded.length(row)
        result = sharded.compare(row, kv[0, row, :, :length], kv[1, row, :, :length])
        compared += result.bytes_compared
        differing += result.bytes_differing
    return {
        "failures": failures,
        "empty_partials": empty_partials,
        "most_selected": most_selected,
        "arena_blocks": int(sharded.host_arena.shape[2]),
        "arena_bytes": int(sharded.host_arena.nbytes),
        "geometry_arena_bytes": geometry.arena_bytes(sharded.shard),
        "compared_bytes": compared,
        "differing_bytes": differing,
        "tail_bytes": LAYERS * geometry.record_bytes // 4 * sum(n % 4 for n in lengths_now),
        "record_bytes": geometry.record_bytes,
        "lengths": lengths_now,
    }


def _worker(rank: int, port: int, out_dir: Path) -> None:
    from _gloo import write_group_results

    write_group_results(rank, port, out_dir, WORLD, GROUPS, {p: p for p in PATHS}, _run)


# ------------------------------------------------------------------------------ test side


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
    group_runs: Callable[[str, int, Path], dict[tuple[int, int, str], dict[str, Any]]],
) -> dict[tuple[int, int, str], dict[str, Any]]:
    """``{(N, rank, path): result}`` for every rank of every group."""
    return group_runs(__file__, WORLD, tmp_path_factory.mktemp("offload-sharded"))


def test_every_group_size_ran_on_each_of_its_ranks(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    assert set(runs) == {(n, r, p) for n in GROUPS for r in range(n) for p in PATHS}


def test_merged_owner_partials_equal_one_rank_attending_everything(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    """Every step, layer and real row: the rank's heads equal the unsharded store's."""
    for key, result in runs.items():
        assert result["failures"] == [], key


def test_each_rank_arena_holds_exactly_its_pages_byte_for_byte(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    """Prompt hand-off, restored prefix and decode write-backs land on the block's owner only,
    at its local id: the arenas of a group partition the rows' blocks, each byte as written."""
    for n in GROUPS:
        for path in PATHS:
            ranks = [runs[n, r, path] for r in range(n)]
            assert all(r["differing_bytes"] == 0 for r in ranks), (n, path)
            assert sum(r["arena_blocks"] for r in ranks) == MAX_BLOCKS
            for r in ranks:
                assert r["arena_bytes"] == r["geometry_arena_bytes"]
            closed = sum(length // 4 for length in ranks[0]["lengths"])
            tail = ranks[0]["tail_bytes"]
            blocks_bytes = closed * LAYERS * ranks[0]["record_bytes"]
            # Every rank compares its own blocks and the (replicated) tail.
            assert sum(r["compared_bytes"] for r in ranks) == blocks_bytes + n * tail


def test_a_rank_holding_none_of_a_rows_blocks_still_joins_the_merge(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    """The 40-token row lies on page 0: ranks 1.. hold nothing of it and send (0, -inf)
    partials every step (the merged output still equals one rank's, above)."""
    for (_n, rank, _path), result in runs.items():
        if rank == 0:
            assert result["empty_partials"] == 0
        else:
            assert result["empty_partials"] >= STEPS * LAYERS  # at least that row, every step


def test_selected_blocks_beyond_a_ranks_arena_are_read_at_their_local_ids(
    runs: dict[tuple[int, int, str], dict[str, Any]],
) -> None:
    """Global block ids larger than a rank's whole arena were selected, and read correctly."""
    for n in GROUPS[1:]:
        for rank in range(n):
            result = runs[n, rank, "reference"]
            assert result["most_selected"] >= result["arena_blocks"]
            assert result["failures"] == []


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
