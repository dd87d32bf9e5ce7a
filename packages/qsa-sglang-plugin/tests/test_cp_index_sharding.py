"""Index sharding (D2) under SGLang's zigzag prefill CP, on gloo ranks: each CP rank's selection
and each rank's index shard against upstream's replicated indexer without CP.

SGLang's own CP machinery runs on the CPU as in ``test_cp_prefill.py``: its ``GroupCoordinator``
over gloo as the attention-CP group (every rank; attention TP 1), its zigzag strategy
(``prepare_cp_forward``), its row sharding (``cp_shard_hidden_states``,
``cp_shard_position_ids``) and its gather into token order (``cp_materialize_global_token_order``).
Each rank activates the plugin with ``SGLANG_QSA_INDEX_SHARDING=1`` (its pool hooked: ``1 / N``
of the index pages) and installs its index shard on a group of ``N`` ranks: every rank (2 of 2),
or half of them (2 of 4: two index groups inside one CP group). A one-request prompt of 1,033
tokens on scattered pages is prefilled as upstream's ``forward_cuda_cp`` runs the indexer:

- writes: each rank's raw index keys of its zigzag rows are gathered into token order, and the
  chunk's closed blocks (here the sum of each block's four keys: the compress itself is not under
  test) go through the hooked ``set_qsa_compressed_k_buffer`` on every rank, which keeps the
  owned ones; after each chunk every rank's shard must equal its share of upstream's whole index
  after the same writes (``shard_index_pages``);
- selection: the hooked ``get_prefill_mqa_inputs`` with the rank's zigzag positions and
  ``query_sequence_ids`` (as ``forward_cuda_cp`` calls it), then ``select_prefill_tokens`` with
  the rank's queries; every row's set must equal the same row of upstream's unhooked selection
  of the whole chunk over the whole index without CP, for the first chunk (``[0, 700)``, no
  prefix) and the next (``[700, 1033)``, after it), in candidate groups of 64 rows.

Index values are multiples of 1/64 (exact scores in any summation order), so the selections are
compared as sets.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from qsa_testing import (
    IndexPoolShape,
    Platform,
    current_platform,
    extend_batch,
    run_on_gloo_ranks,
    zigzag_prefill_cp,
)

pytestmark = pytest.mark.skipif(
    current_platform() is not Platform.CPU,
    reason="gloo ranks with SGLang's CPU collectives and indexer paths",
)

LAYER_IDS = (3, 7)
SHAPE = IndexPoolShape(layer_ids=LAYER_IDS)
PAGE, RATIO, DIM = SHAPE.page, SHAPE.ratio, SHAPE.index_dim
HEADS, BLOCK_TOPK, GROUP_ROWS = 4, SHAPE.block_topk, 64
SLOT = 1
CHUNKS = ((0, 700), (700, 1033))
SEED = 20261216


def _grid(shape: tuple[int, ...], low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 multiples of 1/64 in ``[low / 64, high / 64]`` (exact products and sums)."""
    return (torch.randint(low, high + 1, shape, generator=gen).float() / 64).to(torch.bfloat16)


