"""The offload runtime under ``SGLANG_QSA_CACHE_SHARDING``, on 2 and 4 gloo ranks, against one.

Each rank drives the runtime the offload backend drives, through the backend's translation of
real SGLang ``ForwardBatch`` objects (``stage_chunk``, ``plan_decode``): two requests bound to
lease rows, their prompts staged chunk by chunk (611 tokens in a 512-token chunk and a 99-token
one; then 40 tokens), handed off when decoding starts, and seven decode steps of two QSA layers
with the indexer's block ids. The
ranks of a shard group hold one K/V head and a share of the query heads (the TP head shard),
compute the same K/V and selection, and each keeps its own 16-block pages in its host arena.
The single-rank result is the unsharded store attending every query head over every selected
block. With ``verify`` on, each released row's arena share and tail are compared with the K/V
written, byte for byte (the runtime's own verification counters).

This exercises the wired runtime (the backend only forwards to it); a real TP engine does not
start on the CPU (docs/STATUS.md), and the NCCL runs wait for a multi-GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from qsa_testing import decode_batch, extend_batch, run_on_gloo_ranks

LAYER_IDS = {3: 0, 7: 1}  # SGLang layer id -> QSA ordinal
ROWS, TOPK, MAX_BLOCKS, HQ, D = 4, 16, 300, 4, 64
#: Request slot -> (lease row, prompt chunks). Rows are leased lowest first: row 1 goes to a
#: request that is admitted and aborted before it prefills (:data:`IDLE_SLOT`).
REQUESTS = {5: (0, (512, 99)), 9: (2, (40,))}
IDLE_SLOT = 7
STEPS = 7
SEED = 20261202
SCALE = D**-0.5


def _run(rank: int, world: int) -> dict[str, Any]:
    from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement
    from qsa_kernels import KernelPath
    from qsa_kernels.offload import OffloadedKV, OffloadGeometry, OffloadRuntime
    from qsa_kernels.sharded import ShardGroup
    from qsa_sglang_plugin._adapters._offload import plan_decode, stage_chunk

    placement = ShardPlacement(world, QWEN38_FLASH_NEXT.blocks_per_page, 4)
    group = dist.new_group(list(range(world)))
    assert isinstance(group, dist.ProcessGroup)
    shard = ShardGroup(placement, rank, group)
    heads = slice(rank * HQ // world, (rank + 1) * HQ // world)
    geometry = OffloadGeometry(len(LAYER_IDS), ROWS, TOPK, MAX_BLOCKS, 1, D, torch.bfloat16)
    cpu = torch.device("cpu")
    path = KernelPath.REFERENCE
    runtime = OffloadRuntime(
        OffloadedKV(geometry, cpu, path=path, shard=shard),
        LAYER_IDS,
        TOPK,
        verify=True,
        q_heads=HQ // world,
    )
    single = OffloadedKV(geometry, cpu, path=path)

    gen = torch.Generator().manual_seed(SEED)
    total = max(sum(chunks) for _, chunks in REQUESTS.values()) + STEPS
    kv = torch.randn((2, ROWS, len(LAYER_IDS), total, 1, D), generator=gen).to(torch.bfloat16)
    lengths: dict[int, int] = {}
    idle = None
    for slot, (row, chunks) in REQUESTS.items():
        if row == 2:
            idle = runtime.admit("idle", IDLE_SLOT)
        assert runtime.admit(f"r{slot}", slot).slot == row
        start = 0
        for size in chunks:
            batch = extend_batch([(slot, start, start + size)])
            for layer_id, ordinal in LAYER_IDS.items():
                k = kv[0, row, ordinal, start : start + size].reshape(size, D)
                v = kv[1, row, ordinal, start : start + size].reshape(size, D)
                stage_chunk(runtime, layer_id, k, v, batch)
            start += size
        single.admit(row, kv[0, row, :, :start], kv[1, row, :, :start])
        lengths[slot] = start

    slots = sorted(REQUESTS)
    rows = [REQUESTS[s][0] for s in slots]
    failures: list[str] = []
    for step in range(STEPS):
        seq_lens = [lengths[s] + 1 for s in slots]
        plan_decode(runtime, decode_batch(slots, seq_lens))
        single.advance(rows)
        single.begin_step()
        for layer_id, ordinal in LAYER_IDS.items():
            positions = torch.tensor([lengths[s] for s in slots])
            k_new = kv[0, rows, ordinal, positions]  # [B, 1, D]
            v_new = kv[1, rows, ordinal, positions]
            q = torch.randn((len(slots), HQ, D), generator=gen).to(torch.bfloat16)
            blocks = torch.full((len(slots), TOPK), -1, dtype=torch.int32)
            for b, length in enumerate(seq_lens):
                pick = torch.randperm(length // 4, generator=gen)[:TOPK]
                blocks[b, : pick.numel()] = pick.to(torch.int32)
            single.write_token(ordinal, rows, k_new, v_new)
            want, _ = single.attend(ordinal, rows, q, blocks, scale=SCALE)
            got = runtime.decode_layer(
                layer_id,
                q[:, heads].reshape(len(slots), -1),
                k_new.reshape(len(slots), D),
                v_new.reshape(len(slots), D),
                blocks,
                SCALE,
            )
            try:
                torch.testing.assert_close(
                    got.view(len(slots), -1, D).float(),
                    want[:, heads].float(),
                    rtol=2**-7,
                    atol=1e-3,
                )
            except AssertionError as exc:
                failures.append(f"step {step} layer {layer_id}: {str(exc)[:300]}")
        for s in slots:
            lengths[s] += 1

    arena_bytes = runtime.host_arena_bytes
    tails = sum(lengths[s] % 4 for s in slots) * len(LAYER_IDS) * geometry.record_bytes // 4
    closed = sum(lengths[s] // 4 for s in slots) * len(LAYER_IDS) * geometry.record_bytes
    for slot in slots:
        handle = runtime.leases.at_engine_slot(slot)
        assert handle is not None
        runtime.release(handle)
    assert idle is not None
    runtime.release(idle, aborted=True)
    return {
        "failures": failures,
        "arena_bytes": arena_bytes,
        "unsharded_arena_bytes": geometry.host_bytes,
        "verified": runtime.counts.verified_bytes,
        "differing": runtime.counts.differing_bytes,
        "closed_bytes": closed,
        "tail_bytes": tails,
        "rows_in_use": runtime.rows_in_use,
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world = int(request.param)
    return run_on_gloo_ranks(_run, world, tmp_path_factory.mktemp(f"sharding{world}"))


def test_sharded_decode_equals_one_rank_attending_every_block(ranks: list[Any]) -> None:
    """Every step and layer: each rank's heads equal the unsharded attention, within bf16."""
    for rank, result in enumerate(ranks):
        assert result["failures"] == [], rank


def test_each_rank_holds_its_pages_once_and_byte_for_byte(ranks: list[Any]) -> None:
    """Hand-off and write-backs kept each closed block on one rank only (its owner), as written;
    every rank verified its blocks and the shared open-block tail on release."""
    assert all(r["differing"] == 0 for r in ranks)
    closed, tail = ranks[0]["closed_bytes"], ranks[0]["tail_bytes"]
    assert sum(r["verified"] for r in ranks) == closed + len(ranks) * tail
    assert all(r["rows_in_use"] == 0 for r in ranks)


def test_the_host_arena_divides_over_the_group(ranks: list[Any]) -> None:
    """The group's arenas together are one unsharded arena; no rank holds more than its pages."""
    assert sum(r["arena_bytes"] for r in ranks) == ranks[0]["unsharded_arena_bytes"]
    assert max(r["arena_bytes"] for r in ranks) < ranks[0]["unsharded_arena_bytes"]
