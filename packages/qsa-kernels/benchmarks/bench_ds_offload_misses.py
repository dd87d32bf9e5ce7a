"""What DS-Offload's hot cache misses from step to step, as the queries drift and as it grows.

DS-Offload's captured step is bound by its fetch when the heavy tokens change: with independent
random queries every step almost every chosen record misses the hot cache (57,210 of 65,536 at
batch 1 in ``ds_offload_step.md``), and the copy runs at the pinned host-to-device rate. A
model's queries move less from one step to the next. This measures the miss rate against that
movement, for three hot-cache sizes, so that a selection overlap measured on a real model reads
off as a miss rate and a step time.

A :class:`~qsa_kernels.double_sparsity.DSOffloadedKV` with per-head records at Llama-3.1-8B's
attention shape (8 K/V and 32 query heads of 128, bf16; 32 heavy channels, 256 heavy tokens) holds
one row of a ``--context``-token prompt of random keys, over ``--layers`` layers (the rate is per
layer; two give a second sample). Each decode step appends a token and, per layer, chooses the
heavy tokens from the labels for a query that drifts: ``q = rho * q + sqrt(1 - rho^2) * noise``
(``rho = 0``: a new random query each step, as ``bench_ds_offload_step``), lists each head's
blocks and attends, counting the records selected and those that missed the hot cache. Reported
per (drift, hot slots): the misses over the selected records after the first step (which fetches
everything), the heavy tokens shared with the previous step, and at the 32-layer shape the MiB a
step copies and the copy's time at ``--pinned-gbps`` (48.2 GB/s: the H100's pinned rate that
``ds_offload_step.md`` measured); counts, not times, so it runs on the CPU too (the torch path).

Beside the store's own counts, the same chosen tokens are replayed through a model of a
token-granular hot cache of the same bytes (``4 x hot slots`` tokens per K/V head,
least-recently chosen evicted first), which copies only the chosen tokens it misses (one token
of one head, K and V: a quarter of a record). Reported: the records a chosen token costs (a
record is 4 tokens; scattered choices fetch 4 tokens for each one attended) and that model's
miss rate and MiB a step: what fetching tokens instead of records would move.

Writes ``<out-dir>/ds_offload_misses.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import collections
import math
import pathlib

import _report
import torch

_HKV, _HQ, _D, _MODEL_LAYERS = 8, 32, 128, 32
_CHANNELS, _HEAVY, _THRESHOLD = 32, 256, 4096
_RECORD_TOKENS = 4  # a per-head record: one block of 4 tokens of one K/V head


class _TokenCache:
    """A model of one K/V head's hot cache holding single tokens, least-recently chosen out."""

    def __init__(self, capacity: int) -> None:
        self._held: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._capacity = capacity

    def choose(self, tokens: set[int]) -> int:
        """Attend ``tokens``: returns how many were not held (and are now)."""
        missing = 0
        for token in sorted(tokens):
            if token in self._held:
                self._held.move_to_end(token)
            else:
                missing += 1
                self._held[token] = None
        while len(self._held) > self._capacity:
            self._held.popitem(last=False)
        return missing


