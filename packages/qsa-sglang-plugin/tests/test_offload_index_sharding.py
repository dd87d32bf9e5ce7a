"""Index sharding (D2) with ``p2-offload``: SGLang's indexer, hooked, feeding the offload
runtime, on 2 and 4 gloo ranks.

Each rank activates the plugin as ``load_plugins()`` would with
``SGLANG_QSA_HISPARSE_V3=p2-offload``, ``SGLANG_QSA_CACHE_SHARDING=N`` and
``SGLANG_QSA_INDEX_SHARDING=1``, builds the offload runtime on its shard group (host arenas of
every ``N``-th page, the TP head split) and installs the runtime's index shard as the runtime
build does (``install_rank_index(runtime.index(), ...)``). SGLang's own ``QSATokenToKVPool``
(hooked: ``1 / N`` of the index pages), ``QSAIndexerMetadata`` and ``QSAIndexer`` select; the
baseline is the same pool built before activation with upstream's unhooked methods (the
replicated selection) feeding an unsharded offload runtime that holds every query head.

Three requests on scattered 64-token pages of a 128-page pool (``ONE_RANK`` on the last rank's
pages only, ``HIGH`` on the highest page ids) are prefilled through SGLang ``ForwardBatch``
objects: earlier chunks staged (``stage_chunk``: ``LONG``'s first 2,304 tokens and ``HIGH``'s
2,200), then ``LONG``'s 320-token chunk after its prefix (candidate groups of 256 and 64 rows)
and ``ONE_RANK``'s 200-token prompt selected and attended through ``extend_layer``; then five
decode steps of all three through ``plan_decode`` and ``decode_layer`` with the hooked
selection's block ids (``defer_expansion``). Index values are multiples of 1/64 (exact scores
in any summation order) and every row's top-k boundary is checked free of ties, so the
selections are compared as sets.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from qsa_kernels.sharded import PREFILL_GROUP_ROWS
from qsa_testing import (
    IndexPoolShape,
    Platform,
    current_platform,
    decode_batch,
    extend_batch,
    run_on_gloo_ranks,
)

pytestmark = pytest.mark.skipif(
    current_platform() is not Platform.CPU,
    reason="gloo ranks with SGLang's CPU indexer paths",
)

LAYERS = {3: 0, 7: 1}  # SGLang layer id -> QSA ordinal
SHAPE = IndexPoolShape(layer_ids=tuple(LAYERS))
PAGE, RATIO, DIM, BUDGET = SHAPE.page, SHAPE.ratio, SHAPE.index_dim, SHAPE.token_topk
HEADS = 4
BLOCK_TOPK = SHAPE.block_topk
HQ, D = 4, 64  # attention query heads of the group's K/V head, head dim
POOL_PAGES = SHAPE.pages
LONG, SHORT, ONE_RANK = 1, 2, 3
#: Request slot -> (tokens staged as earlier chunks, tokens of the chunk attended after them).
#: ``HIGH`` is ``SHORT``: the highest page ids.
CHUNKS = {LONG: (2304, 320), SHORT: (2200, 0), ONE_RANK: (0, 200)}
HIGH = SHORT
STEPS = 5
MAX_BLOCKS = 700
SEED = 20261211
SCALE = D**-0.5


def _pages(world: int) -> dict[int, torch.Tensor]:
    """Each request's pages: ``ONE_RANK`` on the last rank's, ``HIGH`` on the highest, ``LONG``
    scattered over the rest (page 0 is SGLang's padding page)."""
    gen = torch.Generator().manual_seed(SEED)
    npages = {slot: -(-(sum(c) + STEPS) // PAGE) for slot, c in CHUNKS.items()}
    high = list(range(POOL_PAGES - npages[HIGH], POOL_PAGES))
    last_rank = [p for p in range(1, POOL_PAGES) if p % world == world - 1 and p not in high]
    one = last_rank[-npages[ONE_RANK] :]
    rest = [p for p in range(1, POOL_PAGES) if p not in high and p not in one]
    order = torch.randperm(len(rest), generator=gen)[: npages[LONG]].tolist()
    return {
        HIGH: torch.tensor(high),
        ONE_RANK: torch.tensor(one),
        LONG: torch.tensor([rest[i] for i in order]),
    }


def _grid(shape: tuple[int, ...], low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 multiples of 1/64 in ``[low / 64, high / 64]`` (exact products and sums)."""
    return (torch.randint(low, high + 1, shape, generator=gen).float() / 64).to(torch.bfloat16)


def _compare(  # noqa: PLR0917
    failures: dict[str, list[str]],
    what: str,
    got: torch.Tensor,
    want: torch.Tensor,
    logits: torch.Tensor,
    topk: int,
) -> None:
    """Row sets equal; each row's top-k boundary free of ties (else the test data is bad)."""
    where = failures.setdefault(what.split(maxsplit=1)[0], [])
    for row in range(want.shape[0]):
        scores = logits[row][torch.isfinite(logits[row])].sort(descending=True).values
        if scores.numel() > topk and scores[topk - 1] == scores[topk]:
            where.append(f"{what} row {row}: a tie at the top-k boundary (test data)")
        a, b = got[row].sort().values, want[row].sort().values
        if not torch.equal(a, b):
            where.append(f"{what} row {row}: {int((a != b).sum())} of {a.numel()} differ")


def _close(failures: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    except AssertionError as exc:
        failures.append(f"{what}: {str(exc)[:300]}")


class _Rank:
    """One rank's hooked pool and sharded runtime beside the replicated baseline."""

    def __init__(self, rank: int, world: int) -> None:
        from qsa_testing.standins import install_cpu_engine_standins

        install_cpu_engine_standins()
        from sglang.srt.layers.attention.qsa.metadata import QSAIndexerMetadata
        from sglang.srt.layers.attention.qsa.qsa_indexer import QSAIndexer
        from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

        self.upstream = {
            "decode": QSAIndexer.select_decode_tokens,
            "prefill": QSAIndexer.select_prefill_tokens,
            "inputs": QSAIndexerMetadata.get_prefill_mqa_inputs,
            "write": QSATokenToKVPool.set_qsa_compressed_k_buffer,
        }
        self.meta_cls = QSAIndexerMetadata
        self.full = SHAPE.pool(QSATokenToKVPool)  # built before activation: upstream's whole index
        os.environ.update(
            SGLANG_QSA_MODEL_COMPAT="1",
            SGLANG_QSA_HISPARSE_V3="p2-offload",
            SGLANG_QSA_CACHE_SHARDING=str(world),
            SGLANG_QSA_INDEX_SHARDING="1",
        )
        from qsa_core import ShardPlacement
        from qsa_kernels import KernelPath
        from qsa_kernels.offload import OffloadedKV, OffloadGeometry, OffloadRuntime
        from qsa_kernels.sharded import ShardGroup
        from qsa_sglang_plugin._activation import activate
        from qsa_sglang_plugin._adapters._sharded_index import install_rank_index

        activate()
        self.hooked = QSAIndexer.select_decode_tokens is not self.upstream["decode"]
        group = dist.new_group(list(range(world)))
        assert isinstance(group, dist.ProcessGroup)
        self.rank, self.world = rank, world
        self.shard = ShardGroup(ShardPlacement(world, PAGE // RATIO, RATIO), rank, group)
        self.heads = slice(rank * HQ // world, (rank + 1) * HQ // world)
        geometry = OffloadGeometry(
            len(LAYERS), 4, BLOCK_TOPK, MAX_BLOCKS, 1, D, torch.bfloat16, staged_prompts=3
        )
        cpu, path = torch.device("cpu"), KernelPath.REFERENCE
        self.runtime = OffloadRuntime(
            OffloadedKV(geometry, cpu, path=path, shard=self.shard),
            LAYERS,
            BLOCK_TOPK,
            verify=True,
            q_heads=HQ // world,
        )
        self.single = OffloadRuntime(OffloadedKV(geometry, cpu, path=path), LAYERS, BLOCK_TOPK)
        self.pool = SHAPE.pool(QSATokenToKVPool)  # the hook keeps this rank's pages only
        install_rank_index(self.runtime.index(), self.pool, rank)
        config = {
            "indexer_n_heads": HEADS,
            "indexer_kv_heads": 1,
            "indexer_head_dim": DIM,
            "indexer_budget": BUDGET,
            "indexer_compress_ratio": RATIO,
            "hidden_size": 64,
            "rms_norm_eps": 1e-6,
        }
        from types import SimpleNamespace

        self.indexer = QSAIndexer(
            SimpleNamespace(**config), 3, rotary_emb=SimpleNamespace(rotary_dim=64)
        )
        self.table = torch.zeros((8, POOL_PAGES * PAGE), dtype=torch.int32)
        for slot, p in _pages(world).items():
            slots = (p[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).int()
            self.table[slot, : slots.numel()] = slots
        self.gen = torch.Generator().manual_seed(SEED + 1)
        self.failures: dict[str, list[str]] = {}
        self.outputs: list[str] = []

    def write_index(self) -> None:
        """Every request's compressed blocks, through each pool's ``set_qsa_compressed_k_buffer``.

        Written up front for every token the test will hold (a selection reads only the blocks
        its row's length makes complete).
        """
        for layer in LAYERS:
            for slot, chunks in CHUNKS.items():
                n = sum(chunks) + STEPS
                locs = self.table[slot, : n // RATIO * RATIO : RATIO].long() // RATIO
                keys = _grid((locs.numel(), 1, DIM), -64, 128, self.gen)
                self.upstream["write"](self.full, layer, locs, keys)
                self.pool.set_qsa_compressed_k_buffer(layer, locs, keys)

    def prefill(self, kv: dict[int, torch.Tensor]) -> int:
        """Earlier chunks staged; then each attended chunk: both selections, ``extend_layer``."""
        from sglang.srt.layers.attention.qsa.mqa import torch_qsa_mqa_prefill

        from qsa_sglang_plugin._adapters._offload import extend_layer, stage_chunk
        from qsa_sglang_plugin._adapters._qsa_common import prefill_kernels

        rows = 0
        for slot, (staged, _) in CHUNKS.items():
            for runtime in (self.runtime, self.single):
                runtime.admit(f"r{slot}", slot)
                if staged:
                    batch = extend_batch([(slot, 0, staged)])
                    for layer, ordinal in LAYERS.items():
                        k, v = kv[slot][0, ordinal, :staged], kv[slot][1, ordinal, :staged]
                        stage_chunk(runtime, layer, k, v, batch)
        for slot, (start, size) in CHUNKS.items():
            if size:
                end = start + size
                positions = torch.arange(start, end)
                fields = {
                    "sequence_lengths": torch.tensor([end], dtype=torch.int32),
                    "token_to_batch_idx": torch.zeros(size, dtype=torch.int64),
                    "token_slot_table": self.table[[slot]],
                    "prefill_sequence_lengths_cpu": (end,),
                }
                row_lengths = torch.full((size,), end)
                batch = extend_batch([(slot, start, end)])
                for layer, ordinal in LAYERS.items():
                    iq = _grid((size, HEADS, DIM), 0, 128, self.gen)
                    keys, starts, ends, _ = self.upstream["inputs"](
                        SHAPE.metadata(self.meta_cls, self.full, **fields), layer, positions
                    )
                    want = self.upstream["prefill"](
                        self.indexer, iq, keys, starts, ends, positions, row_lengths
                    )
                    logits = torch_qsa_mqa_prefill(iq, keys, starts, ends)
                    relative = torch.full((size, int((ends - starts).max())), -torch.inf)
                    for row in range(size):
                        span = logits[row, int(starts[row]) : int(ends[row])]
                        relative[row, : span.numel()] = span
                    got_meta = SHAPE.metadata(self.meta_cls, self.pool, **fields)
                    got_in = got_meta.get_prefill_mqa_inputs(layer, positions)
                    got = self.indexer.select_prefill_tokens(
                        iq, *got_in[:3], positions, row_lengths
                    )
                    what = f"prefill slot {slot} [{start}, {end}) layer {layer}"
                    _compare(self.failures, what, got, want, relative, BLOCK_TOPK)
                    q = torch.randn((size, HQ, D), generator=self.gen).to(torch.bfloat16)
                    k, v = kv[slot][0, ordinal, start:end], kv[slot][1, ordinal, start:end]
                    out = extend_layer(
                        self.runtime, layer, q[:, self.heads].contiguous(), k, v, got, batch,
                        scale=SCALE, kernels=prefill_kernels(),
                    )  # fmt: skip
                    base = extend_layer(
                        self.single, layer, q, k, v, want, batch,
                        scale=SCALE, kernels=prefill_kernels(),
                    )  # fmt: skip
                    _close(self.outputs, what, out, base[:, self.heads])
                rows += size
        return rows

    def decode(self, kv: dict[int, torch.Tensor]) -> int:
        """``STEPS`` steps of every request: hooked block ids into the sharded runtime."""
        from sglang.srt.layers.attention.qsa.mqa import torch_qsa_mqa_decode

        from qsa_sglang_plugin._adapters._offload import plan_decode

        slots = list(CHUNKS)
        lengths = [sum(CHUNKS[s]) for s in slots]
        for step in range(STEPS):
            seq_lens = [n + 1 for n in lengths]
            batch = decode_batch(slots, seq_lens)
            plan_decode(self.runtime, batch)
            plan_decode(self.single, batch)
            lens = torch.tensor(seq_lens, dtype=torch.int32)
            fields = {
                "sequence_lengths": lens,
                "token_to_batch_idx": torch.arange(len(slots)),
                "token_slot_table": self.table[slots],
            }
            positions = lens.long() - 1
            for layer, ordinal in LAYERS.items():
                iq = _grid((len(slots), HEADS, DIM), 0, 128, self.gen)
                want_meta = SHAPE.metadata(self.meta_cls, self.full, **fields)
                got_meta = SHAPE.metadata(self.meta_cls, self.pool, **fields)
                want_in = want_meta.get_decode_mqa_inputs(layer)
                got_in = got_meta.get_decode_mqa_inputs(layer)
                want = self.upstream["decode"](self.indexer, iq, *want_in, positions, lens, True)
                got = self.indexer.select_decode_tokens(iq, *got_in, positions, lens, True)
                logits = torch_qsa_mqa_decode(iq, *want_in)
                what = f"decode step {step} layer {layer}"
                _compare(self.failures, what, got, want, logits, BLOCK_TOPK)
                k = torch.stack([kv[s][0, ordinal, n] for s, n in zip(slots, lengths, strict=True)])
                v = torch.stack([kv[s][1, ordinal, n] for s, n in zip(slots, lengths, strict=True)])
                q = torch.randn((len(slots), HQ, D), generator=self.gen).to(torch.bfloat16)
                out = self.runtime.decode_layer(
                    layer, q[:, self.heads].reshape(len(slots), -1), k, v, got, SCALE
                )
                base = self.single.decode_layer(layer, q.reshape(len(slots), -1), k, v, want, SCALE)
                _close(
                    self.outputs,
                    what,
                    out.view(len(slots), -1, D),
                    base.view(len(slots), HQ, D)[:, self.heads],
                )
            lengths = seq_lens
        return len(slots) * STEPS


def _run(rank: int, world: int) -> dict[str, Any]:
    r = _Rank(rank, world)
    from qsa_sglang_plugin._adapters._sharded_index import sharded_index

    gen = torch.Generator().manual_seed(SEED + 2)
    kv = {  # [2, L, T, Hkv * D] each request's K/V, the same on every rank
        slot: torch.randn((2, len(LAYERS), sum(c) + STEPS, D), generator=gen).to(torch.bfloat16)
        for slot, c in CHUNKS.items()
    }
    r.write_index()
    index = sharded_index()
    prefill_rows = r.prefill(kv)
    decode_rows = r.decode(kv)
    stored = [
        SHAPE.holds_its_share(r.pool, r.full, layer, r.shard.placement, rank) for layer in LAYERS
    ]
    pages = _pages(world)
    local_pages = r.shard.placement.local_capacity(POOL_PAGES)
    for slot in CHUNKS:
        for runtime in (r.runtime, r.single):
            handle = runtime.leases.at_engine_slot(slot)
            assert handle is not None
            runtime.release(handle)
    return {
        "hooked": r.hooked,
        "index_on_runtime_group": index.shard is r.runtime.kv.shard,
        "index_rows": index.buffers.max_rows,
        "failures": r.failures,
        "outputs": r.outputs,
        "rows": [prefill_rows, decode_rows],
        "stored": stored,
        "owned_one_rank_pages": int((pages[ONE_RANK] % world == rank).sum()),
        "high_pages_past_local": bool((pages[HIGH] >= local_pages).all()),
        "arena_bytes": r.runtime.host_arena_bytes,
        "unsharded_arena_bytes": r.single.host_arena_bytes,
        "verified": r.runtime.counts.verified_bytes,
        "differing": r.runtime.counts.differing_bytes,
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world = request.param
    return run_on_gloo_ranks(_run, world, tmp_path_factory.mktemp(f"d2-offload-{world}"))


def test_the_offload_runtime_installs_the_index_shard_on_its_own_group(ranks: list[Any]) -> None:
    """Activation hooks upstream's indexer; the installed index shard is the runtime's, on the
    host arenas' shard group, its candidate buffers for a prefill group of rows."""
    for result in ranks:
        assert result["hooked"]
        assert result["index_on_runtime_group"]
        assert result["index_rows"] == PREFILL_GROUP_ROWS


def test_decode_selection_equals_upstreams_replicated_selection_row_for_row(
    ranks: list[Any],
) -> None:
    """Every decode row's block ids (``defer_expansion``, the offload's form) are upstream's over
    the whole index, on every rank, including the request on one rank's pages and the one on
    page ids past every rank's local shard."""
    for rank, result in enumerate(ranks):
        assert result["failures"]["decode"] == [], rank
        assert result["rows"][1] == len(CHUNKS) * STEPS
        assert result["high_pages_past_local"], rank
    world = len(ranks)
    assert [r["owned_one_rank_pages"] > 0 for r in ranks] == [r == world - 1 for r in range(world)]


def test_chunked_prefill_after_a_prefix_selects_upstreams_rows(ranks: list[Any]) -> None:
    """Every prefill row (the 320-token chunk after a 2,304-token prefix, in candidate groups of
    256 rows, and the 200-token prompt on one rank's pages) selects upstream's token positions,
    on every rank."""
    for rank, result in enumerate(ranks):
        assert result["failures"]["prefill"] == [], rank
        assert result["rows"][0] == sum(size for _, size in CHUNKS.values())


def test_offloaded_attention_from_the_hooked_selection_equals_the_unsharded_offload(
    ranks: list[Any],
) -> None:
    """Prefill (over the staged prompt) and decode (from each rank's host arena, merged over the
    group) fed by the hooked selection give each rank's heads the unsharded offload's output fed
    by upstream's selection, within bf16."""
    for rank, result in enumerate(ranks):
        assert result["outputs"] == [], rank


def test_each_rank_holds_its_index_pages_and_its_arena_pages_once(ranks: list[Any]) -> None:
    """Each rank's index buffer is ``shard_index_pages`` of upstream's whole one; the arenas add
    up to one unsharded arena, and every rank verified its rows byte for byte on release."""
    assert sum(r["arena_bytes"] for r in ranks) == ranks[0]["unsharded_arena_bytes"]
    for result in ranks:
        assert result["stored"] == [True] * len(LAYERS)
        assert result["differing"] == 0
        assert result["verified"] > 0
