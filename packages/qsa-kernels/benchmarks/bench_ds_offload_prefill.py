"""One DS-Offload chunked prefill at Llama-3.1-8B's attention shape: windowed against whole staging.

An :class:`~qsa_kernels.offload.OffloadRuntime` of per-head records (32 layers, 8 KV and 32 query
heads of 128, bf16, one row of ``--context`` tokens) prefills one prompt in ``--chunk``-token
chunks as DS-Offload's backend does: per chunk and layer, :meth:`OffloadRuntime.stage`, then a
dense causal attention of the chunk's queries over the staged prefix (torch's SDPA, GQA, lower
right causal mask: the stand-in for the engine's prefill kernel, whose time the windowed area's
read-back of the next layer's prefix overlaps), then the hand-off at the first decode step.
Two arms, each in a fresh runtime: ``whole`` (the whole prompt of every layer staged on the
GPU) and ``window`` (two layers; each chunk written through to the host arena, each layer's
prefix read back from there one layer ahead on a side stream). Reported: the prefill's time
(wall clock around a device synchronisation, the hand-off included), the first and last chunk's
time, the staging area's device bytes (the capacity plan's, :attr:`OffloadSizes.staging_bytes`)
and the prefix bytes the window read back.

Each arm first prefills one chunk unmeasured, so that neither arm's times hold the first run's
kernel compiles. ``--chunks N`` prefills only the first ``N`` chunks (a quick look; the last
chunks cost most).
Writes ``<out-dir>/ds_offload_prefill.md`` and ``.json``. Needs CUDA; exits with status 77
without.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import _report
import torch

_LAYERS, _HKV, _HQ, _D = 32, 8, 32, 128
_ARMS = ("whole", "window")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The chunk's ``[n, Hq, D]`` queries over ``[end, Hkv, D]`` K/V, causal to the lower right.

    Batched ``[1, H, tokens, D]`` and with K/V repeated to every query head: torch runs a
    lower-right causal mask in its flash or memory-efficient kernel only for 4-D inputs without
    ``enable_gqa``. Otherwise it materialises the mask and takes the math path, whose
    ``[Hq, n, end]`` scores (64 GiB in bf16 at an 8,192-token chunk over 128K) do not fit an
    80 GB GPU.
    """
    from torch.nn.attention.bias import causal_lower_right

    n, end = int(q.shape[0]), int(k.shape[0])
    group = int(q.shape[1]) // int(k.shape[1])
    keys, values = (t.transpose(0, 1).repeat_interleave(group, dim=0)[None] for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=causal_lower_right(n, end)
    )
    return out[0].transpose(0, 1)


def _prefill(arm: str, context: int, chunk: int, chunks: int | None) -> dict[str, object]:
    """One prompt prefilled through one arm's runtime; its times and bytes."""
    from qsa_kernels.double_sparsity import DSConfig
    from qsa_kernels.offload import OffloadLayout, OffloadRuntime

    layout = OffloadLayout.per_head(
        layers=_LAYERS,
        rows=1,
        context_len=context + 8,
        hot_blocks=DSConfig().hot_blocks(),
        kv_heads=_HKV,
        head_dim=_D,
        dtype=torch.bfloat16,
        windowed_staging=arm == "window",
    )
    device = torch.device("cuda")
    runtime = OffloadRuntime.for_geometry(layout.geometry, device, layout.layer_ordinal, None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(chunk, _HKV * _D, generator=gen, device="cuda").bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(chunk, _HQ, _D, generator=gen, device="cuda").bfloat16()
    spans = [(s, min(s + chunk, context)) for s in range(0, context, chunk)][:chunks]
    handle = runtime.admit("prompt", 0)
    chunk_ms = []
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for start, end in spans:
        t0 = time.perf_counter()
        n = end - start
        for layer in range(_LAYERS):
            staged_k, staged_v = runtime.stage(layer, k[:n], v[:n], slot=0, start=start, end=end)
            _attend(q[:n], staged_k, staged_v)
        torch.cuda.synchronize()
        chunk_ms.append((time.perf_counter() - t0) * 1e3)
    tokens = spans[-1][1]
    runtime.prompt_written(handle, tokens, tokens)
    runtime.plan_decode([0], [tokens + 1])  # the hand-off
    torch.cuda.synchronize()
    total_ms = (time.perf_counter() - begin) * 1e3
    record_bytes = layout.geometry.record_bytes * _HKV  # one block of one layer, every head
    read_back = sum(_LAYERS * -(-start // 4) * record_bytes for start, _ in spans)
    result: dict[str, object] = {
        "arm": arm,
        "context": context,
        "chunk": chunk,
        "tokens": tokens,
        "prefill_ms": total_ms,
        "first_chunk_ms": chunk_ms[0],
        "last_chunk_ms": chunk_ms[-1],
        "staging_mib": layout.geometry.sizes.staging_bytes / (1 << 20),
        "read_back_gib": (read_back if arm == "window" else 0) / (1 << 30),
        "peak_allocated_mib": torch.cuda.max_memory_allocated() / (1 << 20),
    }
    runtime.release(handle)
    return result


def main(argv: list[str]) -> int:
    """Measure both arms, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--chunks", type=int, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ds_offload_prefill: needs CUDA; skipped", file=sys.stderr)
        return 77  # the bench session reads 77 as "skipped: no hardware"
    for arm in _ARMS:  # one chunk of each first: kernel compiles and allocator growth
        _prefill(arm, args.context, args.chunk, 1)
    rows = []
    for arm in _ARMS:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rows.append(_prefill(arm, args.context, args.chunk, args.chunks))
        print(f"bench_ds_offload_prefill: {rows[-1]}", flush=True)
    write_report(args.out_dir, _report.machine(), rows)
    return 0


def write_report(
    out_dir: pathlib.Path, machine: dict[str, str], rows: list[dict[str, object]]
) -> None:
    """Write ``ds_offload_prefill.json`` and ``.md`` from measured rows (also from a run's log)."""
    lines = [
        "# One DS-Offload chunked prefill: windowed against whole staging (Llama-3.1-8B shape)",
        "",
        f"{machine['device']}, torch {machine['torch']}; per-head records, one row; SDPA stands in "
        "for the engine's prefill kernel; milliseconds, the hand-off included. "
        "`packages/qsa-kernels/benchmarks/bench_ds_offload_prefill.py`.",
        "",
        "| arm | tokens | chunk | prefill ms | first chunk ms | last chunk ms | staging MiB | "
        "read back GiB | peak allocated MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['tokens']:,} | {r['chunk']:,} | {r['prefill_ms']:.1f} | "
            f"{r['first_chunk_ms']:.1f} | {r['last_chunk_ms']:.1f} | {r['staging_mib']:,.0f} | "
            f"{r['read_back_gib']:.1f} | {r['peak_allocated_mib']:,.0f} |"
        )
    _report.write(out_dir, "ds_offload_prefill", {"machine": machine, "rows": rows}, lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
