"""Benchmark the selection kernels: indexer scoring + top-k, candidate merge, label scoring.

Writes ``<out-dir>/selection.md`` (table, machine, versions, command) and
``<out-dir>/selection.json``. Needs CUDA; exits with status 77 (skipped: no hardware) and a
message otherwise.

Bytes are counted as the fewest the op must read from HBM: for the indexer, every complete
compressed key of the row once (``n_blocks * 128 * elem`` bytes; 64 B per token in bf16, 32 B in
fp8) plus the page-table entries; for label scoring, ``S * Hkv * C * 2`` label bytes plus the
``req_to_token`` entries. HBM time is those bytes over a measured device-to-device copy bandwidth.
The indexer is also timed by part: scoring alone (keys in, packed int64 order keys out), both
selection paths end to end (``torch.topk`` and the radix select), and the radix select's stages.
"""

# ruff: noqa: B023 - each timed closure runs inside the loop iteration that defines it
from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import platform
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.testing

from qsa_kernels import _topk_radix as _radix
from qsa_kernels import _topk_select as _select
from qsa_kernels.ds_label import label_topk
from qsa_kernels.indexer_topk import indexer_topk
from qsa_kernels.indexer_topk.triton import indexer_keys
from qsa_kernels.topk_merge import merge_candidates


def _median_us(fn: Callable[[], object]) -> float:
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return float(ms) * 1e3


def _graph_us(fn: Callable[[], object]) -> float:
    """Median GPU time of ``fn`` replayed from a CUDA graph (no host launch overhead)."""
    try:
        ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:
        print(f"bench_selection: graph capture failed: {exc!r}", file=sys.stderr)
        return math.nan
    return float(ms) * 1e3


