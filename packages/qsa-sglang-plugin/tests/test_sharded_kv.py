"""Resident cache sharding (``SGLANG_QSA_CACHE_SHARDING`` without an offload) on 2 and 4 gloo ranks.

Each rank drives the runtime the sharded backend forwards to, with real SGLang ``ForwardBatch``
objects: an extend batch of two requests with no prefix (a 512-token chunk and a 40-token
prompt: upstream's no-prefix attention over the chunk, the torch path on CPU), then the first
request's second chunk of 99 tokens after its 512-token prefix (owner-side prefill), then six
decode steps of both requests, in two QSA layers. Slots lie on scattered 64-token pages of a
logical pool, as SGLang's paged allocator hands them out. The ranks of a group hold one K/V head
and a share of the query heads (the TP head shard), compute the same K/V and selection, and
each keeps only the logical slots it owns.

The single-rank result: every query token's selected tokens (the indexer's positions mapped
through the slot table) attended over the whole logical pool (``sparse_decode_reference``).
At the end each rank's store must equal its shard of the whole pool, byte for byte.

A real TP engine does not start on the CPU (docs/STATUS.md); the NCCL runs wait for a
multi-GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from qsa_testing import extend_batch, random_block_selection, run_on_gloo_ranks

LAYER_IDS = {3: 0, 7: 1}  # SGLang layer id -> QSA ordinal
TOPK, HQ, D, PAGE = 16, 4, 64, 64
#: Request slot -> its extends, in order: (start, end) token ranges.
CHUNKS = {5: ((0, 512), (512, 611)), 9: ((0, 40),)}
STEPS = 6
POOL_PAGES = 40
SEED = 20261203
SCALE = D**-0.5
RTOL, ATOL = 2**-7, 2e-3


def _run(rank: int, world: int) -> dict[str, Any]:
    from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import ShardedKVStore, ShardGroup, shard_raw_kv
    from qsa_kernels.sparse_decode import sparse_decode_reference
    from qsa_sglang_plugin._adapters._sharded_kv import attend_extend

    placement = ShardPlacement(world, QWEN38_FLASH_NEXT.blocks_per_page, 4)
    group = dist.new_group(list(range(world)))
    assert isinstance(group, dist.ProcessGroup)
    shard = ShardGroup(placement, rank, group)
    heads = slice(rank * HQ // world, (rank + 1) * HQ // world)
    slots = POOL_PAGES * PAGE
    runtime = ShardedKVStore(
        shard,
        LAYER_IDS,
        slots=slots,
        kv_heads=1,
        head_dim=D,
        dtype=torch.bfloat16,
        q_heads=HQ // world,
        block_topk=TOPK,
        max_rows=4,
        device=torch.device("cpu"),
        path=KernelPath.REFERENCE,
    )
    gen = torch.Generator().manual_seed(SEED)
    # The slot table: each request on scattered pages of the logical pool.
    order = torch.randperm(POOL_PAGES, generator=gen)
    req_to_token = torch.zeros((16, 16 * PAGE), dtype=torch.int32)
    for i, slot in enumerate(CHUNKS):
        pages = order[i * 16 : (i + 1) * 16]
        req_to_token[slot] = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).int()
    # The whole logical pool as one rank would hold it: [L, records, 2, 4, 1, D].
    pool = torch.zeros((len(LAYER_IDS), slots // 4, 2, 4, 1, D), dtype=torch.bfloat16)
    failures: list[str] = []

    def attention(
        layer: int, q: torch.Tensor, positions: torch.Tensor, slot_rows: torch.Tensor
    ) -> torch.Tensor:
        """One rank's answer: every query's selected positions, read from the whole pool."""
        valid = positions >= 0
        physical = torch.where(valid, slot_rows.gather(1, positions.clamp(min=0).long()), -1)
        out, _ = sparse_decode_reference(q, physical.to(torch.int32), pool[layer], scale=SCALE)
        return out[:, heads]

    def select(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Random complete blocks per query (``[T, TOPK]``), and as upstream's positions."""
        return random_block_selection(lengths, TOPK, gen)

    def new_kv(layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.randn((slot_ids.numel(), D), generator=gen).to(torch.bfloat16)
        v = torch.randn((slot_ids.numel(), D), generator=gen).to(torch.bfloat16)
        pool[layer, slot_ids // 4, 0, slot_ids % 4, 0] = k
        pool[layer, slot_ids // 4, 1, slot_ids % 4, 0] = v
        return k, v

    extends = [[(5, 0, 512), (9, 0, 40)], [(5, 512, 611)]]
    for step, parts in enumerate(extends):
        loc = torch.cat([req_to_token[s, a:b].long() for s, a, b in parts])
        batch = extend_batch(parts, loc)
        lengths = torch.cat([torch.arange(a, b) + 1 for _, a, b in parts])
        owners = torch.cat([torch.full((b - a,), s) for s, a, b in parts])
        for layer_id, layer in LAYER_IDS.items():
            k, v = new_kv(layer, loc)
            _, positions = select(lengths)
            q = torch.randn((lengths.numel(), HQ, D), generator=gen).to(torch.bfloat16)
            got = attend_extend(
                runtime,
                layer_id,
                q[:, heads].reshape(lengths.numel(), -1),
                k,
                v,
                positions,
                batch,
                req_to_token,
                SCALE,
            )
            want = attention(layer, q, positions, req_to_token[owners].long())
            _compare(failures, f"extend {step} layer {layer_id}", got, want)

    lengths = torch.tensor([611, 40])
    decode_slots = torch.tensor(list(CHUNKS))
    for step in range(STEPS):
        loc = req_to_token[decode_slots, lengths].long()
        lengths = lengths + 1
        for layer_id, layer in LAYER_IDS.items():
            k, v = new_kv(layer, loc)
            blocks, positions = select(lengths)
            q = torch.randn((2, HQ, D), generator=gen).to(torch.bfloat16)
            runtime.write(layer_id, k, v, loc)
            got = runtime.decode(
                layer_id,
                q[:, heads].reshape(2, -1),
                blocks,
                lengths,
                req_to_token[decode_slots],
                SCALE,
            )
            want = attention(layer, q, positions, req_to_token[decode_slots].long())
            _compare(failures, f"decode {step} layer {layer_id}", got, want)

    stores_equal = all(
        torch.equal(runtime.layer(layer_id), shard_raw_kv(pool[layer], placement, rank))
        for layer_id, layer in LAYER_IDS.items()
    )
    return {
        "failures": failures,
        "stores_equal": stores_equal,
        "store_bytes": runtime.nbytes,
        "buffers_priced_as_allocated": runtime.buffer_bytes
        == ShardedKVStore.transport_bytes(
            world_size=world, max_rows=4, block_topk=TOPK, q_heads=HQ // world, head_dim=D
        ),
        "unsharded_bytes": int(pool.nbytes),
        "tokens_written": int(lengths.sum()),
    }


def _compare(failures: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(got.view_as(want).float(), want.float(), rtol=RTOL, atol=ATOL)
    except AssertionError as exc:
        failures.append(f"{what}: {str(exc)[:300]}")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world = int(request.param)
    return run_on_gloo_ranks(_run, world, tmp_path_factory.mktemp(f"sharded_kv{world}"))


def test_sharded_prefill_and_decode_equal_one_rank_over_the_whole_pool(ranks: list[Any]) -> None:
    """No-prefix chunks of two requests together, a chunk after a prefix (owner-side), and six
    decode steps: each rank's heads equal one rank attending the same tokens of the whole
    pool, within bf16."""
    assert [r["failures"] for r in ranks] == [[]] * len(ranks)
    assert {r["tokens_written"] for r in ranks} == {611 + 40 + 2 * STEPS}


def test_each_rank_stores_exactly_its_share_of_the_pool(ranks: list[Any]) -> None:
    """Every rank's store equals its shard of the pool one rank would hold, and costs 1 / N of
    its bytes; pool sizing charges the transport buffers the runtime allocates."""
    assert all(r["stores_equal"] for r in ranks)
    assert all(r["buffers_priced_as_allocated"] for r in ranks)
    world = len(ranks)
    for r in ranks:
        assert r["store_bytes"] * world == r["unsharded_bytes"]
