"""Context-parallel prefill through the plugin's QSA backends, on 2 and 4 gloo ranks, against one.

SGLang's own CP machinery runs for real on the CPU: its ``GroupCoordinator`` over gloo as the
attention-CP group (the TP group, as SGLang's QSA prefill CP requires), its zigzag strategy
(``prepare_cp_forward`` builds the metadata, padding each rank's rows to the physical length),
its row sharding and its K/V gather in token order (``_gather_cp_kv``, as upstream's QSA backend
calls it). Every rank computes the same prompt (611 tokens: a 512-token chunk, then a 99-token
chunk after it), shards each QSA layer's queries, K/V and selected token positions into its two
zigzag blocks as the model would, and runs the backend's ``forward_extend`` on them; gathered
back into token order, the outputs must equal one rank prefilling the same chunks without CP
through the unsharded offload backend (verified against upstream in real engines). Seven decode
steps follow. Three stores:

- ``offload``: every rank stages the whole gathered chunk; prefill and decode equal one rank bit
  for bit (the CPU attention is upstream's per-row torch reference), the staging area holds the
  whole prompt byte for byte, and the host arena row verifies byte for byte on release.
- ``offload_sharded`` (cache sharding with the offload): the same staging, the hand-off keeping
  each rank's pages; decode attends owner-side with every head on every rank (REPLICATED: CP
  leaves attention TP at 1) and merges the group's partials; the ranks' arenas together verify
  every token once.
- ``resident_sharded`` (cache sharding alone): each rank stores the gathered chunk's owned slots;
  the no-prefix chunk attends the rank's rows over the gathered chunk, the chunk after a prefix
  attends owner-side on rows gathered back into token order; each store equals its shard of the
  prompt's K/V byte for byte. Owner-side results equal one rank within bf16.

The backends' constructors need a whole model runner; the test builds each instance without it
and gives it the attributes its prefill and decode read (its runtime, upstream's pending CP
gather, None, and for the resident store the slot table). The overlap of the gather on a CUDA
side stream (``prefetch_cp_kv``) and the CUDA kernel's zigzag entries need a GPU
(``test_context_attention.py``).
"""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch
import torch.distributed as dist

from qsa_testing import (
    Platform,
    current_platform,
    decode_batch,
    extend_batch,
    random_block_selection,
    run_on_gloo_ranks,
    zigzag_prefill_cp,
)

pytestmark = pytest.mark.skipif(
    current_platform() is not Platform.CPU,
    reason="gloo ranks with SGLang's CPU collectives; test_context_attention.py runs the "
    "kernel path on the GPU",
)

LAYER_IDS = {3: 0, 7: 1}  # SGLang layer id -> QSA ordinal
HQ, HKV, D = 4, 1, 64  # CP over the TP group: every rank holds every head
ROWS, HOT, MAX_BLOCKS, TOPK = 2, 16, 300, 16
SLOT, ROW = 5, 1
CHUNKS = (512, 99)
PAGE = 64
RTOL, ATOL = 2**-7, 2e-3


class Store(enum.Enum):
    OFFLOAD = "offload"
    OFFLOAD_SHARDED = "offload_sharded"
    RESIDENT_SHARDED = "resident_sharded"


def _slot_table() -> torch.Tensor:
    """``[8, 16 * PAGE]`` slot table; request :data:`SLOT` on scattered pages of a 24-page pool."""
    table = torch.zeros((8, 16 * PAGE), dtype=torch.int32)
    pages = torch.randperm(24, generator=torch.Generator().manual_seed(SEED))[:16]
    table[SLOT] = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).int()
    return table


STEPS = 7
SEED = 20261203
SCALE = D**-0.5


def _extend_batch(start: int, end: int) -> Any:
    return extend_batch([(SLOT, start, end)], _slot_table()[SLOT, start:end].long())


def _decode_batch(seq_len: int) -> Any:
    return decode_batch([SLOT], [seq_len], _slot_table()[SLOT, seq_len - 1 : seq_len].long())


