"""Benchmarks of qsa-hostcache: match latency (CPU) and publish/restore bandwidth (GPU).

Usage: ``python bench_hostcache.py --out-dir DIR`` writes ``DIR/hostcache.md`` and
``DIR/hostcache.json``.

* Match: a 262,144-token query (4,096 pages of 64) against 256 cached checkpoints: 64 true prefixes
  of the query at spread lengths, 64 with the same tokens in another namespace, 64 that differ from
  the query in one token of their last page, 64 unrelated. Reported: the median and p90 of a cold
  match (fresh key: hashing + lookup + full verification), a warm match (page hashes memoized on
  the key), a miss, and building the key from a list and from a tensor.
* Bandwidth (CUDA only), at each ``--tokens`` length: a QSA-shaped checkpoint (raw K/V, index,
  ring, rope, GDN and conv state, PLE state) published from GPU tensors into the arena and
  restored into GPU tensors, against one contiguous pinned copy of the same bytes in the same
  run. Reported as a ratio of bandwidths.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import pathlib
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

from qsa_hostcache import CacheNamespace, HostPrefixCache, PrefixKey

PAGE = 64
QUERY_TOKENS = 262_144
ENTRIES = 256
MATCH_TARGET_MS = 1.0
BANDWIDTH_TARGET = 0.80
RESTORE_GOAL = 0.90
NS = CacheNamespace("Qwen3.8-Flash-Next@bench", "float8_e4m3fn", 2, 0, "cfg-bench")
OTHER_NS = CacheNamespace("Qwen3.8-Flash-Next@bench", "float8_e4m3fn", 2, 0, "cfg-bench", "t2")


def _times_ms(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "min_ms": ordered[0],
    }


def bench_match(repeat: int) -> dict[str, object]:
    rng = random.Random(0)
    query_ids = [rng.randrange(150_000) for _ in range(QUERY_TOKENS)]
    query_raw = array.array("q", query_ids)
    pages = QUERY_TOKENS // PAGE
    cache = HostPrefixCache(
        ENTRIES * 4096 * 2, max_entries=ENTRIES, block_bytes=4096, pin_memory=False
    )
    seg = {"state": torch.zeros(1024, dtype=torch.uint8)}
    lengths = sorted({max(1, round(pages * (i + 1) / 64)) for i in range(64)})
    published = 0
    for n in lengths:  # true prefixes, up to the whole query
        published += cache.publish(PrefixKey(NS, query_raw[: n * PAGE]), seg) is not None
    for _ in range(64):  # same tokens, another namespace
        n = rng.randrange(1, pages + 1)
        published += cache.publish(PrefixKey(OTHER_NS, query_raw[: n * PAGE]), seg) is not None
    for _ in range(64):  # one token changed in the last page
        n = rng.randrange(1, pages + 1)
        ids = query_raw[: n * PAGE]
        ids[-1 - rng.randrange(PAGE)] += 1
        published += cache.publish(PrefixKey(NS, ids), seg) is not None
    for _ in range(ENTRIES - published):  # unrelated prompts
        n = rng.randrange(1, pages + 1)
        ids = array.array("q", (rng.randrange(150_000) for _ in range(n * PAGE)))
        published += cache.publish(PrefixKey(NS, ids), seg) is not None
    assert cache.stats().ready_entries == ENTRIES, cache.stats()

    expect = PrefixKey(NS, query_raw)
    m = cache.match(expect)
    assert m is not None
    assert m.num_tokens == QUERY_TOKENS

    _times_ms(lambda: cache.match(PrefixKey(NS, query_raw)), 3)  # warm-up
    keys = [PrefixKey(NS, query_raw) for _ in range(repeat)]
    it = iter(keys)
    cold = _times_ms(lambda: cache.match(next(it)), repeat)
    warm = _times_ms(lambda: cache.match(expect), repeat)
    miss_raw = array.array("q", (rng.randrange(150_000) for _ in range(QUERY_TOKENS)))
    miss_keys = iter([PrefixKey(NS, miss_raw) for _ in range(repeat)])
    miss = _times_ms(lambda: cache.match(next(miss_keys)), repeat)
    tensor_ids = torch.tensor(query_ids, dtype=torch.int32)
    key_list = _times_ms(lambda: PrefixKey(NS, query_ids), max(5, repeat // 10))
    key_tensor = _times_ms(lambda: PrefixKey(NS, tensor_ids), repeat)
    key_array = _times_ms(lambda: PrefixKey(NS, query_raw), repeat)
    result: dict[str, object] = {
        "query_tokens": QUERY_TOKENS,
        "query_pages": pages,
        "entries": ENTRIES,
        "repeat": repeat,
        "cold_match": _summary(cold),
        "warm_match": _summary(warm),
        "miss": _summary(miss),
        "key_from_list": _summary(key_list),
        "key_from_int32_tensor": _summary(key_tensor),
        "key_from_int64_array": _summary(key_array),
        "target_ms": MATCH_TARGET_MS,
    }
    result["meets_target"] = _summary(cold)["median_ms"] < MATCH_TARGET_MS
    return result


def _qsa_checkpoint(tokens: int, device: str) -> dict[str, torch.Tensor]:
    """Segments of one TP2 rank's checkpoint of Qwen3.8-Flash-Next at ``tokens`` tokens."""
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    return {
        # 12 QSA layers x (K, V) x tokens x 1 KV head x 256 dims, fp8
        "raw_kv": rnd(12, 2, tokens, 256, dtype=torch.float8_e4m3fn),
        # compressed index: 12 layers x tokens/4 blocks x 128, bf16
        "index": rnd(12, tokens // 4, 128, dtype=torch.bfloat16),
        "ring": rnd(12, 4, 128, dtype=torch.bfloat16),
        "rope": torch.arange(4, device=device, dtype=torch.int64),
        # 36 GDN layers x 8 heads x 128 x 128 fp32 recurrent state, and conv state
        "gdn_state": rnd(36, 8, 128, 128, dtype=torch.float32),
        "conv_state": rnd(36, 4, 4096, dtype=torch.bfloat16),
        "ple_state": rnd(16, 1024, dtype=torch.bfloat16),
    }


def bench_bandwidth(tokens: int, repeat: int) -> dict[str, object]:
    segs = _qsa_checkpoint(tokens, "cuda")
    total = sum(t.numel() * t.element_size() for t in segs.values())
    cache = HostPrefixCache(4 * total + (64 << 20), block_bytes=1 << 20, max_entries=64)
    assert cache.pinned
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)

    def timed(fn: Callable[[], object]) -> list[float]:
        out = []
        for _ in range(repeat):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
        return out

    def base_d2h() -> None:
        pinned.copy_(flat, non_blocking=True)

    def base_h2d() -> None:
        flat.copy_(pinned, non_blocking=True)

    counter = iter(range(10**9))

    def publish() -> None:
        first = next(counter) * PAGE
        ticket = cache.publish(PrefixKey(NS, list(range(first, first + PAGE))), segs)
        assert ticket is not None
        assert ticket.wait()

    publish()
    lease = cache.acquire(PrefixKey(NS, list(range(64))))
    assert lease is not None
    targets = {n: torch.empty_like(t) for n, t in segs.items()}

    def restore() -> None:
        cache.restore(lease, targets).synchronize()

    for fn in (base_d2h, base_h2d, restore):
        fn()
    d2h = statistics.median(timed(base_d2h))
    h2d = statistics.median(timed(base_h2d))
    pub = statistics.median(timed(publish))
    res = statistics.median(timed(restore))
    lease.release()
    for name, src in segs.items():
        assert torch.equal(
            targets[name].reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        ), name
    gb = total / 1e9
    return {
        "tokens": tokens,
        "checkpoint_bytes": total,
        "segments": {n: t.numel() * t.element_size() for n, t in segs.items()},
        "contiguous_d2h_GBps": gb / d2h,
        "publish_GBps": gb / pub,
        "publish_ratio": d2h / pub,
        "contiguous_h2d_GBps": gb / h2d,
        "restore_GBps": gb / res,
        "restore_ratio": h2d / res,
        "target_ratio": BANDWIDTH_TARGET,
        "evictions": cache.stats().evictions,
    }