def _hbm_bandwidth() -> float:
    """Measured copy bandwidth in bytes/s (read + write) over a 2 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = _median_us(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6)


def _torch_indexer(
    q: torch.Tensor, k: torch.Tensor, pt: torch.Tensor, n: int, topk: int
) -> torch.Tensor:
    """Vectorised torch baseline: gather keys, fp32 bmm, relu-sum, topk on a packed key."""
    b = q.shape[0]
    pages = pt[:, : (n + 15) // 16].long()
    keys = k[pages].reshape(b, -1, 128)[:, :n].float()
    s = torch.relu(torch.bmm(q.float(), keys.transpose(1, 2))).sum(1) / math.sqrt(128)
    bits = s.view(torch.int32).long()
    key = bits * 2**31 + (2**31 - 1 - torch.arange(n, device=q.device))
    return torch.topk(key, topk, dim=1).indices.sort(dim=1).values.int()


@contextlib.contextmanager
def _radix_min_width(width: int) -> Iterator[None]:
    """Route :func:`indexer_topk` through one selection path for the duration."""
    saved = _select.RADIX_MIN_WIDTH
    _select.RADIX_MIN_WIDTH = width
    try:
        yield
    finally:
        _select.RADIX_MIN_WIDTH = saved


def _torch_select_us(keys: torch.Tensor, out: torch.Tensor) -> float:
    """Graph time of the ``torch.topk`` selection alone over ``keys``."""
    with _radix_min_width(1 << 62):
        return _graph_us(lambda: _select.topk_from_keys(keys, out.shape[1], out))


def bench_indexer(bw: float) -> list[dict[str, Any]]:
    rows = []
    for ctx in (32 * 1024, 256 * 1024, 1024 * 1024):
        for batch in (1, 8):
            for dtype in (torch.bfloat16, torch.float8_e4m3fn):
                n = ctx // 4
                p = n // 16
                q = torch.randn(batch, 4, 128, device="cuda").to(torch.bfloat16)
                k = torch.randn(batch * p + 1, 16, 128, device="cuda").to(dtype)
                pt = torch.randperm(batch * p + 1, device="cuda")[: batch * p].view(batch, p).int()
                sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")

                def run() -> torch.Tensor:
                    return indexer_topk(q, k, pt, sl, topk=512)

                uses_radix = p * 16 >= _select.RADIX_MIN_WIDTH
                tri = _median_us(run)
                tri_g = _graph_us(run)
                with _radix_min_width(1 << 62):
                    topk_path = _graph_us(run)
                    want = run()
                with _radix_min_width(1):
                    radix_path = _graph_us(run)
                    same = bool(torch.equal(run(), want))
                score = _graph_us(lambda: indexer_keys(q, k, pt, sl))

                def score_hist() -> tuple[torch.Tensor, torch.Tensor]:
                    ws = _radix.new_workspace(batch, q.device)
                    return indexer_keys(q, k, pt, sl, radix=(ws, 512)), ws

                def score_hist_flags() -> torch.Tensor:
                    keys, ws = score_hist()
                    _radix.stage_flags(keys, ws, 512)
                    return ws

                keys = indexer_keys(q, k, pt, sl)
                out = torch.empty(batch, 512, dtype=torch.int32, device="cuda")
                cum = {
                    "score_hist": _graph_us(score_hist),
                    "score_hist_flags": _graph_us(score_hist_flags),
                }
                stages = {
                    "score_hist": cum["score_hist"],
                    "flags": cum["score_hist_flags"] - cum["score_hist"],
                    "write": radix_path - cum["score_hist_flags"],
                    "topk_select": _torch_select_us(keys, out),
                    "candidates_max": int(
                        score_hist_flags()[
                            :, _radix.COPIES * _radix.BINS + _radix._CAND_COUNT.value
                        ].max()
                    ),
                }
                ref = _median_us(lambda: _torch_indexer(q, k, pt, n, 512))
                ref_g = _graph_us(lambda: _torch_indexer(q, k, pt, n, 512))
                nbytes = batch * (n * 128 * k.element_size() + p * 4)
                hbm = nbytes / bw * 1e6
                rows.append(
                    {
                        "ctx": ctx,
                        "B": batch,
                        "dtype": str(dtype).removeprefix("torch."),
                        "bytes": nbytes,
                        "path": "radix" if uses_radix else "torch.topk",
                        "eager_us": tri,
                        "triton_us": tri_g,
                        "score_us": score,
                        "topk_path_us": topk_path,
                        "radix_path_us": radix_path,
                        "radix_equals_topk": same,
                        "stages_us": stages,
                        "torch_eager_us": ref,
                        "torch_us": ref_g,
                        "hbm_us": hbm,
                        "speedup_vs_torch": ref_g / tri_g,
                        "x_hbm": tri_g / hbm,
                        "score_x_hbm": score / hbm,
                    }
                )
                print(rows[-1], flush=True)
    return rows


def bench_merge() -> list[dict[str, Any]]:
    rows = []
    for ranks in (2, 4, 8):
        for k in (512, 2048):
            n_rows = 8
            s = torch.randn(ranks, n_rows, k, device="cuda")
            ids = torch.randperm(ranks * n_rows * k, device="cuda").view(ranks, n_rows, k).int()

            def ref() -> torch.Tensor:
                bits = s.view(torch.int32).long()
                ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
                key = (ordered << 32) | (0xFFFFFFFF - ids.long())
                return torch.topk(key.permute(1, 0, 2).reshape(n_rows, -1), k, dim=1).values

            tri = _median_us(lambda: merge_candidates(s, ids, topk=k, check_nan=False))
            tri_g = _graph_us(lambda: merge_candidates(s, ids, topk=k, check_nan=False))
            tri_nan = _median_us(lambda: merge_candidates(s, ids, topk=k))
            tor = _median_us(ref)
            tor_g = _graph_us(ref)
            rows.append(
                {
                    "ranks": ranks,
                    "rows": n_rows,
                    "k": k,
                    "triton_us": tri,
                    "triton_checked_us": tri_nan,
                    "torch_us": tor,
                    "triton_graph_us": tri_g,
                    "torch_graph_us": tor_g,
                    "speedup_vs_torch": tor_g / tri_g,
                }
            )
            print(rows[-1], flush=True)
    return rows


def bench_label(bw: float) -> list[dict[str, Any]]:
    rows = []
    hq, hkv, d, c, heavy = 24, 2, 256, 16, 1024
    for ctx in (32 * 1024, 128 * 1024):
        for batch in (1, 8):
            slots = batch * ctx
            q = torch.randn(batch, hq, d, device="cuda").to(torch.bfloat16)
            k = torch.randn(slots, hkv, d, device="cuda").to(torch.bfloat16)
            ch = torch.stack([torch.randperm(d, device="cuda")[:c] for _ in range(hkv)]).int()
            labels = torch.gather(k, 2, ch.long().unsqueeze(0).expand(slots, -1, -1)).contiguous()
            r2t = torch.randperm(slots, device="cuda").view(batch, ctx).int()
            sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            kd = k.view(batch, ctx, hkv, d)
            qg = q.view(batch, hkv, hq // hkv, d)

            def dense() -> torch.Tensor:
                return torch.einsum("bgd,bsgd->bgs", qg.sum(2), kd)

            tri = _median_us(lambda: label_topk(q, labels, ch, r2t, sl, heavy_token_num=heavy))
            tri_g = _graph_us(lambda: label_topk(q, labels, ch, r2t, sl, heavy_token_num=heavy))
            with _radix_min_width(1 << 62):
                topk_g = _graph_us(
                    lambda: label_topk(q, labels, ch, r2t, sl, heavy_token_num=heavy)
                )
            den = _median_us(dense)
            nbytes = batch * ctx * (hkv * c * 2 + 4)
            rows.append(
                {
                    "ctx": ctx,
                    "B": batch,
                    "C": c,
                    "triton_us": tri,
                    "triton_graph_us": tri_g,
                    "topk_path_graph_us": topk_g,
                    "dense_qk_us": den,
                    "hbm_us": nbytes / bw * 1e6,
                    "speedup_vs_dense": den / tri,
                }
            )
            print(rows[-1], flush=True)
    return rows


def _markdown(
    meta: dict[str, Any],
    ind: list[dict[str, Any]],
    mer: list[dict[str, Any]],
    lab: list[dict[str, Any]],
) -> str:
    out = ["# Selection kernels: benchmark results", ""]
    out += [f"- {key}: {val}" for key, val in meta.items()]
    out += [
        "",
        "## Indexer scoring + top-512 (decode)",
        "",
        "GPU time from CUDA-graph replay (how decode runs under SGLang); `eager` columns include "
        "host launch overhead. Ratios use the graph times. `total` is `indexer_topk` as shipped "
        "(`path`: the radix select for rows of at least `RADIX_MIN_WIDTH` blocks, else "
        "`torch.topk`); `score` is scoring alone (packed keys out, no histogram).",
        "",
        "| context | B | keys | bytes read | HBM us | path | total us | score us | total/HBM "
        "| score/HBM | torch us | torch/total | eager us | torch eager us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['ctx']} | {r['B']} | {r['dtype']} | {r['bytes']} | {r['hbm_us']:.1f} | "
        f"{r['path']} | {r['triton_us']:.1f} | {r['score_us']:.1f} | {r['x_hbm']:.2f} | "
        f"{r['score_x_hbm']:.2f} | {r['torch_us']:.1f} | {r['speedup_vs_torch']:.2f} | "
        f"{r['eager_us']:.1f} | {r['torch_eager_us']:.1f} |"
        for r in ind
    ]
    out += [
        "",
        "Both selection paths end to end (graph us), and the radix path's passes: scoring with "
        "the fused histogram (its zeroed workspace included), then what the flag pass (with the "
        "threshold key) and the ordered write add; `topk select` is the `torch.topk` selection "
        "alone; "
        "`cands` is the largest threshold-bin count (ranking takes up to "
        f"{_radix.CAND_CAP}); `same` checks the two paths agree.",
        "",
        "| context | B | keys | torch.topk path | radix path | score+hist | flags | write "
        "| topk select | cands | same |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out += [_stage_row(r) for r in ind]
    out += [
        "",
        "## Distributed candidate merge (8 rows)",
        "",
        "| ranks | k | graph us | torch topk graph us | torch/triton (graph) | eager us "
        "| eager + NaN check us | torch eager us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['ranks']} | {r['k']} | {r['triton_graph_us']:.1f} | {r['torch_graph_us']:.1f} | "
        f"{r['speedup_vs_torch']:.2f} | {r['triton_us']:.1f} | {r['triton_checked_us']:.1f} | "
        f"{r['torch_us']:.1f} |"
        for r in mer
    ]
    out += [
        "",
        "## Double-sparsity label scoring + top-1024 (24 q / 2 kv heads, D 256, C 16)",
        "",
        "`graph us` is `label_topk` as shipped (radix select for rows of at least "
        "`RADIX_MIN_WIDTH` tokens); `torch.topk path` the same with the `torch.topk` select.",
        "",
        "| context | B | triton eager us | triton graph us | torch.topk path graph us "
        "| dense q.k us | dense/triton (eager) | label HBM us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['ctx']} | {r['B']} | {r['triton_us']:.1f} | {r['triton_graph_us']:.1f} | "
        f"{r['topk_path_graph_us']:.1f} | {r['dense_qk_us']:.1f} | {r['speedup_vs_dense']:.2f} | "
        f"{r['hbm_us']:.1f} |"
        for r in lab
    ]
    return "\n".join(out) + "\n"


def _stage_row(r: dict[str, Any]) -> str:
    st = r["stages_us"]
    return (
        f"| {r['ctx']} | {r['B']} | {r['dtype']} | {r['topk_path_us']:.1f} | "
        f"{r['radix_path_us']:.1f} | {st['score_hist']:.1f} | {st['flags']:.1f} | "
        f"{st['write']:.1f} | {st['topk_select']:.1f} | {st['candidates_max']} | "
        f"{r['radix_equals_topk']} |"
    )


def _guarded(name: str, fn: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run one section; a failure is reported and leaves that section empty, not the whole run."""
    try:
        return fn()
    except Exception as exc:
        print(f"bench_selection: section {name!r} failed: {exc!r}", file=sys.stderr)
        return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_selection: CUDA is not available; these benchmarks need a GPU", file=sys.stderr
        )
        return 77  # the bench session reads 77 as "skipped: no hardware"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    bw = _hbm_bandwidth()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "measured copy bandwidth (read+write)": f"{bw / 1e12:.2f} TB/s",
        "command": "python3 " + " ".join(sys.argv),
        "timing": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms",
    }
    ind = _guarded("indexer", lambda: bench_indexer(bw))
    mer = _guarded("merge", bench_merge)
    lab = _guarded("label", lambda: bench_label(bw))
    (args.out_dir / "selection.json").write_text(
        json.dumps({"meta": meta, "indexer": ind, "merge": mer, "label": lab}, indent=2)
    )
    md = _markdown(meta, ind, mer, lab)
    (args.out_dir / "selection.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
