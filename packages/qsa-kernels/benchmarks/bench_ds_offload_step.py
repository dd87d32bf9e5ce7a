"""Where one DS-Offload decode step's time goes, part by part, at Llama-3.1-8B's attention shape.

A :class:`~qsa_kernels.double_sparsity.DSOffloadedKV` with per-head records (32 layers, 8 KV and 32
query heads of 128, bf16; 32 heavy channels, 256 heavy tokens, dense below 4,096) holds ``B`` rows
of a ``--context``-token prompt in pinned host memory. Each decode step appends one token per
row (K/V write-back and labels) and then, per layer, chooses the heavy tokens from the labels
(``ds_positions``), lists each head's blocks (``token_blocks``), fetches the misses and attends
(``attend_tokens``). Every part is timed on the host around a device synchronisation, so a
part's time is its host work plus the GPU work it waits for: what an eager engine step pays.
The first step fetches every block; the reported steps after it fetch only what changes.

Then the step as a CUDA-graph engine runs it: the append eagerly (the step plan and write-back),
every layer's fixed-shape decode (:meth:`DSOffloadedKV.decode_fixed`) replayed from one captured
graph, against resident double sparsity's captured step at the same shape
(:func:`ds_heavy_decode_split` over a resident ``[B x max_tokens, Hkv, D]`` K/V, what the
``qsa_ds`` backend captures; one K/V buffer serves every layer, the time depends on its shape
only). Both are timed around a synchronisation per step, in one run: their ratio is DS-Offload's
decode speed against resident at the attention level.

Writes ``<out-dir>/ds_offload_step.md`` and ``.json``. Needs CUDA; exits with status 77 without.
"""

# ruff: noqa: B023 (each closure runs within the loop iteration that defines it)
from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import _report
import torch

if TYPE_CHECKING:
    from qsa_kernels.double_sparsity import DSOffloadedKV

_T = TypeVar("_T")

_LAYERS, _HKV, _HQ, _D = 32, 8, 32, 128
_CHANNELS, _HEAVY, _THRESHOLD = 32, 256, 4096
_PARTS = ("append", "ds_positions", "token_blocks", "attend_tokens")


def _timed(totals: dict[str, float], part: str, fn: Callable[[], _T]) -> _T:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    totals[part] += time.perf_counter() - start
    return result


def _store(
    batch: int, context: int, steps: int, *, seed: int
) -> tuple[DSOffloadedKV, torch.Generator]:
    """A DS-Offload store at Llama-8B's shape holding ``batch`` random prompts of ``context``."""
    from qsa_kernels.double_sparsity import DSConfig, DSOffloadedKV
    from qsa_kernels.offload import OffloadGeometry

    config = DSConfig(
        heavy_channel_num=_CHANNELS, heavy_token_num=_HEAVY, sparse_decode_threshold=_THRESHOLD
    )
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = (context + steps + 8) // 4 + 1
    geometry = OffloadGeometry(
        _LAYERS, batch, config.hot_blocks(), blocks, _HKV, _D, torch.bfloat16, per_head=True
    )
    channels = torch.stack(
        [torch.randperm(_D, device="cuda")[:_CHANNELS] for _ in range(_LAYERS * _HKV)]
    ).view(_LAYERS, _HKV, _CHANNELS)
    store = DSOffloadedKV(geometry, channels.int(), config=config, device="cuda")
    for row in range(batch):
        k = torch.randn(_LAYERS, context, _HKV, _D, generator=gen, device="cuda").bfloat16()
        store.admit(row, k, torch.randn_like(k))
        del k
    return store, gen


