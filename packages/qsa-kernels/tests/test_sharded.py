"""Sharded QSA decode and prefill on N gloo processes (N = 1..4) against the single-rank result.

One module fixture starts four CPU processes once (``python this_file.py``, gloo over
``127.0.0.1``); they build subgroups of 1, 2, 3 and 4 ranks and run every case in each. Every
process builds the same model-shaped case from one seed (Qwen3.8-Flash-Next per-rank shapes: one
KV head, 12 query heads of its group, D = 256; index 4 x 128, 16 blocks per page, page 64) with
the pages of each request scattered over a logical pool, shards it with the placement adapters,
runs the sharded path and compares with the unsharded references:
``indexer_topk_reference`` + ``expand_blocks_reference`` + ``sparse_decode_reference``.

Paths: the ``ref-*`` cases run the torch references per rank (scoring, merge, expansion,
attention, LSE merge); the ``triton-*`` case runs the Triton kernels through the interpreter
(``TRITON_INTERPRET=1``, set by conftest) on a small case. Index keys are multiples of 1/64 in
[-2, 2] so every score is exact in fp32 whatever the summation order (CPU BLAS is not
order-stable across call sizes); the ``ties`` case uses integer keys so many scores tie.

Prefill: a chunk of :data:`PREFILL_CHUNK` tokens after a :data:`PREFILL_PREFIX`-token prefix
whose K/V is already sharded (a restored prefix, or the chunks before), the chunk's own K/V
routed to its owners, each query token with its own causal selection; ``owner_sparse_prefill``
against the single-rank sparse attention of every query token.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

WORLD = 4
SEED = 20261129
HQ, HKV, D = 12, 1, 256
PAGE = 64
#: (name, request lengths, topk, key kind, kernel path)
CASES: tuple[tuple[str, tuple[int, ...], int, str, str], ...] = (
    ("ref-long-top512", (2999, 1234, 211), 512, "fine", "reference"),
    ("ref-top8", (2047, 301, 9), 8, "fine", "reference"),
    ("ref-ties-top8", (1501, 643), 8, "integer", "reference"),
    ("ref-ties-top512", (2401,), 512, "integer", "reference"),
    ("triton-top8", (301, 77), 8, "fine", "triton"),
)
LAYOUTS = ("replicated", "sharded")
#: Write routing: prefill lengths, then decode steps that close blocks and cross pages 64 / 192.
WRITE_PREFILL = (190, 61, 5)
WRITE_STEPS = 7
WRITE_TOPK = 8
#: Prefill: prefix tokens already in the shards, chunk tokens, selection width, rows per group
#: (the chunk runs in several groups, the last one short).
PREFILL_PREFIX, PREFILL_CHUNK, PREFILL_TOPK, PREFILL_ROWS = 1234, 45, 8, 8
#: Output tolerance per path (rtol 2^-7 on top). The reference keeps each rank's partial in fp32;
#: ``sparse_decode`` returns its partial rounded to bf16, so an output that is a weighted sum of
#: partials of magnitude ~1 carries up to one bf16 ulp of those partials (2^-7) in absolute terms.
OUT_ATOL = {"reference": 1e-3, "triton": 2**-6}


# ------------------------------------------------------------------------------ worker side


def _build_case(lengths: tuple[int, ...], key_kind: str, seed: int) -> dict[str, torch.Tensor]:
    """One decode step of one QSA layer: requests on scattered pages of a logical pool."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    max_pages = max(-(-n // PAGE) for n in lengths)
    pool_pages = sum(-(-n // PAGE) for n in lengths) + 7
    order = torch.randperm(pool_pages, generator=g)
    page_table = torch.zeros((batch, max_pages), dtype=torch.int32)
    slot_table = torch.zeros((batch, max_pages * PAGE), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lengths):
        pages = order[used : used + -(-n // PAGE)]
        used += pages.numel()
        page_table[b, : pages.numel()] = pages.to(torch.int32)
        slots = pages[:, None] * PAGE + torch.arange(PAGE)[None, :]
        slot_table[b, : slots.numel()] = slots.reshape(-1).to(torch.int32)
    if key_kind == "integer":
        q_index = torch.randint(0, 2, (batch, 4, 128), generator=g).to(torch.bfloat16)
        index = torch.randint(-1, 2, (pool_pages, 16, 128), generator=g).to(torch.bfloat16)
    else:
        q_index = (torch.randint(-128, 129, (batch, 4, 128), generator=g) / 64).to(torch.bfloat16)
        index = (torch.randint(-128, 129, (pool_pages, 16, 128), generator=g) / 64).to(
            torch.bfloat16
        )
    kv = torch.randn((pool_pages * PAGE // 4, 2, 4, HKV, D), generator=g).to(torch.bfloat16)
    q = torch.randn((batch, HQ, D), generator=g).to(torch.bfloat16)
    return {
        "seq_lens": torch.tensor(lengths, dtype=torch.int32),
        "page_table": page_table,
        "slot_table": slot_table,
        "q_index": q_index,
        "index": index,
        "kv": kv,
        "q": q,
    }


def _single_rank(case: dict[str, torch.Tensor], topk: int) -> dict[str, torch.Tensor]:
    from qsa_kernels.expand import expand_blocks_reference
    from qsa_kernels.indexer_topk import indexer_scores_reference, indexer_topk_reference
    from qsa_kernels.sparse_decode import sparse_decode_reference

    ids = indexer_topk_reference(
        case["q_index"], case["index"], case["page_table"], case["seq_lens"], topk=topk
    )
    scores = indexer_scores_reference(
        case["q_index"], case["index"], case["page_table"], case["seq_lens"]
    )
    pos = expand_blocks_reference(ids, case["seq_lens"], ratio=4, token_topk=4 * topk)
    valid = pos >= 0
    slots = torch.where(valid, case["slot_table"].gather(1, pos.clamp(min=0).long()), -1)
    out, lse = sparse_decode_reference(case["q"], slots.to(torch.int32), case["kv"])
    return {"ids": ids, "scores": scores, "out": out, "lse": lse}


def _run_case(
    shard: Any, *, name: str, lengths: tuple[int, ...], topk: int, key_kind: str, path_name: str
) -> dict[str, Any]:
    from _gloo import mismatch  # the workers run as scripts beside it
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import (
        HeadLayout,
        ShardedDecodeBuffers,
        local_index_table,
        owned_token_bound,
        owner_sparse_decode,
        shard_index_pages,
        shard_raw_kv,
        sharded_indexer_topk,
    )

    case = _build_case(lengths, key_kind, SEED + sum(map(ord, name)))
    ref = _single_rank(case, topk)
    placement, rank, n = shard.placement, shard.rank, shard.world_size
    path = KernelPath(path_name)
    local_index = shard_index_pages(case["index"], placement, rank)
    local_kv = shard_raw_kv(case["kv"], placement, rank)
    table = local_index_table(case["page_table"], case["seq_lens"], placement, rank)
    result: dict[str, Any] = {
        "local_blocks": (table.seq_lens // 4).tolist(),
        "owned_counts": _owned_counts(case, ref["ids"], placement, rank, topk),
        "bound": owned_token_bound(placement, topk),
    }
    for layout_name in LAYOUTS:
        layout = HeadLayout(layout_name)
        buffers = ShardedDecodeBuffers.allocate(
            world_size=n,
            max_rows=4,
            topk=topk,
            q_heads=HQ,
            head_dim=D,
            layout=layout,
            device="cpu",
        )
        merged = sharded_indexer_topk(
            case["q_index"], local_index, table, shard=shard, buffers=buffers, path=path
        )
        heads = slice(rank * HQ // n, (rank + 1) * HQ // n) if layout_name == "sharded" else None
        q = case["q"] if heads is None else case["q"][:, heads].contiguous()
        out, lse = owner_sparse_decode(
            q,
            merged.ids,
            case["seq_lens"],
            case["slot_table"],
            local_kv,
            shard=shard,
            buffers=buffers,
            path=path,
            # REPLICATED runs at the step's exact width, SHARDED at the static bound.
            owned_width=None if heads is None else result["bound"],
        )
        ref_out = ref["out"] if heads is None else ref["out"][:, heads]
        ref_lse = ref["lse"] if heads is None else ref["lse"][:, heads]
        valid = merged.ids >= 0
        ref_scores = ref["scores"].gather(1, merged.ids.clamp(min=0).long())
        result[layout_name] = {
            "ids": merged.ids.tolist(),
            "ref_ids": ref["ids"].tolist(),
            "scores_match": bool(torch.equal(merged.scores[valid], ref_scores[valid])),
            "out_close": mismatch(
                out.float(), ref_out.float(), rtol=2**-7, atol=OUT_ATOL[path_name]
            ),
            "lse_close": mismatch(lse, ref_lse, rtol=1e-5, atol=1e-5),
            "out_shape": list(out.shape),
            "dtypes": [str(out.dtype), str(lse.dtype)],
        }
    return result


def _owned_counts(
    case: dict[str, torch.Tensor], ids: torch.Tensor, placement: Any, rank: int, topk: int
) -> list[int]:
    """Selected tokens this rank owns per row: the compacted width each row needs."""
    from qsa_kernels.expand import expand_blocks_reference
    from qsa_kernels.sharded import compact_owned_slots

    pos = expand_blocks_reference(ids, case["seq_lens"], ratio=4, token_topk=4 * topk)
    valid = pos >= 0
    slots = torch.where(valid, case["slot_table"].gather(1, pos.clamp(min=0).long()), -1)
    counts: list[int] = compact_owned_slots(slots, placement, rank)[1].tolist()
    return counts


def _write_scenario(seed: int) -> dict[str, Any]:
    """Prefill then decode steps of three requests on scattered pages, as a list of writes.

    Every write is ``(raw slots [M], k [M, Hkv, D], v [M, Hkv, D], block slots [M2], index rows
    [M2, 128])``: the first is the whole prefill; then one per decode step with one token per
    request and one block row per request (``-1`` slot where its group did not close). The
    pending ring is replicated: every rank fills the same per-request ring of index keys and
    compresses a group (a stand-in compressor: first key + last key, exact in bf16) when its
    fourth token arrives, so a block that closes at a page boundary is known everywhere before
    its owner keeps it.
    """
    g = torch.Generator().manual_seed(seed)
    final = [p + WRITE_STEPS for p in WRITE_PREFILL]
    batch = len(final)
    npages = [-(-n // PAGE) for n in final]
    pool_pages = sum(npages) + 5
    order = torch.randperm(pool_pages, generator=g)
    page_table = torch.zeros((batch, max(npages)), dtype=torch.int32)
    slot_table = torch.zeros((batch, max(npages) * PAGE), dtype=torch.int32)
    used = 0
    for b, count in enumerate(npages):
        pages = order[used : used + count]
        used += count
        page_table[b, :count] = pages.to(torch.int32)
        slots = pages[:, None] * PAGE + torch.arange(PAGE)[None, :]
        slot_table[b, : slots.numel()] = slots.reshape(-1).to(torch.int32)
    keys = [(torch.randint(-64, 65, (n, 128), generator=g) / 64).to(torch.bfloat16) for n in final]
    ks = [torch.randn((n, HKV, D), generator=g).to(torch.bfloat16) for n in final]
    vs = [torch.randn((n, HKV, D), generator=g).to(torch.bfloat16) for n in final]
    rings = [torch.zeros((4, 128), dtype=torch.bfloat16) for _ in final]

    def feed(b: int, p: int) -> tuple[int, torch.Tensor | None]:
        rings[b][p % 4] = keys[b][p]
        if p % 4 != 3:
            return -1, None
        return int(slot_table[b, p]) // 4, rings[b][0] + rings[b][3]

    writes = []
    raw, bslots, brows = [], [], []
    for b, n in enumerate(WRITE_PREFILL):
        raw.append(slot_table[b, :n])
        for p in range(n):
            slot, row = feed(b, p)
            if row is not None:
                bslots.append(slot)
                brows.append(row)
    writes.append(
        (
            torch.cat(raw).to(torch.int64),
            torch.cat([k[:n] for k, n in zip(ks, WRITE_PREFILL, strict=True)]),
            torch.cat([v[:n] for v, n in zip(vs, WRITE_PREFILL, strict=True)]),
            torch.tensor(bslots, dtype=torch.int64),
            torch.stack(brows),
        )
    )
    for step in range(WRITE_STEPS):
        pos = [n + step for n in WRITE_PREFILL]
        closed = [feed(b, p) for b, p in enumerate(pos)]
        writes.append(
            (
                torch.stack([slot_table[b, p] for b, p in enumerate(pos)]).to(torch.int64),
                torch.stack([ks[b][p] for b, p in enumerate(pos)]),
                torch.stack([vs[b][p] for b, p in enumerate(pos)]),
                torch.tensor([c[0] for c in closed], dtype=torch.int64),
                torch.stack([c[1] if c[1] is not None else torch.zeros(128) for c in closed]).to(
                    torch.bfloat16
                ),
            )
        )
    return {
        "writes": writes,
        "seq_lens": torch.tensor(final, dtype=torch.int32),
        "page_table": page_table,
        "slot_table": slot_table,
        "pool_pages": pool_pages,
        "q_index": (torch.randint(-128, 129, (batch, 4, 128), generator=g) / 64).to(torch.bfloat16),
        "q": torch.randn((batch, HQ, D), generator=g).to(torch.bfloat16),
    }


def _run_writes(shard: Any) -> dict[str, Any]:
    """Route every write of the scenario to its owner; compare shards and a decode step."""
    from _gloo import mismatch  # the workers run as scripts beside it
    from qsa_kernels import KernelPath
    from qsa_kernels.sharded import (
        HeadLayout,
        ShardedDecodeBuffers,
        index_write_targets,
        local_index_table,
        owner_sparse_decode,
        raw_write_targets,
        shard_index_pages,
        shard_raw_kv,
        sharded_indexer_topk,
        write_owned_index_blocks,
        write_owned_raw_kv,
    )

    sc = _write_scenario(SEED + 7)
    placement, rank, n = shard.placement, shard.rank, shard.world_size
    kv = torch.zeros((sc["pool_pages"] * PAGE // 4, 2, 4, HKV, D), dtype=torch.bfloat16)
    index = torch.zeros((sc["pool_pages"], 16, 128), dtype=torch.bfloat16)
    local_kv = shard_raw_kv(kv, placement, rank)
    local_index = shard_index_pages(index, placement, rank)
    owned_rows = 0
    for slots, k, v, bslots, brows in sc["writes"]:
        kv[slots // 4, 0, slots % 4] = k  # the single-rank pool write
        kv[slots // 4, 1, slots % 4] = v
        closed = bslots >= 0
        index.view(-1, 128)[bslots[closed]] = brows[closed]
        targets = raw_write_targets(slots, placement, rank)
        owned_rows += int(targets.owned.sum())
        write_owned_raw_kv(local_kv, targets, k, v)
        write_owned_index_blocks(local_index, index_write_targets(bslots, placement, rank), brows)
    case = {**sc, "kv": kv, "index": index}
    ref = _single_rank(case, WRITE_TOPK)
    buffers = ShardedDecodeBuffers.allocate(
        world_size=n,
        max_rows=4,
        topk=WRITE_TOPK,
        q_heads=HQ,
        head_dim=D,
        layout=HeadLayout.REPLICATED,
        device="cpu",
    )
    table = local_index_table(sc["page_table"], sc["seq_lens"], placement, rank)
    path = KernelPath.REFERENCE
    merged = sharded_indexer_topk(
        sc["q_index"], local_index, table, shard=shard, buffers=buffers, path=path
    )
    out, lse = owner_sparse_decode(
        sc["q"],
        merged.ids,
        sc["seq_lens"],
        sc["slot_table"],
        local_kv,
        shard=shard,
        buffers=buffers,
        path=path,
    )
    return {
        "kv_equal": bool(torch.equal(local_kv, shard_raw_kv(kv, placement, rank))),
        "index_equal": bool(torch.equal(local_index, shard_index_pages(index, placement, rank))),
        "owned_rows": owned_rows,
        "total_rows": sum(int(w[0].numel()) for w in sc["writes"]),
        "index_blocks_written": int((index.view(-1, 128) != 0).any(dim=1).sum()),
        "ids_equal": sorted(map(sorted, merged.ids.tolist()))
        == sorted(map(sorted, ref["ids"].tolist())),
        "out_close": mismatch(out.float(), ref["out"].float(), rtol=2**-7, atol=1e-3),
        "lse_close": mismatch(lse, ref["lse"], rtol=1e-5, atol=1e-5),
    }


def _run_prefill(shard: Any) -> dict[str, Any]:
    """One chunk's prefill over a sharded prefix, both head layouts, against one rank."""
    from _gloo import mismatch  # the workers run as scripts beside it
    from qsa_kernels import KernelPath
    from qsa_kernels.expand import expand_blocks_reference
    from qsa_kernels.indexer_topk import indexer_topk_reference
    from qsa_kernels.sharded import (
        HeadLayout,
        ShardedDecodeBuffers,
        local_index_table,
        owner_sparse_prefill,
        raw_write_targets,
        shard_index_pages,
        shard_raw_kv,
        sharded_indexer_topk,
        write_owned_raw_kv,
    )
    from qsa_kernels.sparse_decode import sparse_decode_reference

    total = PREFILL_PREFIX + PREFILL_CHUNK
    case = _build_case((total,), "fine", SEED + 11)
    placement, rank, n = shard.placement, shard.rank, shard.world_size
    g = torch.Generator().manual_seed(SEED + 12)
    positions = torch.arange(PREFILL_PREFIX, total, dtype=torch.int32)
    q_index = (torch.randint(-128, 129, (PREFILL_CHUNK, 4, 128), generator=g) / 64).to(
        torch.bfloat16
    )
    q = torch.randn((PREFILL_CHUNK, HQ, D), generator=g).to(torch.bfloat16)
    seq_lens = positions + 1
    pages = case["page_table"].expand(PREFILL_CHUNK, -1).contiguous()
    ids = indexer_topk_reference(q_index, case["index"], pages, seq_lens, topk=PREFILL_TOPK)
    # D2: the chunk's rows select from the sharded index, each row a decode row of its position.
    selection = ShardedDecodeBuffers.allocate(
        world_size=n,
        max_rows=PREFILL_CHUNK,
        topk=PREFILL_TOPK,
        q_heads=HQ,
        head_dim=D,
        layout=HeadLayout.REPLICATED,
        device="cpu",
    )
    merged = sharded_indexer_topk(
        q_index,
        shard_index_pages(case["index"], placement, rank),
        local_index_table(pages, seq_lens, placement, rank),
        shard=shard,
        buffers=selection,
        path=KernelPath.REFERENCE,
    )
    slot_row = case["slot_table"][0]
    # One rank: every query token over its selection, read from the whole pool.
    token_pos = expand_blocks_reference(ids, seq_lens, ratio=4, token_topk=4 * PREFILL_TOPK)
    valid = token_pos >= 0
    slots = torch.where(valid, slot_row[token_pos.clamp(min=0).long()], -1).to(torch.int32)
    ref_out, ref_lse = sparse_decode_reference(q, slots, case["kv"])
    # The shards: the prefix's K/V already there, the chunk's routed to its owners.
    chunk = slot_row[PREFILL_PREFIX:total].to(torch.int64)
    prefix_kv = case["kv"].clone()
    prefix_kv[chunk // 4, :, chunk % 4] = 0
    local_kv = shard_raw_kv(prefix_kv, placement, rank)
    targets = raw_write_targets(chunk, placement, rank)
    chunk_k = case["kv"][chunk // 4, 0, chunk % 4]
    chunk_v = case["kv"][chunk // 4, 1, chunk % 4]
    write_owned_raw_kv(local_kv, targets, chunk_k, chunk_v)
    result: dict[str, Any] = {
        "shard_equal": bool(torch.equal(local_kv, shard_raw_kv(case["kv"], placement, rank))),
        "selects_prefix_and_chunk": [
            bool(((token_pos >= 0) & (token_pos < PREFILL_PREFIX)).any()),
            bool((token_pos >= PREFILL_PREFIX).any()),
        ],
        "sharded_selection": {"ids": merged.ids.tolist(), "ref_ids": ids.tolist()},
    }
    for layout_name in LAYOUTS:
        buffers = ShardedDecodeBuffers.allocate(
            world_size=n,
            max_rows=PREFILL_ROWS,
            topk=PREFILL_TOPK,
            q_heads=HQ,
            head_dim=D,
            layout=HeadLayout(layout_name),
            device="cpu",
        )
        heads = slice(rank * HQ // n, (rank + 1) * HQ // n) if layout_name == "sharded" else None
        out, lse = owner_sparse_prefill(
            q if heads is None else q[:, heads].contiguous(),
            merged.ids,
            positions,
            slot_row,
            local_kv,
            shard=shard,
            buffers=buffers,
            path=KernelPath.REFERENCE,
        )
        want_out = ref_out if heads is None else ref_out[:, heads]
        want_lse = ref_lse if heads is None else ref_lse[:, heads]
        result[layout_name] = {
            "out_close": mismatch(out.float(), want_out.float(), rtol=2**-7, atol=1e-3),
            "lse_close": mismatch(lse, want_lse, rtol=1e-5, atol=1e-5),
            "out_shape": list(out.shape),
        }
    return result


def _worker(rank: int, port: int, out_dir: Path) -> None:
    from _gloo import member_groups
    from qsa_kernels.sharded import ShardGroup

    results: dict[str, Any] = {}
    for n, group in member_groups(rank, port, WORLD, range(1, WORLD + 1)):
        shard = ShardGroup.from_process_group(group)
        for name, lengths, topk, key_kind, path_name in CASES:
            results[f"{n}/{name}"] = _run_case(
                shard, name=name, lengths=lengths, topk=topk, key_kind=key_kind, path_name=path_name
            )
        results[f"{n}/writes"] = _run_writes(shard)
        results[f"{n}/prefill"] = _run_prefill(shard)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------ test side


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
    spawn_workers: Callable[[str, int, Path], None],
) -> dict[int, dict[str, Any]]:
    """Results of every (world size, case) on every rank: ``{rank: {"N/case": {...}}}``."""
    out_dir = tmp_path_factory.mktemp("sharded")
    spawn_workers(__file__, WORLD, out_dir)
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)}


def _entries(runs: dict[int, dict[str, Any]]) -> list[tuple[int, int, str, dict[str, Any]]]:
    """``(N, rank, case, result)`` for every rank that took part."""
    out = []
    for rank, per_case in runs.items():
        for key, result in per_case.items():
            n, name = key.split("/", 1)
            if name not in {"writes", "prefill"}:
                out.append((int(n), rank, name, result))
    return out


def _scenario_entries(
    runs: dict[int, dict[str, Any]], scenario: str = "writes"
) -> dict[tuple[int, int], dict[str, Any]]:
    """``{(N, rank): result}`` of one scenario (write routing, or the prefill)."""
    return {
        (int(key.split("/")[0]), rank): result
        for rank, per_case in runs.items()
        for key, result in per_case.items()
        if key.endswith(f"/{scenario}")
    }


def test_every_world_size_and_case_ran(runs: dict[int, dict[str, Any]]) -> None:
    """Each of N = 1..4 ran every case on each of its N ranks (and no rank outside it)."""
    seen = {(n, rank, name) for n, rank, name, _ in _entries(runs)}
    expected = {(n, rank, c[0]) for n in range(1, WORLD + 1) for rank in range(n) for c in CASES}
    assert seen == expected
    members = {(n, r) for n in range(1, WORLD + 1) for r in range(n)}
    assert set(_scenario_entries(runs)) == set(_scenario_entries(runs, "prefill")) == members


def test_compacted_owned_width_shrinks_with_world_size(runs: dict[int, dict[str, Any]]) -> None:
    """Per-rank owned counts partition each row's selection and stay within the static bound."""
    per_row: dict[tuple[int, str], list[list[int]]] = {}
    for n, _rank, name, r in _entries(runs):
        assert max(r["owned_counts"]) <= r["bound"], (n, name)
        per_row.setdefault((n, name), []).append(r["owned_counts"])
    for (n, name), counts in per_row.items():
        single = per_row[1, name][0]
        assert [sum(c) for c in zip(*counts, strict=True)] == single, (n, name)
        topk = next(c[2] for c in CASES if c[0] == name)
        if n in {2, 4}:  # every 4-token block splits evenly: the width is exactly 1 / N
            assert max(max(c) for c in counts) <= (4 * topk + 3 + n - 1) // n, (n, name)


def test_routed_writes_build_exactly_the_single_rank_shards(
    runs: dict[int, dict[str, Any]],
) -> None:
    """After prefill + decode writes, each rank's K/V and index equal the single-rank shards."""
    entries = _scenario_entries(runs)
    bad = [key for key, r in entries.items() if not (r["kv_equal"] and r["index_equal"])]
    assert bad == []


def test_routed_raw_writes_land_on_exactly_one_rank(runs: dict[int, dict[str, Any]]) -> None:
    """Summed over a group's ranks, every raw row of every write is stored exactly once."""
    entries = _scenario_entries(runs)
    for n in range(1, WORLD + 1):
        group = [entries[n, r] for r in range(n)]
        assert sum(r["owned_rows"] for r in group) == group[0]["total_rows"], n
        if n > 1:
            assert all(0 < r["owned_rows"] < r["total_rows"] for r in group), n
        # 47 + 15 + 1 prefill blocks, then 2 + 2 + 2 closed by the decode steps.
        assert group[0]["index_blocks_written"] == 69


def test_decode_on_routed_shards_matches_single_rank(runs: dict[int, dict[str, Any]]) -> None:
    """A decode step on the routed shards selects the same blocks and output as one rank."""
    bad = [
        (key, r["out_close"], r["lse_close"])
        for key, r in _scenario_entries(runs).items()
        if not r["ids_equal"] or r["out_close"] or r["lse_close"]
    ]
    assert bad == []


def test_prefill_over_a_sharded_prefix_matches_single_rank(
    runs: dict[int, dict[str, Any]],
) -> None:
    """A chunk after a 1,234-token prefix, its own K/V routed to the owners, each query token
    selecting blocks of the prefix and of the chunk: the merged attention equals one rank's
    within bf16 (LSE within fp32), both head layouts, every group size."""
    entries = _scenario_entries(runs, "prefill")
    bad = [
        (key, layout, r[layout]["out_close"], r[layout]["lse_close"])
        for key, r in entries.items()
        for layout in LAYOUTS
        if r[layout]["out_close"] or r[layout]["lse_close"]
    ]
    assert bad == []
    for (n, _rank), r in entries.items():
        assert r["shard_equal"], n
        assert r["selects_prefix_and_chunk"] == [True, True]
        assert r["replicated"]["out_shape"] == [PREFILL_CHUNK, HQ, D]
        assert r["sharded"]["out_shape"] == [PREFILL_CHUNK, HQ // n, D]


def test_prefill_rows_select_from_a_sharded_index_as_one_rank_does(
    runs: dict[int, dict[str, Any]],
) -> None:
    """D2's prefill selection: each chunk row's merged top-k over the page-sharded index is the
    set one rank selects over the whole index, in the same order on every rank of a group (the
    prefill outputs above attend this selection)."""
    entries = _scenario_entries(runs, "prefill")
    bad = [
        key
        for key, r in entries.items()
        if [sorted(i for i in row if i >= 0) for row in r["sharded_selection"]["ids"]]
        != [sorted(i for i in row if i >= 0) for row in r["sharded_selection"]["ref_ids"]]
    ]
    assert bad == []
    orders: dict[int, set[str]] = {}
    for (n, _rank), r in entries.items():
        orders.setdefault(n, set()).add(json.dumps(r["sharded_selection"]["ids"]))
    assert all(len(seen) == 1 for seen in orders.values()), orders.keys()


def test_selected_block_set_equals_single_rank_indexer(runs: dict[int, dict[str, Any]]) -> None:
    """The merged top-k is exactly the set ``indexer_topk_reference`` selects, every N and rank."""
    bad = []
    for n, rank, name, result in _entries(runs):
        for layout in LAYOUTS:
            got = [sorted(i for i in row if i >= 0) for row in result[layout]["ids"]]
            want = [sorted(i for i in row if i >= 0) for row in result[layout]["ref_ids"]]
            if got != want:
                bad.append((n, rank, name, layout))
    assert bad == []


def test_merged_topk_is_identical_on_every_rank(runs: dict[int, dict[str, Any]]) -> None:
    """Every rank of a group ends with the same ids in the same (best-first) order."""
    by_group: dict[tuple[int, str], list[Any]] = {}
    for n, _rank, name, result in _entries(runs):
        by_group.setdefault((n, name), []).append(result["replicated"]["ids"])
    assert all(all(ids == lists[0] for ids in lists) for lists in by_group.values())


def test_merged_scores_are_the_unsharded_scores(runs: dict[int, dict[str, Any]]) -> None:
    """The merged candidates carry bit-identical fp32 scores of the unsharded indexer."""
    assert [k for *k, r in _entries(runs) if not r["replicated"]["scores_match"]] == []


def test_selection_really_discards_blocks_and_exceeds_local_counts(
    runs: dict[int, dict[str, Any]],
) -> None:
    """Cases select fewer blocks than visible, and at N >= 2 every rank owns <= 512 of 749."""
    entries = _entries(runs)
    long_local = [
        r["local_blocks"][0] for n, _, c, r in entries if c == "ref-long-top512" and n > 1
    ]
    assert long_local
    assert max(long_local) <= 512 < 2999 // 4
    for _, _, name, _ in entries:
        topk = next(c[2] for c in CASES if c[0] == name)
        lengths = next(c[1] for c in CASES if c[0] == name)
        assert max(n // 4 for n in lengths) > topk, name


def test_tied_scores_resolve_to_the_smaller_block_id(runs: dict[int, dict[str, Any]]) -> None:
    """With integer keys the top-k boundary ties, and the sharded choice still matches exactly."""
    ties = [r for _, _, name, r in _entries(runs) if name.startswith("ref-ties")]
    assert ties
    for result in ties:
        ids = result["replicated"]["ids"]
        assert ids == [
            [i for i in row if i >= 0] + [-1] * sum(i < 0 for i in row) for row in ids
        ]  # padding last
        assert [sorted(r) for r in ids] == [
            sorted(i for i in r) for r in result["replicated"]["ref_ids"]
        ]


def test_owner_attention_output_matches_single_rank_within_bf16(
    runs: dict[int, dict[str, Any]],
) -> None:
    """Merged bf16 outputs match single-rank sparse decode within bf16 tolerance, both layouts."""
    bad = [
        (n, rank, name, layout, r[layout]["out_close"])
        for n, rank, name, r in _entries(runs)
        for layout in LAYOUTS
        if r[layout]["out_close"]
    ]
    assert bad == []


def test_owner_attention_lse_matches_single_rank_within_fp32(
    runs: dict[int, dict[str, Any]],
) -> None:
    """Merged LSE matches the single-rank LSE within fp32 tolerance (1e-5), both layouts."""
    bad = [
        (n, rank, name, layout, r[layout]["lse_close"])
        for n, rank, name, r in _entries(runs)
        for layout in LAYOUTS
        if r[layout]["lse_close"]
    ]
    assert bad == []


def test_sharded_layout_returns_only_own_heads(runs: dict[int, dict[str, Any]]) -> None:
    """SHARDED gives ``[B, 12 / N, 256]`` bf16 per rank; REPLICATED gives all 12 heads."""
    for n, _, name, r in _entries(runs):
        batch = len(next(c[1] for c in CASES if c[0] == name))
        assert r["sharded"]["out_shape"] == [batch, HQ // n, D]
        assert r["replicated"]["out_shape"] == [batch, HQ, D]
        assert r["sharded"]["dtypes"] == ["torch.bfloat16", "torch.float32"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