def _selection(start: int, end: int, gen: torch.Generator) -> torch.Tensor:
    """``[end - start, 4 TOPK + 3]`` the indexer's prefill token positions of rows ``[start,
    end)``: random complete blocks, then each row's open block."""
    _, positions = random_block_selection(torch.arange(start, end) + 1, TOPK, gen)
    return positions


def _offload_backend(runtime: Any) -> Any:
    from qsa_sglang_plugin._adapters._backends import HiSparseOffloadBackend

    backend = object.__new__(HiSparseOffloadBackend)
    backend.qsa_runtime = runtime
    backend._cp_kv_pending = None  # upstream's constructor sets it
    return backend


def _offload_runtime(shard: Any = None) -> Any:
    """A runtime whose row :data:`ROW` is leased to :data:`SLOT`, verifying its rows on release."""
    from qsa_kernels import KernelPath
    from qsa_kernels.offload import OffloadedKV, OffloadGeometry, OffloadRuntime
    from qsa_kernels.sharded import HeadLayout

    geometry = OffloadGeometry(len(LAYER_IDS), ROWS, HOT, MAX_BLOCKS, HKV, D, torch.bfloat16)
    kv = OffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE, shard=shard)
    runtime = OffloadRuntime(
        kv, LAYER_IDS, TOPK, verify=True, q_heads=HQ, head_layout=HeadLayout.REPLICATED
    )
    runtime.admit("idle", SLOT + 1)  # row 0: the request under test prefills in row 1
    assert runtime.admit("r", SLOT).slot == ROW
    return runtime


def _resident_backend(shard: Any) -> Any:
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import HeadLayout, ShardedKVStore
    from qsa_sglang_plugin._adapters._backends import HiSparseShardedBackend

    backend = object.__new__(HiSparseShardedBackend)
    backend.qsa_sharded = ShardedKVStore(
        shard,
        LAYER_IDS,
        slots=24 * PAGE,
        kv_heads=HKV,
        head_dim=D,
        dtype=torch.bfloat16,
        q_heads=HQ,
        block_topk=TOPK,
        max_rows=ROWS,
        device=torch.device("cpu"),
        path=KernelPath.REFERENCE,
        head_layout=HeadLayout.REPLICATED,
    )
    backend.req_to_token = _slot_table()
    backend._decode_slots = backend.req_to_token[[SLOT]]  # init_forward_metadata's table
    backend._cp_kv_pending = None
    return backend


def _run(store: Store, rank: int, world: int) -> dict[str, Any]:
    from qsa_testing.standins import install_cpu_engine_standins

    # SGLang's CPU collectives and the sgl_kernel CPU ops they import, as in a CPU engine.
    install_cpu_engine_standins()
    with zigzag_prefill_cp(rank, world):
        return _scenario(store, rank, world)


def _shard_group(rank: int, world: int) -> Any:
    from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement
    from qsa_kernels.sharded import ShardGroup

    placement = ShardPlacement.for_tp(QWEN38_FLASH_NEXT, world, world, attn_cp_size=world)
    group = dist.new_group(list(range(world)))
    assert isinstance(group, dist.ProcessGroup)
    return ShardGroup(placement, rank, group)


def _compare(
    failures: list[str], what: str, got: torch.Tensor, want: torch.Tensor, exact: bool
) -> None:
    if exact and torch.equal(got, want):
        return
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=RTOL, atol=ATOL)
        if exact:
            failures.append(f"{what}: not bit for bit")
    except AssertionError as exc:
        failures.append(f"{what}: {str(exc)[:300]}")


