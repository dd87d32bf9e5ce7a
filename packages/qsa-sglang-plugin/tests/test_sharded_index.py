"""Index sharding (``SGLANG_QSA_INDEX_SHARDING=1``, D2) through SGLang's own QSA pool and indexer,
on 2 and 4 gloo ranks.

Each rank activates the plugin as ``load_plugins()`` would (cache sharding over all ranks, index
sharding on), so SGLang's ``QSATokenToKVPool``, ``QSAIndexerMetadata`` and ``QSAIndexer`` run
with the plugin's hooks; before activating, it builds the same pool unhooked and keeps
upstream's methods, the replicated baseline. Both pools get the same compressed blocks through
``set_qsa_compressed_k_buffer`` (five requests on scattered 64-token pages of a 128-page pool;
index values multiples of 1/64, so every score is exact whatever the summation order), then:

- a decode batch of one row per request, through ``get_decode_mqa_inputs`` and
  ``select_decode_tokens`` (token positions, and block ids with ``defer_expansion``);
- a chunked prefill batch of two requests after their prefixes (40 rows at 2400..2439, 24 rows
  at 2100..2123), through ``get_prefill_mqa_inputs`` and ``select_prefill_tokens``, in
  candidate groups of 8 rows.

Every row's selected set must equal upstream's over the whole index, on every rank. Request
``ONE_RANK`` lies on pages of the last rank only (the others have no local candidate, and the
merge still needs that rank's), request ``HIGH`` on the highest pages (page ids past the local
shard's length: read as local ids they would be out of range). The rows' top-k boundaries are
checked free of ties, so the comparison is of sets, not of a tie rule.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from qsa_testing import IndexPoolShape, Platform, current_platform, run_on_gloo_ranks

pytestmark = pytest.mark.skipif(
    current_platform() is not Platform.CPU,
    reason="gloo ranks with SGLang's CPU indexer paths",
)

LAYER_IDS = (3, 7)
SHAPE = IndexPoolShape(layer_ids=LAYER_IDS)
PAGE, RATIO, DIM, BUDGET = SHAPE.page, SHAPE.ratio, SHAPE.index_dim, SHAPE.token_topk
HEADS = 4
BLOCK_TOPK = SHAPE.block_topk
POOL_PAGES = SHAPE.pages
#: Request slot -> tokens written to the index.
LENGTHS = {1: 2600, 2: 700, 3: 2200, 4: 100, 5: 2100}
ONE_RANK, HIGH = 4, 5
#: Prefill rows: (request slot, first position, rows).
CHUNKS = ((1, 2400, 40), (3, 2100, 24), (4, 90, 10), (5, 2088, 12))
GROUP_ROWS = 8
SEED = 20261205


def _pages(world: int) -> dict[int, torch.Tensor]:
    """Each request's pages: ``ONE_RANK`` on the last rank's, ``HIGH`` on the highest, the
    others scattered over the rest (page 0 is SGLang's padding page)."""
    gen = torch.Generator().manual_seed(SEED)
    npages = {slot: -(-n // PAGE) for slot, n in LENGTHS.items()}
    high = list(range(POOL_PAGES - npages[HIGH], POOL_PAGES))
    last_rank = [p for p in range(1, POOL_PAGES) if p % world == world - 1 and p not in high]
    one = last_rank[-npages[ONE_RANK] :]
    rest = [p for p in range(1, POOL_PAGES) if p not in high and p not in one]
    order = [rest[i] for i in torch.randperm(len(rest), generator=gen).tolist()]
    out = {HIGH: torch.tensor(high), ONE_RANK: torch.tensor(one)}
    for slot in (1, 2, 3):
        out[slot], order = torch.tensor(order[: npages[slot]]), order[npages[slot] :]
    assert all(out[slot].numel() == npages[slot] for slot in LENGTHS), "the pool is too small"
    return out


def _grid(shape: tuple[int, ...], low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 multiples of 1/64 in ``[low / 64, high / 64]`` (exact products and sums)."""
    return (torch.randint(low, high + 1, shape, generator=gen).float() / 64).to(torch.bfloat16)


def _run(rank: int, world: int) -> dict[str, Any]:
    from qsa_testing.standins import install_cpu_engine_standins

    install_cpu_engine_standins()
    from sglang.srt.layers.attention.qsa.metadata import QSAIndexerMetadata
    from sglang.srt.layers.attention.qsa.qsa_indexer import QSAIndexer
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    upstream = {
        "decode": QSAIndexer.select_decode_tokens,
        "prefill": QSAIndexer.select_prefill_tokens,
        "inputs": QSAIndexerMetadata.get_prefill_mqa_inputs,
        "write": QSATokenToKVPool.set_qsa_compressed_k_buffer,
    }
    full = SHAPE.pool(QSATokenToKVPool)  # built before activation: upstream's replicated pool
    os.environ.update(SGLANG_QSA_CACHE_SHARDING=str(world), SGLANG_QSA_INDEX_SHARDING="1")
    from qsa_core import ShardPlacement
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import ShardedIndex, ShardGroup
    from qsa_sglang_plugin._activation import activate
    from qsa_sglang_plugin._adapters._sharded_index import install_sharded_index

    activate()
    hooked = {
        name: fn is not getattr(_owner(name), _METHODS[name]) for name, fn in upstream.items()
    }
    group = dist.new_group(list(range(world)))
    assert isinstance(group, dist.ProcessGroup)
    shard = ShardGroup(ShardPlacement(world, PAGE // RATIO, RATIO), rank, group)
    install_sharded_index(
        ShardedIndex(
            shard,
            block_topk=BLOCK_TOPK,
            max_rows=GROUP_ROWS,
            device="cpu",
            path=KernelPath.REFERENCE,
        )
    )
    with _Allocations() as allocations:  # the hook keeps this rank's pages only
        pool = SHAPE.pool(QSATokenToKVPool)
    from types import SimpleNamespace

    config = SimpleNamespace(
        indexer_n_heads=HEADS,
        indexer_kv_heads=1,
        indexer_head_dim=DIM,
        indexer_budget=BUDGET,
        indexer_compress_ratio=RATIO,
        hidden_size=64,
        rms_norm_eps=1e-6,
    )
    indexer = QSAIndexer(config, LAYER_IDS[0], rotary_emb=SimpleNamespace(rotary_dim=64))
    pages = _pages(world)
    table = torch.zeros((8, POOL_PAGES * PAGE), dtype=torch.int32)
    for slot, p in pages.items():
        table[slot, : p.numel() * PAGE] = (p[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).int()
    gen = torch.Generator().manual_seed(SEED + 1)
    for layer in LAYER_IDS:
        for slot, n in LENGTHS.items():
            locs = table[slot, : n // RATIO * RATIO : RATIO].long() // RATIO
            keys = _grid((locs.numel(), 1, DIM), -64, 128, gen)
            upstream["write"](full, layer, locs, keys)
            pool.set_qsa_compressed_k_buffer(layer, locs, keys)
    failures: dict[int, list[str]] = {}
    stored = {
        layer: SHAPE.holds_its_share(pool, full, layer, shard.placement, rank)
        for layer in LAYER_IDS
    }
    rows = _decode(indexer, upstream, full, pool, table, gen, failures, QSAIndexerMetadata)
    rows += _prefill(indexer, upstream, full, pool, table, gen, failures, QSAIndexerMetadata)
    index_bytes = [
        sum(t.numel() * t.element_size() for t in p.qsa_compressed_k_buffer_pool)
        for p in (pool, full)
    ]
    local_pages = shard.placement.local_capacity(POOL_PAGES)
    owned = {slot: int((p % world == rank).sum()) * (PAGE // RATIO) for slot, p in pages.items()}
    return {
        "owned_blocks": owned,
        "high_pages_past_local": bool((pages[HIGH] >= local_pages).all()),
        "hooked": hooked,
        "stored": [stored[layer] for layer in LAYER_IDS],
        "failures": failures,
        "rows": rows,
        "index_bytes": index_bytes[0],
        "full_index_bytes": index_bytes[1],
        "mem_usage": [pool.mem_usage, full.mem_usage],
        # Every tensor the hooked pool's construction made with the whole index's shape, by
        # the device it went to.
        "whole_index_allocations": [
            device
            for shape, device in allocations.made
            if shape == tuple(full.qsa_compressed_flat.shape)
        ],
    }


class _Allocations(TorchFunctionMode):
    """Records the shape and device type of every tensor a factory call makes."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], str]] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.zeros, torch.empty, torch.ones, torch.full) and isinstance(
            out, torch.Tensor
        ):
            self.made.append((tuple(out.shape), out.device.type))
        return out


_METHODS = {
    "decode": "select_decode_tokens",
    "prefill": "select_prefill_tokens",
    "inputs": "get_prefill_mqa_inputs",
    "write": "set_qsa_compressed_k_buffer",
}


def _owner(name: str) -> type:
    from sglang.srt.layers.attention.qsa.metadata import QSAIndexerMetadata
    from sglang.srt.layers.attention.qsa.qsa_indexer import QSAIndexer
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    owners: dict[str, type] = {
        "inputs": QSAIndexerMetadata,
        "write": QSATokenToKVPool,
        "decode": QSAIndexer,
        "prefill": QSAIndexer,
    }
    return owners[name]


def _compare(  # noqa: PLR0917
    failures: dict[int, list[str]],
    what: str,
    got: torch.Tensor,
    want: torch.Tensor,
    logits: torch.Tensor,
    row_slots: list[int],
) -> None:
    """Row sets equal; each row's top-k boundary is free of ties (else the test data is bad).
    Failures are filed under the row's request slot."""
    for row in range(want.shape[0]):
        where = failures.setdefault(row_slots[row], [])
        scores = logits[row][torch.isfinite(logits[row])].sort(descending=True).values
        if scores.numel() > BLOCK_TOPK and scores[BLOCK_TOPK - 1] == scores[BLOCK_TOPK]:
            where.append(f"{what} row {row}: a tie at the top-k boundary (test data)")
        a, b = got[row].sort().values, want[row].sort().values
        if not torch.equal(a, b):
            diff = (a != b).sum().item()
            where.append(f"{what} row {row}: {diff} of {a.numel()} selections differ")


def _decode(  # noqa: PLR0917
    indexer: Any,
    upstream: dict[str, Any],
    full: Any,
    pool: Any,
    table: torch.Tensor,
    gen: torch.Generator,
    failures: dict[int, list[str]],
    meta_cls: type,
) -> int:
    from sglang.srt.layers.attention.qsa.mqa import torch_qsa_mqa_decode

    slots = list(LENGTHS)
    lengths = torch.tensor([LENGTHS[s] for s in slots], dtype=torch.int32)
    fields = {
        "sequence_lengths": lengths,
        "token_to_batch_idx": torch.arange(len(slots)),
        "token_slot_table": table[slots],
    }
    positions = lengths.long() - 1
    for layer in LAYER_IDS:
        q = _grid((len(slots), HEADS, DIM), 0, 128, gen)
        want_in = SHAPE.metadata(meta_cls, full, **fields).get_decode_mqa_inputs(layer)
        got_in = SHAPE.metadata(meta_cls, pool, **fields).get_decode_mqa_inputs(layer)
        logits = torch_qsa_mqa_decode(q, *want_in)
        for defer in (False, True):
            want = upstream["decode"](indexer, q, *want_in, positions, lengths, defer)
            got = indexer.select_decode_tokens(q, *got_in, positions, lengths, defer)
            what = f"decode layer {layer} {'blocks' if defer else 'tokens'}"
            _compare(failures, what, got, want, logits, slots)
    return len(slots)


def _prefill(  # noqa: PLR0917
    indexer: Any,
    upstream: dict[str, Any],
    full: Any,
    pool: Any,
    table: torch.Tensor,
    gen: torch.Generator,
    failures: dict[int, list[str]],
    meta_cls: type,
) -> int:
    from sglang.srt.layers.attention.qsa.mqa import torch_qsa_mqa_prefill

    slots = [slot for slot, _, _ in CHUNKS]
    ends = [start + rows for _, start, rows in CHUNKS]
    positions = torch.cat([torch.arange(start, start + rows) for _, start, rows in CHUNKS])
    fields = {
        "sequence_lengths": torch.tensor(ends, dtype=torch.int32),
        "token_to_batch_idx": torch.cat(
            [torch.full((rows,), i) for i, (_, _, rows) in enumerate(CHUNKS)]
        ),
        "token_slot_table": table[slots],
        "prefill_sequence_lengths_cpu": tuple(ends),
    }
    row_lengths = torch.tensor(ends).repeat_interleave(torch.tensor([r for _, _, r in CHUNKS]))
    for layer in LAYER_IDS:
        q = _grid((positions.numel(), HEADS, DIM), 0, 128, gen)
        keys, starts, row_ends, _ = upstream["inputs"](
            SHAPE.metadata(meta_cls, full, **fields), layer, positions
        )
        want = upstream["prefill"](indexer, q, keys, starts, row_ends, positions, row_lengths)
        logits = torch_qsa_mqa_prefill(q, keys, starts, row_ends)
        width = int((row_ends - starts).max())
        relative = torch.full((positions.numel(), width), -torch.inf)
        for row in range(positions.numel()):
            span = logits[row, int(starts[row]) : int(row_ends[row])]
            relative[row, : span.numel()] = span
        got_in = SHAPE.metadata(meta_cls, pool, **fields).get_prefill_mqa_inputs(layer, positions)
        got = indexer.select_prefill_tokens(q, *got_in[:3], positions, row_lengths)
        row_slots = [slot for slot, _, rows in CHUNKS for _ in range(rows)]
        _compare(failures, f"prefill layer {layer}", got, want, relative, row_slots)
    return positions.numel()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world = request.param
    return run_on_gloo_ranks(_run, world, tmp_path_factory.mktemp(f"d2-{world}"))


def test_index_sharding_hooks_upstreams_pool_and_indexer(ranks: list[Any]) -> None:
    """Activation puts the plugin around upstream's selection, prefill inputs and index writes."""
    for result in ranks:
        assert result["hooked"] == dict.fromkeys(_METHODS, True)


def test_selection_equals_upstreams_replicated_selection(ranks: list[Any]) -> None:
    """Decode (positions and deferred block ids) and chunked prefill after a prefix: every row's
    set equals upstream's over the whole index, on every rank."""
    for rank, result in enumerate(ranks):
        assert {s: f for s, f in result["failures"].items() if f} == {}, rank
        assert result["rows"] == len(LENGTHS) + sum(r for _, _, r in CHUNKS)
        assert sorted(int(s) for s in result["failures"]) == sorted(LENGTHS)


def test_a_request_whose_blocks_are_all_on_one_rank_selects_them_on_every_rank(
    ranks: list[Any],
) -> None:
    """``ONE_RANK`` (decode and prefill rows) has no local candidate on all ranks but the last;
    those ranks still join the candidate exchange and select the last rank's blocks."""
    world = len(ranks)
    for rank, result in enumerate(ranks):
        owned = result["owned_blocks"][str(ONE_RANK)]
        assert (owned > 0) == (rank == world - 1), (rank, owned)
        assert result["failures"][str(ONE_RANK)] == [], rank


def test_pages_past_the_local_shard_are_selected_by_their_global_block_ids(
    ranks: list[Any],
) -> None:
    """``HIGH`` lies on page ids beyond every rank's local page count: its blocks are scored at
    their local pages and reported as request-relative ids, equal to upstream's."""
    for rank, result in enumerate(ranks):
        assert result["high_pages_past_local"], rank
        assert result["failures"][str(HIGH)] == [], rank


def test_each_rank_stores_exactly_its_pages(ranks: list[Any]) -> None:
    """Writes through ``set_qsa_compressed_k_buffer`` leave each rank's buffer equal to
    ``shard_index_pages`` of upstream's whole buffer: owned blocks at their local slots, nothing
    else."""
    for result in ranks:
        assert result["stored"] == [True] * len(LAYER_IDS)
        assert sum(result["owned_blocks"].values()) > 0


def test_index_pool_holds_one_nth_of_its_pages(ranks: list[Any]) -> None:
    """Each rank's compressed-key buffers hold ``ceil(P / N)`` of the ``P`` pages, and SGLang's
    memory report counts that."""
    world = len(ranks)
    for result in ranks:
        full = result["full_index_bytes"]
        pages = full // (len(LAYER_IDS) * (PAGE // RATIO) * DIM * 2)
        assert result["index_bytes"] == full // pages * -(-pages // world)
        assert result["mem_usage"][0] < result["mem_usage"][1]


def test_no_rank_ever_allocates_the_whole_index(ranks: list[Any]) -> None:
    """Upstream's constructor makes its whole compressed-key buffer once, on the meta device
    (no memory); the rank's shard is the only real index buffer (its size: the next test)."""
    for result in ranks:
        assert result["whole_index_allocations"] == ["meta"]


def test_a_qsa_pool_whose_pages_are_not_the_kernels_is_refused_by_value() -> None:
    """Index sharding pages the index in 16 blocks of 4 tokens; another geometry is named."""
    from types import SimpleNamespace

    from qsa_sglang_plugin._adapters._sharded_index import index_shard
    from qsa_sglang_plugin._errors import ConfigurationError

    good = SimpleNamespace(
        qsa_compressed_page_size=16, qsa_compress_ratio=4, qsa_compressed_capacity=33
    )
    assert index_shard(good, 2).local_pages == 2
    pool = SimpleNamespace(
        qsa_compressed_page_size=8, qsa_compress_ratio=4, qsa_compressed_capacity=8
    )
    with pytest.raises(ConfigurationError, match=r"16 blocks of 4 tokens; .* has 8 blocks of 4"):
        index_shard(pool, 2)


def test_a_prefill_selection_without_its_sharded_inputs_is_refused() -> None:
    """Row ranges that did not come from the hooked ``get_prefill_mqa_inputs`` (whose keys would
    be read at logical slots of a rank-local buffer) stop the selection."""
    from types import SimpleNamespace

    from qsa_core import ShardPlacement
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import ShardedIndex, ShardGroup
    from qsa_sglang_plugin._adapters._sharded_index import (
        around_select_prefill_tokens,
        install_sharded_index,
    )
    from qsa_sglang_plugin._errors import OffloadRuntimeError

    shard = ShardGroup(ShardPlacement(1, PAGE // RATIO, RATIO), 0)
    index = ShardedIndex(
        shard, block_topk=BLOCK_TOPK, max_rows=4, device="cpu", path=KernelPath.REFERENCE
    )
    install_sharded_index(index)
    rows = torch.zeros(3, dtype=torch.int32)
    q = torch.zeros((3, HEADS, DIM), dtype=torch.bfloat16)
    indexer = SimpleNamespace(index_n_heads=HEADS)
    try:
        with pytest.raises(OffloadRuntimeError, match="did not come from get_prefill_mqa_inputs"):
            around_select_prefill_tokens(None, indexer, q, q[:0], rows, rows, rows, rows)
    finally:
        install_sharded_index(None)