def _step_parts(batch: int, context: int, steps: int) -> dict[str, object]:
    """Per-step milliseconds of each part, and the fetched bytes, for ``batch`` rows."""
    from qsa_kernels.double_sparsity import ds_positions

    store, gen = _store(batch, context, steps, seed=0)
    config, geometry = store.config, store.geometry
    rows = list(range(batch))
    totals: dict[str, float] = defaultdict(float)
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")  # (selected, missing) records
    for step in range(steps + 1):
        if step == 1:  # the first step fetches every block: report the steps after it
            totals.clear()
            counts.zero_()
        store.begin_step()
        new = torch.randn(_LAYERS, batch, _HKV, _D, generator=gen, device="cuda").bfloat16()
        _timed(totals, "append", lambda: store.append(rows, new, torch.randn_like(new)))
        lengths = [store.length(r) for r in rows]
        slots = store.labels.slots(rows, max(lengths))
        for layer in range(_LAYERS):
            q = torch.randn(batch, _HQ, _D, generator=gen, device="cuda").bfloat16()
            positions = _timed(
                totals,
                "ds_positions",
                lambda: ds_positions(
                    q,
                    store.labels.layer(layer),
                    store.labels.channels[layer],
                    slots,
                    lengths,
                    config=config,
                ),
            )
            held = _timed(totals, "token_blocks", lambda: store.kv.token_blocks(rows, positions))
            _timed(
                totals,
                "attend_tokens",
                lambda: store.kv.attend_tokens(layer, rows, q, positions, held, counters=counts),
            )
    per_step = {part: 1e3 * totals[part] / steps for part in _PARTS}
    fetched = int(counts[1])
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "ms_per_step": per_step,
        "step_ms": sum(per_step.values()),
        "fetched_records_per_step": fetched / steps,
        "fetched_mib_per_step": fetched * geometry.record_bytes / steps / 2**20,
        "record_bytes": geometry.record_bytes,
        "hot_slots": geometry.hot_slots,
    }


def _captured(batch: int, context: int, steps: int) -> dict[str, object]:
    """Milliseconds per step of the captured DS-Offload decode and of resident DS, one batch."""
    from qsa_kernels.double_sparsity import ds_heavy_decode_split

    store, gen = _store(batch, context, steps, seed=1)
    geometry = store.geometry
    slots = batch * geometry.max_tokens  # the label cache's rows, one resident K/V slot each
    resident_k = torch.randn(slots, _HKV, _D, generator=gen, device="cuda").bfloat16()
    resident_v = torch.randn_like(resident_k)
    rows = list(range(batch))
    table = store.labels.slots(rows, geometry.max_tokens)
    static_q = torch.zeros(_LAYERS, batch, _HQ, _D, dtype=torch.bfloat16, device="cuda")
    lengths = torch.zeros(batch, dtype=torch.int32, device="cuda")

    def offloaded() -> list[object]:
        return [store.decode_fixed(layer, rows, static_q[layer]).out for layer in range(_LAYERS)]

    def resident() -> list[object]:
        return [
            ds_heavy_decode_split(
                static_q[layer],
                resident_k,
                resident_v,
                store.labels.layer(layer),
                store.labels.channels[layer],
                table,
                lengths,
                heavy_token_num=_HEAVY,
            ).out
            for layer in range(_LAYERS)
        ]

    graphs = {"ds_offload": torch.cuda.CUDAGraph(), "resident": torch.cuda.CUDAGraph()}
    bodies = {"ds_offload": offloaded, "resident": resident}
    totals: dict[str, float] = defaultdict(float)
    for step in range(steps + 2):
        if step == 2:  # capture, then the first replay fetches every block: skip both
            totals.clear()
        store.begin_step()
        new = torch.randn(_LAYERS, batch, _HKV, _D, generator=gen, device="cuda").bfloat16()
        _timed(totals, "append", lambda: store.append(rows, new, torch.randn_like(new)))
        lengths.copy_(store.kv.step_lengths)
        static_q.copy_(torch.randn(static_q.shape, generator=gen, device="cuda").bfloat16())
        for name, graph in graphs.items():
            if step == 0:
                bodies[name]()  # compiles every kernel before the capture
                with torch.cuda.graph(graph):
                    bodies[name]()
            _timed(totals, name, graph.replay)
    per_step = {name: 1e3 * totals[name] / steps for name in ("append", *graphs)}
    kernels = {name: _kernel_profile(body) for name, body in bodies.items()}
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "ms_per_step": per_step,
        "ds_offload_over_resident": per_step["resident"]
        / (per_step["append"] + per_step["ds_offload"]),
        "kernels": kernels,
    }


