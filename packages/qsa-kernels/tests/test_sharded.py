"""Sharded QSA decode on N gloo processes (N = 1..4) against the single-rank computation.

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
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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
    from qsa_kernels.sharded import (
        HeadLayout,
        KernelPath,
        ShardedDecodeBuffers,
        local_index_table,
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
    result: dict[str, Any] = {"local_blocks": (table.seq_lens // 4).tolist()}
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
        )
        ref_out = ref["out"] if heads is None else ref["out"][:, heads]
        ref_lse = ref["lse"] if heads is None else ref["lse"][:, heads]
        valid = merged.ids >= 0
        ref_scores = ref["scores"].gather(1, merged.ids.clamp(min=0).long())
        result[layout_name] = {
            "ids": merged.ids.tolist(),
            "ref_ids": ref["ids"].tolist(),
            "scores_match": bool(torch.equal(merged.scores[valid], ref_scores[valid])),
            "out_close": _close(out.float(), ref_out.float(), rtol=2**-7, atol=OUT_ATOL[path_name]),
            "lse_close": _close(lse, ref_lse, rtol=1e-5, atol=1e-5),
            "out_shape": list(out.shape),
            "dtypes": [str(out.dtype), str(lse.dtype)],
        }
    return result


def _close(a: torch.Tensor, b: torch.Tensor, *, rtol: float, atol: float) -> str:
    try:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    except AssertionError as exc:
        return str(exc)[:400]
    return ""


def _worker(rank: int, port: int, out_dir: Path) -> None:
    import torch.distributed as dist

    from qsa_kernels.sharded import ShardGroup

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    results: dict[str, Any] = {}
    for n in range(1, WORLD + 1):
        group = dist.new_group(list(range(n)))
        if rank >= n:
            continue
        assert isinstance(group, dist.ProcessGroup)
        shard = ShardGroup.from_process_group(group)
        for name, lengths, topk, key_kind, path_name in CASES:
            results[f"{n}/{name}"] = _run_case(
                shard, name=name, lengths=lengths, topk=topk, key_kind=key_kind, path_name=path_name
            )
    dist.barrier()
    dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------ test side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Results of every (world size, case) on every rank: ``{rank: {"N/case": {...}}}``."""
    out_dir = tmp_path_factory.mktemp("sharded")
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port), str(out_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(WORLD)
    ]
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-3000:]}"
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)}


def _entries(runs: dict[int, dict[str, Any]]) -> list[tuple[int, int, str, dict[str, Any]]]:
    """``(N, rank, case, result)`` for every rank that took part."""
    out = []
    for rank, per_case in runs.items():
        for key, result in per_case.items():
            n, name = key.split("/", 1)
            out.append((int(n), rank, name, result))
    return out


def test_every_world_size_and_case_ran(runs: dict[int, dict[str, Any]]) -> None:
    """Each of N = 1..4 ran every case on each of its N ranks (and no rank outside it)."""
    seen = {(n, rank, name) for n, rank, name, _ in _entries(runs)}
    expected = {(n, rank, c[0]) for n in range(1, WORLD + 1) for rank in range(n) for c in CASES}
    assert seen == expected


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