def render(result: dict[str, object]) -> str:
    m = result["match"]
    assert isinstance(m, dict)
    lines = [
        "# qsa-hostcache benchmarks",
        "",
        f"Machine: {result['machine']}; torch {result['torch']}; CUDA: {result['cuda']}.",
        "",
        "## Match latency",
        "",
        f"Query of {m['query_tokens']:,} tokens ({m['query_pages']:,} pages of {PAGE}) against "
        f"{m['entries']} checkpoints (64 true prefixes, 64 in another namespace, 64 with one "
        f"token changed in the last page, 64 unrelated); {m['repeat']} runs each. Target: a "
        f"cold match under {MATCH_TARGET_MS} ms.",
        "",
        "| case | median ms | p90 ms | min ms |",
        "| --- | ---: | ---: | ---: |",
    ]
    labels = {
        "cold_match": "cold match (fresh key: hash 4,096 pages, look up, verify)",
        "warm_match": "warm match (page hashes memoized on the key)",
        "miss": "miss (unrelated query, fresh key)",
        "key_from_int64_array": "build key from an int64 array",
        "key_from_int32_tensor": "build key from an int32 CPU tensor",
        "key_from_list": "build key from a list of ints",
    }
    for name, label in labels.items():
        s = m[name]
        lines.append(f"| {label} | {s['median_ms']:.3f} | {s['p90_ms']:.3f} | {s['min_ms']:.3f} |")
    verdict = "meets" if m["meets_target"] else "misses"
    lines += ["", f"The cold match {verdict} the {MATCH_TARGET_MS} ms target.", ""]
    lines += ["## Publish and restore bandwidth", ""]
    rows = result.get("bandwidth")
    if not isinstance(rows, list):
        lines.append(f"Skipped: {result.get('bandwidth_note')}")
    else:
        lines += [
            "One TP2-rank checkpoint per row, in 7 segments, between GPU tensors and the pinned "
            "arena, against one contiguous pinned copy of the same bytes in the same run (medians; "
            f"target ratio >= {BANDWIDTH_TARGET}; the prefix-cache issue asks >= "
            f"{RESTORE_GOAL} for restore at long contexts).",
            "",
            "| tokens | bytes | direction | contiguous GB/s | cache GB/s | ratio |",
            "| ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for bw in rows:
            head = f"| {bw['tokens']:,} | {bw['checkpoint_bytes']:,}"
            lines += [
                f"{head} | publish (GPU -> arena) | {bw['contiguous_d2h_GBps']:.1f} | "
                f"{bw['publish_GBps']:.1f} | {bw['publish_ratio']:.2f} |",
                f"{head} | restore (arena -> GPU) | {bw['contiguous_h2d_GBps']:.1f} | "
                f"{bw['restore_GBps']:.1f} | {bw['restore_ratio']:.2f} |",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, required=True)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument(
        "--tokens", default="16384,131072", help="checkpoint lengths, comma-separated (GPU part)"
    )
    args = parser.parse_args()
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        lengths = []
    if not lengths or any(t < PAGE * 4 or t % PAGE for t in lengths):
        parser.error(
            f"--tokens {args.tokens!r} is not allowed; allowed: comma-separated multiples of "
            f"{PAGE} of at least {PAGE * 4}"
        )
    result: dict[str, object] = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, "
        f"{len(os.sched_getaffinity(0))} cores",
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "match": bench_match(args.repeat),
    }
    if torch.cuda.is_available():
        result["bandwidth"] = [bench_bandwidth(t, max(5, args.repeat // 10)) for t in lengths]
    else:
        result["bandwidth_note"] = (
            "no CUDA device on this machine (torch.cuda.is_available() is False); run this "
            "script on the GPU machine for the publish/restore bandwidth part"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "hostcache.json").write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    (args.out_dir / "hostcache.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