def _kernel_profile(body: Callable[[], object], *, top: int = 12) -> dict[str, object]:
    """One eager run of ``body`` under the profiler: its kernels, their GPU time, the top ones.

    Kernel durations are GPU time, so their sum is what the step's kernels cost with no launch
    gaps; the captured replay's time beyond it is the graph's launch and dependency overhead.
    """
    from torch.profiler import ProfilerActivity, profile

    body()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        body()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            by_name[event.name].append(event.device_time_total)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {
        "kernels": sum(len(v) for v in by_name.values()),
        "gpu_ms": sum(sum(v) for v in by_name.values()) / 1e3,
        "top": [
            {"name": name[:90], "calls": len(v), "gpu_ms": sum(v) / 1e3} for name, v in ranked[:top]
        ],
    }


def main(argv: list[str]) -> int:
    """Measure each batch, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ds_offload_step: needs CUDA; skipped", file=sys.stderr)
        return 77  # the bench session reads 77 as "skipped: no hardware"
    rows, captured = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        rows.append(_step_parts(batch, args.context, args.steps))
        print(f"bench_ds_offload_step: {rows[-1]}", flush=True)
        torch.cuda.empty_cache()
        captured.append(_captured(batch, args.context, args.steps))
        print(f"bench_ds_offload_step: captured {captured[-1]}", flush=True)
        torch.cuda.empty_cache()
    write_report(args.out_dir, _report.machine(), rows, captured)
    return 0


def write_report(
    out_dir: pathlib.Path,
    machine: dict[str, str],
    rows: list[dict[str, object]],
    captured: list[dict[str, object]],
) -> None:
    """Write ``ds_offload_step.json`` and ``.md`` from measured rows (also from a run's log)."""
    lines = [
        "# One DS-Offload decode step, part by part (Llama-3.1-8B attention shape)",
        "",
        f"{machine['device']}, torch {machine['torch']}; per-head records, {_CHANNELS} heavy "
        f"channels, {_HEAVY} heavy tokens; host-timed parts (host work plus the GPU work "
        "each waits for), milliseconds per step over every layer. "
        "`packages/qsa-kernels/benchmarks/bench_ds_offload_step.py`.",
        "",
        "| context | batch | " + " | ".join(_PARTS) + " | step | fetched MiB/step |",
        "| ---: | ---: | " + " | ".join("---:" for _ in _PARTS) + " | ---: | ---: |",
    ]
    for r in rows:
        parts = r["ms_per_step"]
        assert isinstance(parts, dict)
        lines.append(
            f"| {r['context']:,} | {r['batch']} | "
            + " | ".join(f"{parts[p]:.2f}" for p in _PARTS)
            + f" | {r['step_ms']:.2f} | {r['fetched_mib_per_step']:.1f} |"
        )
    lines += [
        "",
        "Captured: the append launched eagerly, then every layer's `decode_fixed` replayed from "
        "one CUDA graph, against resident double sparsity's captured step "
        "(`ds_heavy_decode_split`) at the same shape; milliseconds per step.",
        "",
        "| context | batch | append | ds_offload replay | resident replay | resident / "
        "(append + ds_offload) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in captured:
        ms = r["ms_per_step"]
        assert isinstance(ms, dict)
        lines.append(
            f"| {r['context']:,} | {r['batch']} | {ms['append']:.2f} | {ms['ds_offload']:.2f} | "
            f"{ms['resident']:.2f} | {r['ds_offload_over_resident']:.2f} |"
        )
    lines += [
        "",
        "Kernels of one eager step (profiler, GPU time only: the captured replay's time beyond "
        "it is launch and dependency overhead):",
        "",
        "| context | batch | arm | kernels | GPU ms | top kernels (calls, GPU ms) |",
        "| ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for r in captured:
        profiles = r["kernels"]
        assert isinstance(profiles, dict)
        for arm, k in profiles.items():
            top = "; ".join(
                f"`{t['name'][:48]}` ({t['calls']}, {t['gpu_ms']:.2f})" for t in k["top"][:6]
            )
            lines.append(
                f"| {r['context']:,} | {r['batch']} | {arm} | {k['kernels']} | "
                f"{k['gpu_ms']:.2f} | {top} |"
            )
    _report.write(
        out_dir, "ds_offload_step", {"machine": machine, "rows": rows, "captured": captured}, lines
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
