"""The host prefix cache with index sharding (D2, ``p2-offload``, D1 groups of N), on 2 gloo
ranks: a prompt checkpointed from each rank's index shard and loaded back into other slots (the
access's reads and writes on 1, 2 and 4 ranks: qsa-kernels' ``test_sharded_index_access.py``).

Each rank activates the plugin as ``load_plugins()`` would with
``SGLANG_QSA_HISPARSE_V3=p2-offload``, ``SGLANG_QSA_CACHE_SHARDING=N``,
``SGLANG_QSA_INDEX_SHARDING=1`` and ``SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB=64`` (the switches
accept them together), builds SGLang's own ``QSATokenToKVPool`` (hooked: ``1 / N`` of the index
pages) and installs a ``ShardedIndex`` on its shard group, as the offload's runtime build does.
The baseline is the same pool built before activation (upstream's whole index) with a prefix
cache over its buffers.

A 2,560-token prompt (640 index blocks, more than the 512 a query selects) on 40 scattered
pages has its index written through each pool's ``set_qsa_compressed_k_buffer``; each rank's
``PromptCache`` over ``checkpoint_index(pool, index_sharded=True)`` (agreeing over a gloo group)
publishes it, and loads it into the slots of 40 other pages (other owners), as the baseline
does. Each rank's shard must then be its share of the baseline's restored index, page for page,
and a decode row over the restored pages must select upstream's blocks over the baseline. A
second publish that one rank has no room for is refused on every rank (after the collective
read every rank made) without a hang.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from qsa_testing import IndexPoolShape, Platform, current_platform, run_on_gloo_ranks

pytestmark = pytest.mark.skipif(
    current_platform() is not Platform.CPU,
    reason="gloo ranks with SGLang's CPU indexer paths",
)

LAYERS = (3, 7)  # SGLang's ids of the QSA layers
SHAPE = IndexPoolShape(layer_ids=LAYERS)
PAGE, RATIO, DIM = SHAPE.page, SHAPE.ratio, SHAPE.index_dim
PROMPT_PAGES = 40
TOKENS = PROMPT_PAGES * PAGE
HEADS = 4
SEED = 20261214


class _Request:
    """A request the prompt cache keys (weakly referenced, as SGLang's ``Req``)."""

    rid = "req-d2"


REQUEST = _Request()


def _grid(shape: tuple[int, ...], low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 multiples of 1/64 in ``[low / 64, high / 64]`` (exact products and sums)."""
    return (torch.randint(low, high + 1, shape, generator=gen).float() / 64).to(torch.bfloat16)


def _slots(pages: list[int]) -> torch.Tensor:
    """``[64 * len(pages)]`` int64 the token slots of ``pages``, in order."""
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def _pages() -> tuple[list[int], list[int]]:
    """The published prompt's pages and the restore's (disjoint, scattered; page 0 is padding)."""
    order = torch.randperm(SHAPE.pages - 1, generator=torch.Generator().manual_seed(SEED)) + 1
    return order[:PROMPT_PAGES].tolist(), order[PROMPT_PAGES : 2 * PROMPT_PAGES].tolist()


def _cache(index: Any, budget_mb: int, group: Any) -> Any:
    """A prompt cache over ``index`` (whole buffers or an access), every request unbypassed."""
    from qsa_hostcache import CacheNamespace, PromptCache

    namespace = CacheNamespace("qsa-test@1", "bfloat16", 1, 0, "cfg")
    return PromptCache.in_host_memory(
        budget_mb << 20,
        index,
        RATIO,
        max_entries=4,
        page_size=PAGE,
        device="cpu",
        group=group,
        extras=lambda request: {},
        namespace=lambda request: namespace,
        request_id=lambda request: request.rid,
    )


def _selection(upstream: dict[str, Any], full: Any, pool: Any, table: torch.Tensor) -> list[str]:
    """A decode row at the prompt's end over ``table``: hooked over ``pool`` against upstream's
    selection over ``full``, as sets; the top-k boundary must be free of ties (test data)."""
    from sglang.srt.layers.attention.qsa.metadata import QSAIndexerMetadata
    from sglang.srt.layers.attention.qsa.mqa import torch_qsa_mqa_decode
    from sglang.srt.layers.attention.qsa.qsa_indexer import QSAIndexer

    indexer = SHAPE.indexer(QSAIndexer, LAYERS[0], HEADS)
    gen = torch.Generator().manual_seed(SEED + 1)
    lens = torch.tensor([TOKENS], dtype=torch.int32)
    fields = {"sequence_lengths": lens, "token_to_batch_idx": torch.arange(1)}
    fields["token_slot_table"] = table
    failures = []
    for layer in LAYERS:
        iq = _grid((1, HEADS, DIM), 0, 128, gen)
        want_in = SHAPE.metadata(QSAIndexerMetadata, full, **fields).get_decode_mqa_inputs(layer)
        got_in = SHAPE.metadata(QSAIndexerMetadata, pool, **fields).get_decode_mqa_inputs(layer)
        positions = lens.long() - 1
        want = upstream["decode"](indexer, iq, *want_in, positions, lens, True)
        got = indexer.select_decode_tokens(iq, *got_in, positions, lens, True)
        scores = torch_qsa_mqa_decode(iq, *want_in)[0].sort(descending=True).values
        k = SHAPE.block_topk
        if scores[k - 1] == scores[k]:
            failures.append(f"layer {layer}: a tie at the top-k boundary (test data)")
        if not torch.equal(got[0].sort().values, want[0].sort().values):
            failures.append(f"layer {layer}: {int((got != want).sum())} of {k} differ")
    return failures


def _run(rank: int, world: int) -> dict[str, Any]:
    from qsa_testing.standins import install_cpu_engine_standins

    install_cpu_engine_standins()
    from sglang.srt.layers.attention.qsa.qsa_indexer import QSAIndexer
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    upstream = {
        "decode": QSAIndexer.select_decode_tokens,
        "write": QSATokenToKVPool.set_qsa_compressed_k_buffer,
    }
    full = SHAPE.pool(QSATokenToKVPool)  # built before activation: upstream's whole index
    os.environ.update(
        SGLANG_QSA_MODEL_COMPAT="1",
        SGLANG_QSA_HISPARSE_V3="p2-offload",
        SGLANG_QSA_CACHE_SHARDING=str(world),
        SGLANG_QSA_INDEX_SHARDING="1",
        SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB="64",
    )
    from qsa_core import ShardPlacement
    from qsa_hostcache import TokenSlots
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import ShardedIndex, ShardGroup
    from qsa_sglang_plugin._activation import activate
    from qsa_sglang_plugin._adapters._prefix import checkpoint_index
    from qsa_sglang_plugin._adapters._sharded_index import install_rank_index
    from qsa_sglang_plugin._switches import current_switches

    activate()
    switches = current_switches()
    group = dist.new_group(list(range(world)))
    assert isinstance(group, dist.ProcessGroup)
    shard = ShardGroup(ShardPlacement(world, PAGE // RATIO, RATIO), rank, group)
    pool = SHAPE.pool(QSATokenToKVPool)  # the hook keeps this rank's pages only
    index = ShardedIndex(
        shard,
        block_topk=SHAPE.block_topk,
        max_rows=ShardedIndex.rows_for(8),
        device="cpu",
        path=KernelPath.REFERENCE,
    )
    install_rank_index(index, pool, rank)

    published, restored = _pages()
    slots = _slots(published)
    gen = torch.Generator().manual_seed(SEED)
    for layer in LAYERS:
        locs = slots[::RATIO] // RATIO
        keys = _grid((locs.numel(), 1, DIM), -64, 128, gen)
        upstream["write"](full, layer, locs, keys)
        pool.set_qsa_compressed_k_buffer(layer, locs, keys)
    kv = [torch.randn((TOKENS, 1, SHAPE.head_dim), generator=gen) for _ in range(2 * len(LAYERS))]
    tokens = list(range(TOKENS))

    def publish(cache: Any) -> bool:
        fence = cache.publish(
            REQUEST, tokens, lambda: (kv[: len(LAYERS)], kv[len(LAYERS) :]), lambda: slots
        )
        if fence is not None:
            fence.synchronize()
        return fence is not None

    agree = dist.new_group(list(range(world)), backend="gloo")
    sharded = _cache(checkpoint_index(pool, index_sharded=True), 64, agree)
    baseline = _cache(full.qsa_compressed_k_buffer_pool, 64, None)
    cramped = _cache(checkpoint_index(pool, index_sharded=True), 1 if rank else 64, agree)
    published_ok = [publish(sharded), publish(baseline)]
    cramped_ok = publish(cramped)
    new_slots = _slots(restored)
    loaded = []
    for cache in (sharded, baseline):
        hit = cache.lookup(REQUEST, tokens)
        slot_pool = TokenSlots(lambda n: new_slots[:n], lambda taken: None)
        taken = cache.load(REQUEST, tokens, slot_pool)
        loaded.append((hit, None if taken is None else taken.tolist() == new_slots.tolist()))
    stored = [SHAPE.holds_its_share(pool, full, layer, shard.placement, rank) for layer in LAYERS]
    restored_rows = new_slots[::RATIO] // RATIO
    filled = [
        bool(full.get_qsa_compressed_k_buffer(layer)[restored_rows].float().abs().sum() > 0)
        for layer in LAYERS
    ]
    table = torch.zeros((1, SHAPE.pages * PAGE), dtype=torch.int32)
    table[0, :TOKENS] = new_slots.int()
    return {
        "accepted": switches.index_sharding and switches.prefix_cache_mb == 64,
        "local_blocks": int(pool.get_qsa_compressed_k_buffer(LAYERS[0]).shape[0]),
        "published": published_ok,
        "cramped_published": cramped_ok,
        "loaded": loaded,
        "stored": stored,
        "baseline_filled": filled,
        "owned_restored_pages": sum(p % world == rank for p in restored),
        "selection": _selection(upstream, full, pool, table),
    }


@pytest.fixture(scope="module", params=[2], ids=lambda w: f"{w}ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world = request.param
    return run_on_gloo_ranks(_run, world, tmp_path_factory.mktemp(f"d2-prefix-{world}"))


def test_the_switches_accept_index_sharding_with_the_prefix_cache(ranks: list[Any]) -> None:
    """Activation takes the four switches together; each rank's pool holds ``1 / N`` pages."""
    world = len(ranks)
    for result in ranks:
        assert result["accepted"]
        assert result["local_blocks"] == -(-SHAPE.pages // world) * PAGE // RATIO


def test_a_prompt_checkpointed_from_the_shards_loads_back_on_every_rank(ranks: list[Any]) -> None:
    """Published (the sharded and the whole-index caches), found at its 2,560 tokens and loaded
    into the new slots, on every rank."""
    for rank, result in enumerate(ranks):
        assert result["published"] == [True, True], rank
        assert result["loaded"] == [[TOKENS, True], [TOKENS, True]], rank


def test_each_rank_holds_its_share_of_the_unsharded_restore_page_for_page(
    ranks: list[Any],
) -> None:
    """After the load into pages of other owners, each rank's index shard is
    ``shard_index_pages`` of the whole-index cache's restored index, every layer; every rank
    owns some of the restored pages, and the baseline's restored rows are not empty."""
    for rank, result in enumerate(ranks):
        assert result["stored"] == [True] * len(LAYERS), rank
        assert result["baseline_filled"] == [True] * len(LAYERS), rank
        assert result["owned_restored_pages"] > 0, rank


def test_a_decode_row_over_the_restored_prompt_selects_upstreams_blocks(ranks: list[Any]) -> None:
    """The hooked selection over the restored shards equals upstream's over the restored whole
    index (640 blocks, 512 selected), on every rank."""
    for rank, result in enumerate(ranks):
        assert result["selection"] == [], rank


def test_a_publish_one_rank_has_no_room_for_is_refused_on_every_rank(ranks: list[Any]) -> None:
    """Rank 1.. have a 1 MiB arena (less than the checkpoint): every rank made the collective
    read, then agreed on no checkpoint; none hung."""
    for rank, result in enumerate(ranks):
        assert result["cramped_published"] is False, rank