def _measure(
    context: int, layers: int, steps: int, *, drift: float, hot_slots: int, device: torch.device
) -> dict[str, float]:
    """One store, ``steps`` measured steps at one drift and hot-cache size."""
    from qsa_kernels import KernelPath
    from qsa_kernels.double_sparsity import DSConfig, DSOffloadedKV, ds_positions
    from qsa_kernels.offload import OffloadGeometry

    config = DSConfig(
        heavy_channel_num=_CHANNELS, heavy_token_num=_HEAVY, sparse_decode_threshold=_THRESHOLD
    )
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = (context + steps + 8) // 4 + 1
    geometry = OffloadGeometry(
        layers, 1, hot_slots, blocks, _HKV, _D, torch.bfloat16, per_head=True
    )
    channels = torch.stack(
        [torch.randperm(_D, generator=gen, device=device)[:_CHANNELS] for _ in range(layers * _HKV)]
    ).view(layers, _HKV, _CHANNELS)
    on_cpu = device.type == "cpu"  # the torch references: Triton needs a GPU
    path = KernelPath.REFERENCE if on_cpu else KernelPath.AUTO
    store = DSOffloadedKV(geometry, channels.int(), config=config, device=device, path=path)
    k = torch.randn(layers, context, _HKV, _D, generator=gen, device=device).bfloat16()
    store.admit(0, k, torch.randn_like(k))
    del k
    rows = [0]
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # (selected, missing) records
    q = torch.randn(layers, 1, _HQ, _D, generator=gen, device=device)
    keep, fresh = drift, math.sqrt(1.0 - drift * drift)
    shared, previous = 0.0, [None] * layers
    token_caches = [
        [_TokenCache(_RECORD_TOKENS * hot_slots) for _ in range(_HKV)] for _ in range(layers)
    ]
    chosen_tokens = token_misses = 0
    for step in range(steps + 1):
        if step == 1:  # the first step fetches every block: count the steps after it
            counts.zero_()
            shared = 0.0
            chosen_tokens = token_misses = 0
        store.begin_step()
        new = torch.randn(layers, 1, _HKV, _D, generator=gen, device=device).bfloat16()
        store.append(rows, new, torch.randn_like(new))
        lengths = [store.length(0)]
        slots = store.labels.slots(rows, lengths[0])
        q = keep * q + fresh * torch.randn(q.shape, generator=gen, device=device)
        for layer in range(layers):
            query = q[layer].bfloat16()
            positions = ds_positions(
                query,
                store.labels.layer(layer),
                store.labels.channels[layer],
                slots,
                lengths,
                config=config,
                reference=on_cpu,
            )
            held = store.kv.token_blocks(rows, positions)
            store.kv.attend_tokens(layer, rows, query, positions, held, counters=counts)
            chosen = [set(h.tolist()) - {-1} for h in positions[0]]
            chosen_tokens += sum(len(c) for c in chosen)
            token_misses += sum(
                cache.choose(c) for cache, c in zip(token_caches[layer], chosen, strict=True)
            )
            if previous[layer] is not None:
                shared += sum(len(a & b) for a, b in zip(chosen, previous[layer], strict=True))
            previous[layer] = chosen
    selected, missing = (int(c) for c in counts)
    per_step_layer = missing / (steps * layers)
    record_bytes = geometry.record_bytes
    token_bytes = record_bytes // _RECORD_TOKENS
    return {
        "drift": drift,
        "hot_slots": hot_slots,
        "miss_rate": missing / selected,
        "shared_heavy_tokens": shared / (steps * layers * _HKV * _HEAVY),
        "missing_records_per_layer_step": per_step_layer,
        "mib_per_step_32_layers": per_step_layer * _MODEL_LAYERS * record_bytes / 2**20,
        "records_per_heavy_token": selected / chosen_tokens,
        "token_miss_rate": token_misses / chosen_tokens,
        "token_mib_per_step_32_layers": (
            token_misses / (steps * layers) * _MODEL_LAYERS * token_bytes / 2**20
        ),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure every (drift, hot slots) pair, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--drifts", default="0,0.5,0.9,0.95,0.99")
    parser.add_argument("--hot-slots", default="256,512,1023")
    parser.add_argument("--pinned-gbps", type=float, default=48.2)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for hot in (int(h) for h in args.hot_slots.split(",")):
        for drift in (float(d) for d in args.drifts.split(",")):
            rows.append(
                _measure(
                    args.context, args.layers, args.steps, drift=drift, hot_slots=hot, device=device
                )
            )
            rows[-1]["copy_ms_per_step"] = (
                rows[-1]["mib_per_step_32_layers"] * 2**20 / (args.pinned_gbps * 1e9) * 1e3
            )
            print(f"bench_ds_offload_misses: {rows[-1]}", flush=True)
    machine = _report.machine()
    lines = [
        "# DS-Offload's hot-cache misses against query drift and hot-cache size",
        "",
        f"{machine['device']}, torch {machine['torch']}; Llama-3.1-8B's attention shape, per-head "
        f"records, {_CHANNELS} heavy channels, {_HEAVY} heavy tokens; one row of "
        f"{args.context:,} random keys over {args.layers} layers, {args.steps} steps counted "
        "after the first; the query drifts as `q = rho q + sqrt(1 - rho^2) noise`. MiB and copy "
        f"time: at 32 layers and {args.pinned_gbps} GB/s. "
        "`packages/qsa-kernels/benchmarks/bench_ds_offload_misses.py`.",
        "",
        "| hot slots | drift rho | heavy tokens kept from the last step | miss rate | "
        "MiB copied a step | copy ms a step | records per heavy token "
        "| token cache: miss rate | token cache: MiB a step |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['hot_slots']:,} | {r['drift']:.2f} | {r['shared_heavy_tokens']:.1%} | "
            f"{r['miss_rate']:.1%} | {r['mib_per_step_32_layers']:.1f} | "
            f"{r['copy_ms_per_step']:.2f} | {r['records_per_heavy_token']:.2f} | "
            f"{r['token_miss_rate']:.1%} | {r['token_mib_per_step_32_layers']:.1f} |"
        )
    data = {"machine": machine, "args": vars(args) | {"out_dir": None}, "rows": rows}
    _report.write(args.out_dir, "ds_offload_misses", data, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
