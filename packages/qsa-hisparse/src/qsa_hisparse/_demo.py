"""``qsa-hisparse demo``: the offload plan and the hot-cache contract on a synthetic decode, on CPU.

Part 1 prints the per-rank memory plan of Qwen3.8-Flash-Next at TP2 with FP8 K/V, with and without
host offload (``qsa_core.plan_capacity``). Part 2 drives the hot-cache residency contract that the
GPU fetch kernel implements (``qsa_core.plan_residency_step``) through a synthetic decode of one
262,144-token request, and reports how many selected blocks miss per step for several hot-cache
sizes: the bytes each step must bring over PCIe. Part 3 runs the host prefix cache
(``qsa_hostcache``) on a synthetic multi-turn chat and on two image prompts that share every token
id but not the image (``qsa_mm_prefix``): cached tokens per turn, and no false hit. No GPU, no model
and no SGLang are needed.

The synthetic selection is labelled as such: each block has a fixed importance, each step adds
noise, and the top 512 by score are selected together with the attention-sink blocks and the most
recent blocks. Blocks near the selection boundary drift in and out, which is what a hot cache larger
than the selection absorbs.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qsa_core import (
    MAX_SEQ_LEN,
    QWEN38_FLASH_NEXT,
    CapacityError,
    HotCacheState,
    KVDType,
    QSAProfile,
    format_bytes,
    plan_capacity,
    plan_residency_step,
    render_plan,
)
from qsa_core.cli import int_in

if TYPE_CHECKING:  # torch and the caches load after the arguments are checked
    import torch

_GIB = 1 << 30

#: Bounds of the demo's arguments: a context the kernels address, and a step count and request
#: count that finish in well under a minute (a synthetic step costs about 12 ms on one core).
MAX_DEMO_STEPS = 1_000
MAX_DEMO_REQUESTS = 4_096
MAX_DEMO_NOISE = 100.0


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


def _checkpoint(profile: QSAProfile, tokens: int, tp_size: int) -> dict[str, torch.Tensor]:
    """Stand-in segments of one rank's checkpoint at ``tokens`` (real sizes, filler bytes)."""
    import torch

    raw_kv = profile.raw_kv_bytes_per_token(KVDType.FP8_E4M3, tp_size) * tokens
    index = profile.index_bytes_per_token(KVDType.BF16) * tokens
    fill = tokens % 251
    return {
        "raw_kv": torch.full((raw_kv,), fill, dtype=torch.uint8),
        "index_k": torch.full((index,), fill, dtype=torch.uint8),
        "gdn_state": torch.full((1 << 16,), fill, dtype=torch.uint8),
    }


def prefix_cache_demo(profile: QSAProfile, *, turns: int, turn_tokens: int, seed: int) -> str:
    """A multi-turn chat and two image prompts through the host prefix cache; returns a report."""
    from qsa_hostcache import CacheNamespace, HostPrefixCache, PrefixKey
    from qsa_mm_prefix import (
        ContentKind,
        Modality,
        MultimodalItem,
        ProcessorFingerprint,
        build_prompt_identity,
    )

    rng = random.Random(seed)
    tp_size = 2
    page = profile.page_size
    namespace = CacheNamespace(
        model="Qwen3.8-Flash-Next",
        dtype="float8_e4m3fn",
        tp_size=tp_size,
        tp_rank=0,
        config_digest="demo",
    )
    cache = HostPrefixCache(256 << 20, max_entries=64, page_size=page, block_bytes=1 << 20)
    lines = [
        "Host prefix cache (one TP rank, 256 MiB arena, "
        f"{'pinned' if cache.pinned else 'pageable: no CUDA here'}):",
        "",
        "  turn  prompt tokens  cached tokens  prefilled  checkpoint published",
        "  ----  -------------  -------------  ---------  --------------------",
    ]
    history: list[int] = []
    for turn in range(1, turns + 1):
        history += [rng.randrange(248_000) for _ in range(turn_tokens + rng.randrange(page))]
        key = PrefixKey(namespace, history, page_size=page)
        match = cache.match(key, max_tokens=len(history) - 1)
        cached = match.num_tokens if match is not None else 0
        full_pages = len(history) // page
        ticket = cache.publish(key.prefix(full_pages), _checkpoint(profile, full_pages * page, 2))
        lines.append(
            f"  {turn:>4}  {len(history):>13,}  {cached:>13,}  {len(history) - cached:>9,}"
            f"  {'yes' if ticket is not None else 'no room'}"
        )

    # Two users, one image-sized placeholder run each: the same token ids, different pictures.
    processor = ProcessorFingerprint.create("qwen-vl-image", "1", {"min_pixels": 3136})
    placeholder = [248_056] * 256
    text = [rng.randrange(248_000) for _ in range(2 * page)]
    tokens = text + placeholder + text[:100]
    outcomes = []
    for user, picture in (
        ("alice", b"\x01" * 4096),
        ("bob", b"\x02" * 4096),
        ("carol", b"\x01" * 4096),
    ):
        item = MultimodalItem(
            modality=Modality.IMAGE,
            start=len(text),
            length=len(placeholder),
            content=picture,
            content_kind=ContentKind.ENCODED,
            grid=(1, 32, 32),
        )
        identity = build_prompt_identity(len(tokens), [item], processor=processor, page_size=page)
        key = PrefixKey(namespace, tokens, page_size=page, page_extras=identity.page_extras)
        match = cache.match(key, max_tokens=len(tokens) - 1)
        outcomes.append((user, match.num_tokens if match is not None else 0))
        cache.publish(
            key.prefix(len(tokens) // page), _checkpoint(profile, len(tokens) // page * page, 2)
        )
    lines += [
        "",
        "  image prompts with identical token ids (alice and carol send the same picture):",
    ]
    lines += [f"    {user:<6} cached tokens {cached:>5,}" for user, cached in outcomes]
    stats = cache.stats()
    lines += [
        "",
        f"  lookups {stats.lookups}, hits {stats.hits}, hit tokens {stats.hit_tokens:,}, "
        f"bytes in {format_bytes(stats.bytes_in)}, evictions {stats.evictions}",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the memory plan and the synthetic decode trace; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="qsa-hisparse demo",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    profile = QWEN38_FLASH_NEXT
    smallest = profile.compress_ratio * profile.block_topk  # one full block selection
    parser.add_argument(
        "--context-len",
        type=int_in(smallest, MAX_SEQ_LEN),
        default=262_144,
        help="tokens per request",
    )
    parser.add_argument(
        "--requests", type=int_in(1, MAX_DEMO_REQUESTS), default=8, help="concurrent requests"
    )
    parser.add_argument(
        "--steps", type=int_in(1, MAX_DEMO_STEPS), default=48, help="synthetic decode steps"
    )
    parser.add_argument("--noise", type=float, default=0.15, help="score noise per step")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 1), default=20261129, help="random seed")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not (math.isfinite(args.noise) and 0.0 <= args.noise <= MAX_DEMO_NOISE):
        parser.error(
            f"--noise {args.noise!r} is not allowed; allowed: a number from 0 to {MAX_DEMO_NOISE}"
        )

    tp_size = 2
    try:
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
    except CapacityError as exc:
        parser.error(str(exc))
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
    sys.stdout.write("\n")
    sys.stdout.write(prefix_cache_demo(profile, turns=4, turn_tokens=1500, seed=args.seed))
    return 0