def _slot_table() -> torch.Tensor:
    """``[8, POOL_PAGES * PAGE]`` request :data:`SLOT` on scattered pages (page 0 is padding)."""
    pages = -(-CHUNKS[-1][1] // PAGE)
    chosen = torch.randperm(SHAPE.pages - 1, generator=torch.Generator().manual_seed(SEED))
    table = torch.zeros((8, SHAPE.pages * PAGE), dtype=torch.int32)
    slots = (chosen[:pages, None] + 1) * PAGE + torch.arange(PAGE)
    table[SLOT, : pages * PAGE] = slots.reshape(-1).int()
    return table


def _run(rank: int, world: int, *, index_world: int) -> dict[str, Any]:
    from qsa_testing.standins import install_cpu_engine_standins

    install_cpu_engine_standins()
    with zigzag_prefill_cp(rank, world):
        return _scenario(rank, world, index_world)


def _install_index(rank: int, world: int, index_world: int) -> Any:
    """This rank's index shard on its group of ``index_world`` consecutive ranks."""
    from qsa_core import ShardPlacement
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import ShardedIndex, ShardGroup
    from qsa_sglang_plugin._adapters._sharded_index import install_sharded_index

    mine = None
    for start in range(0, world, index_world):  # new_group is collective: every rank, in order
        group = dist.new_group(list(range(start, start + index_world)))
        if start <= rank < start + index_world and isinstance(group, dist.ProcessGroup):
            placement = ShardPlacement(index_world, PAGE // RATIO, RATIO)
            mine = ShardGroup(placement, rank - start, group)
    assert mine is not None
    install_sharded_index(
        ShardedIndex(
            mine,
            block_topk=BLOCK_TOPK,
            max_rows=GROUP_ROWS,
            device="cpu",
            path=KernelPath.REFERENCE,
        )
    )
    return mine


def _scenario(rank: int, world: int, index_world: int) -> dict[str, Any]:
    from sglang.srt.layers.attention.qsa.metadata import QSAIndexerMetadata
    from sglang.srt.layers.attention.qsa.qsa_indexer import QSAIndexer
    from sglang.srt.layers.cp.utils import (
        cp_materialize_global_token_order,
        cp_shard_hidden_states,
        cp_shard_position_ids,
        prepare_cp_forward,
    )
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    from qsa_sglang_plugin._activation import activate

    upstream = {
        "prefill": QSAIndexer.select_prefill_tokens,
        "inputs": QSAIndexerMetadata.get_prefill_mqa_inputs,
        "write": QSATokenToKVPool.set_qsa_compressed_k_buffer,
    }
    full = SHAPE.pool(QSATokenToKVPool)  # built before activation: upstream's replicated pool
    os.environ.update(SGLANG_QSA_CACHE_SHARDING=str(index_world), SGLANG_QSA_INDEX_SHARDING="1")
    activate()
    shard = _install_index(rank, world, index_world)
    pool = SHAPE.pool(QSATokenToKVPool)
    indexer = SHAPE.indexer(QSAIndexer, LAYER_IDS[0], HEADS)
    table = _slot_table()
    gen = torch.Generator().manual_seed(SEED + 1)
    failures: list[str] = []
    local_rows: list[int] = []
    stored: list[bool] = []
    for start, end in CHUNKS:
        batch = extend_batch([(SLOT, start, end)])
        batch.positions = torch.arange(start, end)
        prepare_cp_forward(batch)  # SGLang's zigzag metadata for this rank
        meta = batch.attn_cp_metadata
        num_local = int(meta.total_q_prev_tokens + meta.total_q_next_tokens)
        local_rows.append(num_local)
        positions = torch.arange(start, end)
        requests = torch.zeros(end - start, dtype=torch.int64)
        local_positions = cp_shard_position_ids(positions, batch)[:num_local]
        local_requests = cp_shard_hidden_states(requests, batch)[:num_local]
        fields = {
            "sequence_lengths": torch.tensor([end], dtype=torch.int32),
            "token_to_batch_idx": requests,
            "token_slot_table": table[[SLOT]],
            "prefill_sequence_lengths_cpu": (end,),
        }
        for layer in LAYER_IDS:
            # Raw index keys of every token; each rank projects its zigzag rows only.
            keys = _grid((end - start, DIM), -16, 32, gen)
            mine = cp_shard_hidden_states(keys, batch)[:num_local].contiguous()
            gathered = cp_materialize_global_token_order(mine, batch)
            closed = (end - start) // RATIO  # the chunks start on block boundaries
            blocks = gathered[: closed * RATIO].view(closed, RATIO, 1, DIM).float().sum(1)
            whole = keys[: closed * RATIO].view(closed, RATIO, 1, DIM).float().sum(1)
            locs = table[SLOT, start : start + closed * RATIO : RATIO].long() // RATIO
            pool.set_qsa_compressed_k_buffer(layer, locs, blocks.to(torch.bfloat16))
            upstream["write"](full, layer, locs, whole.to(torch.bfloat16))
            stored.append(SHAPE.holds_its_share(pool, full, layer, shard.placement, shard.rank))
            q = _grid((end - start, HEADS, DIM), 0, 128, gen)
            lengths = torch.full((end - start,), end)
            ranges = upstream["inputs"](
                SHAPE.metadata(QSAIndexerMetadata, full, **fields), layer, positions
            )
            want = upstream["prefill"](indexer, q, *ranges[:3], positions, lengths)
            want = cp_shard_hidden_states(want, batch)[:num_local]
            got_in = SHAPE.metadata(QSAIndexerMetadata, pool, **fields).get_prefill_mqa_inputs(
                layer, local_positions, query_sequence_ids=local_requests
            )
            q_local = cp_shard_hidden_states(q, batch)[:num_local]
            got = indexer.select_prefill_tokens(
                q_local, *got_in[:3], local_positions, lengths[:num_local]
            )
            differ = int((got.sort(dim=1).values != want.sort(dim=1).values).any(dim=1).sum())
            if got.shape != want.shape or differ:
                failures.append(f"chunk [{start}, {end}) layer {layer}: {differ} rows differ")
    owned = int(
        (table[SLOT, : CHUNKS[-1][1] : PAGE].long() // PAGE % index_world == shard.rank).sum()
    )
    return {
        "failures": failures,
        "local_rows": local_rows,
        "stored": stored,
        "owned_pages": owned,
    }


@pytest.fixture(scope="module", params=[(2, 2), (4, 2)], ids=lambda p: f"cp{p[0]}-index{p[1]}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world, index_world = request.param
    scenario = functools.partial(_run, index_world=index_world)
    return run_on_gloo_ranks(scenario, world, tmp_path_factory.mktemp(f"d2-cp{world}"))


def test_each_cp_rank_selects_its_zigzag_rows_as_upstreams_replicated_selection(
    ranks: list[Any],
) -> None:
    """With and without a prefix, every CP rank's rows select upstream's sets over the whole
    index, whether the index group is the CP group or half of it."""
    for rank, result in enumerate(ranks):
        assert result["failures"] == [], rank


def test_the_cp_ranks_rows_partition_each_chunk(ranks: list[Any]) -> None:
    """Each rank selected for its own zigzag rows only (the rows of one chunk sum to it), and
    the ranks' row counts differ (the row gather is ragged)."""
    for index, (start, end) in enumerate(CHUNKS):
        counts = [result["local_rows"][index] for result in ranks]
        assert sum(counts) == end - start
    assert any(len({r["local_rows"][i] for r in ranks}) > 1 for i in range(len(CHUNKS)))


def test_each_rank_stores_its_share_of_the_unsharded_index_after_a_cp_prefill(
    ranks: list[Any],
) -> None:
    """Every rank writes every closed block it gathered and keeps its pages: after each chunk
    the shard equals ``shard_index_pages`` of upstream's whole index (each block once, on its
    owner, so a later decode reads the right keys)."""
    for rank, result in enumerate(ranks):
        assert result["stored"] == [True] * len(CHUNKS) * len(LAYER_IDS), rank
        assert result["owned_pages"] > 0, rank
