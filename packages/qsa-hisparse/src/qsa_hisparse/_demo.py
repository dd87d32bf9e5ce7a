"""``qsa-hisparse demo``: the offload plan and the hot-cache contract on a synthetic decode, on CPU.

Part 1 prints the per-rank memory plan of Qwen3.8-Flash-Next at TP2 with FP8 K/V, with and without
host offload (``qsa_core.plan_capacity``). Part 2 drives the hot-cache residency contract that the
GPU fetch kernel implements (``qsa_core.plan_residency_step``) through a synthetic decode of one
262,144-token request, and reports how many selected blocks miss per step for several hot-cache
sizes: the bytes each step must bring over PCIe. No GPU, no model and no SGLang are needed.

The synthetic selection is labelled as such: each block has a fixed importance, each step adds
noise, and the top 512 by score are selected together with the attention-sink blocks and the most
recent blocks. Blocks near the selection boundary drift in and out, which is what a hot cache larger
than the selection absorbs.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from qsa_core import (
    QWEN38_FLASH_NEXT,
    HotCacheState,
    KVDType,
    QSAProfile,
    format_bytes,
    plan_capacity,
    plan_residency_step,
    render_plan,
)

_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DecodeTrace:
    """Misses of a synthetic decode through one hot cache of ``num_slots`` block slots."""

    num_slots: int
    selected_per_step: int
    first_step_misses: int
    steady_misses: tuple[int, ...]
    bytes_per_block: int

    @property
    def mean_steady_miss_rate(self) -> float:
        """Mean fraction of selected blocks that miss after the first step."""
        if not self.steady_misses:
            return 0.0
        return sum(self.steady_misses) / (len(self.steady_misses) * self.selected_per_step)


def synthetic_selections(
    profile: QSAProfile, context_len: int, steps: int, *, noise: float, seed: int
) -> tuple[int, list[list[int]]]:
    """Block selections of a synthetic decode: ``steps`` lists of ``profile.block_topk`` block ids.

    Returns the number of visible blocks and the per-step selections (distinct ids, no padding).
    """
    rng = random.Random(seed)
    num_blocks = context_len // profile.compress_ratio
    k = profile.block_topk
    sinks = list(range(4))
    recent_count = 32
    importance = [rng.gauss(0.0, 1.0) for _ in range(num_blocks)]
    # Only blocks whose base importance is high can ever win under modest noise.
    contenders = heapq.nlargest(8 * k, range(num_blocks), key=importance.__getitem__)
    selections: list[list[int]] = []
    for step in range(steps):
        # One new block closes every 4 decode steps at ratio 4.
        visible = num_blocks + step // profile.compress_ratio
        forced = sinks + list(range(visible - recent_count, visible))
        forced_set = set(forced)
        scored = (
            (importance[b] + noise * rng.gauss(0.0, 1.0), b)
            for b in contenders
            if b not in forced_set
        )
        chosen = [b for _, b in heapq.nlargest(k - len(forced), scored)]
        selections.append(forced + chosen)
    return num_blocks + steps // profile.compress_ratio + 1, selections


def trace_decode(
    selections: Sequence[Sequence[int]], num_blocks: int, num_slots: int, bytes_per_block: int
) -> DecodeTrace:
    """Run the residency contract over ``selections`` with a hot cache of ``num_slots`` slots."""
    state = HotCacheState.empty(num_slots)
    misses: list[int] = []
    for step, selected in enumerate(selections):
        plan = plan_residency_step(state, selected, step, num_blocks=num_blocks)
        misses.append(plan.num_misses)
        state = plan.state
    return DecodeTrace(
        num_slots=num_slots,
        selected_per_step=len(selections[0]),
        first_step_misses=misses[0],
        steady_misses=tuple(misses[1:]),
        bytes_per_block=bytes_per_block,
    )


def render_traces(profile: QSAProfile, tp_size: int, traces: Sequence[DecodeTrace]) -> str:
    """A table of miss rates and bytes per step for each hot-cache size."""
    layers = len(profile.qsa_layer_ids)
    lines = [
        "Synthetic decode through the hot-cache residency contract (one request, one layer shown;",
        f"a step moves this for each of the {layers} QSA layers), TP{tp_size}, FP8 K/V:",
        "",
        "  hot slots  (x top-k)  first step  steady misses/step  miss rate  bytes/step, all layers",
        "  ---------  ---------  ----------  ------------------  ---------  ----------------------",
    ]
    for trace in traces:
        mean_misses = sum(trace.steady_misses) / max(1, len(trace.steady_misses))
        step_bytes = int(mean_misses * trace.bytes_per_block * layers)
        lines.append(
            f"  {trace.num_slots:>9,}  {trace.num_slots / trace.selected_per_step:>8.2f}x"
            f"  {trace.first_step_misses:>10,}  {mean_misses:>18.1f}"
            f"  {trace.mean_steady_miss_rate:>8.1%}  {format_bytes(step_bytes):>22}"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the memory plan and the synthetic decode trace; returns the exit status."""
    parser = argparse.ArgumentParser(prog="qsa-hisparse demo", description=__doc__.split("\n")[0])
    parser.add_argument("--context-len", type=int, default=262_144, help="tokens (262144)")
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests (8)")
    parser.add_argument("--steps", type=int, default=48, help="synthetic decode steps (48)")
    parser.add_argument("--noise", type=float, default=0.15, help="score noise per step (0.15)")
    parser.add_argument("--seed", type=int, default=20261129, help="random seed")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    profile = QWEN38_FLASH_NEXT
    tp_size = 2
    plan = plan_capacity(
        profile,
        tp_size=tp_size,
        kv_dtype=KVDType.FP8_E4M3,
        index_dtype=KVDType.BF16,
        gpu_budget_bytes=9 * _GIB,
        host_budget_bytes=12 * _GIB,
        context_len=args.context_len,
        num_requests=args.requests,
    )
    sys.stdout.write(render_plan(plan))
    sys.stdout.write("\n")

    num_blocks, selections = synthetic_selections(
        profile, args.context_len, args.steps, noise=args.noise, seed=args.seed
    )
    bytes_per_block = profile.bytes_per_block(KVDType.FP8_E4M3, tp_size)
    k = profile.block_topk
    traces = [
        trace_decode(selections, num_blocks, slots, bytes_per_block) for slots in (k, 2 * k, 4 * k)
    ]
    sys.stdout.write(render_traces(profile, tp_size, traces))
    return 0