def _scenario(store: Store, rank: int, world: int) -> dict[str, Any]:
    from sglang.srt.layers.cp.utils import get_cp_strategy, prepare_cp_forward
    from sglang.srt.layers.radix_attention import RadixAttention

    from qsa_sglang_plugin._adapters._offload import plan_decode

    strategy = get_cp_strategy()
    assert strategy is not None
    layers = {i: RadixAttention(HQ, D, SCALE, HKV, layer_id=i) for i in LAYER_IDS}
    shard = None if store is Store.OFFLOAD else _shard_group(rank, world)
    if store is Store.RESIDENT_SHARDED:
        cp = _resident_backend(shard)
    else:
        cp = _offload_backend(_offload_runtime(shard))
    one = _offload_backend(_offload_runtime())
    exact = store is Store.OFFLOAD
    gen = torch.Generator().manual_seed(SEED)
    total = sum(CHUNKS) + STEPS
    kv = torch.randn((2, len(LAYER_IDS), total, HKV * D), generator=gen).to(torch.bfloat16)
    failures: list[str] = []
    local_rows: list[int] = []
    start = 0
    for size in CHUNKS:
        end = start + size
        batch = _extend_batch(start, end)
        prepare_cp_forward(batch)  # SGLang's zigzag metadata for this rank
        meta = batch.attn_cp_metadata
        local_rows.append(int(meta.total_q_prev_tokens + meta.total_q_next_tokens))
        for layer_id, ordinal in LAYER_IDS.items():
            q = torch.randn((size, HQ * D), generator=gen).to(torch.bfloat16)
            k, v = kv[0, ordinal, start:end], kv[1, ordinal, start:end]
            picks = _selection(start, end, gen)
            mine = [strategy.shard_hidden_states(t, batch) for t in (q, k, v, picks)]
            out = cp.forward_extend(*mine[:3], layers[layer_id], batch, topk_indices=mine[3])
            got = strategy.gather_hidden_states(out, batch)
            want = one.forward_extend(
                q, k, v, layers[layer_id], _extend_batch(start, end), topk_indices=picks
            )
            _compare(failures, f"chunk [{start}, {end}) layer {layer_id}", got, want, exact)
        start = end
    staged_equal = None
    if store is not Store.RESIDENT_SHARDED:
        staged_k, staged_v = cp.qsa_runtime.staged_layers(ROW, start)
        staged_equal = all(
            torch.equal(staged_k[o].reshape(start, -1), kv[0, o, :start])
            and torch.equal(staged_v[o].reshape(start, -1), kv[1, o, :start])
            for o in LAYER_IDS.values()
        )
    for _ in range(STEPS):
        batch = _decode_batch(start + 1)
        for backend in (cp, one):
            runtime = getattr(backend, "qsa_runtime", None)
            if runtime is not None:
                plan_decode(runtime, batch)
        for layer_id, ordinal in LAYER_IDS.items():
            q = torch.randn((1, HQ * D), generator=gen).to(torch.bfloat16)
            k, v = kv[0, ordinal, start : start + 1], kv[1, ordinal, start : start + 1]
            blocks = torch.randperm((start + 1) // 4, generator=gen)[:TOPK].to(torch.int32)
            got, want = (
                b.forward_decode(q, k, v, layers[layer_id], batch, topk_indices=blocks[None])
                for b in (cp, one)
            )
            _compare(failures, f"decode at {start} layer {layer_id}", got, want, exact)
        start += 1
    result: dict[str, Any] = {
        "failures": failures,
        "local_rows": local_rows,
        "staged_equal": staged_equal,
        "tokens": start,
        "two_requests": _two_request_refusal(strategy),
    }
    if store is Store.RESIDENT_SHARDED:
        result["store_equal"] = _store_equals_shard(cp.qsa_sharded, kv[:, :, :start], rank, world)
        return result
    runtime = cp.qsa_runtime
    runtime.release(runtime.leases.at_engine_slot(SLOT))
    runtime.release(runtime.leases.at_engine_slot(SLOT + 1), aborted=True)
    verified, differing = runtime.counts.verified_bytes, runtime.counts.differing_bytes
    g = runtime.kv.geometry
    tail = start % 4 * len(LAYER_IDS) * g.record_bytes // 4
    return {
        **result,
        "verified": verified,
        "differing": differing,
        "closed_bytes": start // 4 * len(LAYER_IDS) * g.record_bytes,
        "tail_bytes": tail,
        "rows_in_use": runtime.rows_in_use,
    }


def _two_request_refusal(strategy: Any) -> str:
    """What the offload and the sharded store say to zigzag metadata of two requests (one
    context expected)."""
    from qsa_sglang_plugin._adapters._qsa_common import zigzag_entries
    from qsa_sglang_plugin._errors import OffloadRuntimeError

    meta = strategy.build_metadata(30, [40, 30], [20, 10])
    try:
        zigzag_entries(meta)
    except OffloadRuntimeError as exc:
        return str(exc)
    return "attended"


def _store_equals_shard(runtime: Any, kv: torch.Tensor, rank: int, world: int) -> bool:
    """Each of the prompt's tokens this rank owns is in its store at its local slot, as
    written; the store holds nothing else."""
    slots = _slot_table()[SLOT, : kv.shape[2]].long()
    expected = torch.zeros_like(runtime.kv)  # [L, records, 2, 4, Hkv, D]
    mine = slots % world == rank
    local = slots[mine] // world
    for ordinal in LAYER_IDS.values():
        records = expected[ordinal].view(-1, 2, 4, HKV, D)
        for side in (0, 1):
            values = kv[side, ordinal][mine].view(-1, HKV, D)
            records[local // 4, side, local % 4] = values
    return bool(torch.equal(runtime.kv, expected))


def _run_every_store(rank: int, world: int) -> dict[str, Any]:
    """Each store's scenario in turn on one set of ranks: SGLang is imported once per rank."""
    return {store.value: _run(store, rank, world) for store in Store}


@pytest.fixture(scope="module")
def every_store(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """Per world size, every rank's results of every store (one gloo run per size)."""
    return {
        world: run_on_gloo_ranks(_run_every_store, world, tmp_path_factory.mktemp(f"cp-{world}"))
        for world in (2, 4)
    }


@pytest.fixture(
    params=[(store, world) for store in Store for world in (2, 4)],
    ids=lambda p: f"{p[0].value}-{p[1]}ranks",
)
def ranks(
    request: pytest.FixtureRequest, every_store: dict[int, list[dict[str, Any]]]
) -> tuple[Store, list[Any]]:
    store, world = request.param
    return store, [result[store.value] for result in every_store[world]]


def test_each_rank_prefills_only_its_zigzag_rows(ranks: tuple[Store, list[Any]]) -> None:
    """The ranks' query rows partition every chunk (two zigzag blocks each)."""
    _, results = ranks
    for chunk, size in enumerate(CHUNKS):
        rows = [r["local_rows"][chunk] for r in results]
        assert sum(rows) == size, rows
        assert max(rows) < size, rows


def test_cp_prefill_and_decode_equal_one_rank(ranks: tuple[Store, list[Any]]) -> None:
    """Gathered back into token order, every chunk and layer equals the prefill without CP (bit
    for bit when nothing is sharded), and so do the decode steps after it."""
    _, results = ranks
    for rank, result in enumerate(results):
        assert result["failures"] == [], rank


def test_every_rank_keeps_the_prompt_it_should(ranks: tuple[Store, list[Any]]) -> None:
    """The gathered K/V went whole to each rank's staging area; after the hand-off and decode
    the host arenas hold every token once per group (once per rank unsharded), byte for byte;
    a resident store holds exactly its owned slots."""
    store, results = ranks
    if store is Store.RESIDENT_SHARDED:
        assert all(r["store_equal"] for r in results)
        return
    assert all(r["staged_equal"] for r in results)
    assert all(r["differing"] == 0 and r["rows_in_use"] == 0 for r in results)
    closed, tail = results[0]["closed_bytes"], results[0]["tail_bytes"]
    if store is Store.OFFLOAD:
        assert all(r["verified"] == closed + tail for r in results)
    else:  # each closed block on its owner, the open block's tail on every rank
        assert sum(r["verified"] for r in results) == closed + len(results) * tail


def test_context_attention_refuses_a_cp_batch_of_several_requests(
    ranks: tuple[Store, list[Any]],
) -> None:
    """Attention over one request's contiguous context: SGLang's zigzag metadata of two
    requests is refused by name (``zigzag_entries``), before any kernel runs."""
    _, results = ranks
    for result in results:
        assert "batch of 2 requests" in result["two_requests"]
        assert "allowed: 1" in result["two_requests"]
