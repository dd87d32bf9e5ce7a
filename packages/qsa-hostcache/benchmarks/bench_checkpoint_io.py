"""Benchmark of a checkpoint's trip through the shared tier: its write-through and its read-back.

Usage: ``python bench_checkpoint_io.py --out-dir DIR`` writes ``DIR/checkpoint_io.md`` and
``DIR/checkpoint_io.json``.

One :class:`qsa_hostcache.SharedCheckpoints` over a :class:`qsa_hostcache.DiskTier` in a new
directory (``--dir``, default the system's temporary one). For each checkpoint size
(``--sizes-mib``; 902 MiB is the 32K-token checkpoint of the full-depth dummy Qwen4Exp in
``docs/bench/engine_prefix_cache-store.md``), made of 48 bf16 segments as a prompt's are:
``--repeats`` times, a write of a new checkpoint (encode, digest, file) and a lookup of it
(file read, digest check, key check, segments), and meanwhile the longest time a second thread
of the process, waking every millisecond, waited (an engine's scheduler would wait as long: the
write-through runs on a thread of the scheduler's process, the lookup on the scheduler itself).

Reported per size, medians over the repeats: the write's and the lookup's seconds and MiB/s,
their longest waits, and two ceilings measured in the same run on the same bytes: one copy into
new memory (torch, the least a read into a new buffer costs) and one read of the object's file
into new memory (what any lookup reads). The lookup over the file read is the format's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
from _stall import timed

from qsa_hostcache import CacheNamespace, DiskAddress, DiskTier, PrefixKey, SharedCheckpoints

#: Segments of one checkpoint (a prompt's: K, V, index and states of its layers).
SEGMENTS = 48
PAGE = 64


def _checkpoint(size_mib: int, seed: int) -> dict[str, torch.Tensor]:
    """``size_mib`` MiB of bf16 in :data:`SEGMENTS` segments."""
    g = torch.Generator().manual_seed(seed)
    per = (size_mib << 20) // SEGMENTS // 2
    return {
        f"layer.{i}": torch.randint(0, 1 << 15, (per,), generator=g, dtype=torch.int16).view(
            torch.bfloat16
        )
        for i in range(SEGMENTS)
    }


def _read_file(path: pathlib.Path) -> int:
    """Read ``path`` into new memory; its bytes."""
    buffer = torch.empty(path.stat().st_size, dtype=torch.uint8)
    with path.open("rb", buffering=0) as file:
        return file.readinto(buffer.numpy().data) or 0


def run(sizes_mib: list[int], repeats: int, directory: pathlib.Path) -> list[dict[str, Any]]:
    """Measure every size; one row each."""
    ns = CacheNamespace("bench/checkpoint-io", "bfloat16", 1, 0, "c")
    rows = []
    tier = DiskTier(DiskAddress(directory, max_mb=1 << 20))
    shared = SharedCheckpoints(tier, scope="bench")
    for size in sizes_mib:
        tokens = 512 * PAGE
        samples: dict[str, list[float]] = {
            k: [] for k in ("write", "write_wait", "lookup", "lookup_wait", "copy", "file")
        }
        for repeat in range(repeats):
            segments = _checkpoint(size, seed=repeat)
            key = PrefixKey(ns, [size, repeat, *range(tokens - 2)], page_size=PAGE)
            seconds, wait, stored = timed(lambda: shared.write(key, segments))  # noqa: B023
            if not stored:
                raise SystemExit(f"the {size} MiB checkpoint was not stored")
            samples["write"].append(seconds)
            samples["write_wait"].append(wait)
            seconds, wait, found = timed(lambda: shared.lookup(key))  # noqa: B023
            if found is None or found.num_tokens != tokens:
                raise SystemExit(f"the {size} MiB checkpoint did not read back")
            samples["lookup"].append(seconds)
            samples["lookup_wait"].append(wait)
            del found
            flat = torch.cat([t.view(torch.uint8) for t in segments.values()])
            began = time.perf_counter()
            torch.empty_like(flat).copy_(flat)
            samples["copy"].append(time.perf_counter() - began)
            path = max(directory.rglob("*.qsa"), key=lambda p: p.stat().st_mtime_ns)
            began = time.perf_counter()
            _read_file(path)
            samples["file"].append(time.perf_counter() - began)
            for stale in directory.rglob("*.qsa"):
                stale.unlink()
        med = {k: statistics.median(v) for k, v in samples.items()}
        rows.append(
            {
                "checkpoint_mib": size,
                "repeats": repeats,
                "write_s": med["write"],
                "write_mib_s": size / med["write"],
                "write_longest_wait_ms": med["write_wait"] * 1e3,
                "lookup_s": med["lookup"],
                "lookup_mib_s": size / med["lookup"],
                "lookup_longest_wait_ms": med["lookup_wait"] * 1e3,
                "copy_mib_s": size / med["copy"],
                "file_read_mib_s": size / med["file"],
                "lookup_over_file_read": med["lookup"] / med["file"],
                "samples_s": samples,
            }
        )
        print({k: v for k, v in rows[-1].items() if k != "samples_s"}, flush=True)
    tier.close()
    return rows


def main() -> None:
    """Measure, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--sizes-mib", default="64,256,902")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=pathlib.Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        rows = run(
            [int(s) for s in args.sizes_mib.split(",")], args.repeats, pathlib.Path(directory)
        )
    machine = {
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "checkpoint_io.json").write_text(
        json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n", encoding="utf-8"
    )
    lines = [
        "# A checkpoint through the shared tier: write-through and read-back, against the copy",
        "",
        f"Host: {machine['host']}, torch {machine['torch']}; a `DiskTier` in a temporary "
        f"directory; {SEGMENTS} bf16 segments a checkpoint; medians of {args.repeats} repeats. "
        "`packages/qsa-hostcache/benchmarks/bench_checkpoint_io.py`. Longest wait: the longest "
        "a second thread of the process, waking every millisecond, waited during the call. "
        "Ceilings, same run and bytes: one torch copy into new memory, one read of the "
        "object's file into new memory.",
        "",
        "| checkpoint MiB | write s | write MiB/s | write: longest wait ms | lookup s | "
        "lookup MiB/s | lookup: longest wait ms | copy MiB/s | file read MiB/s | "
        "lookup / file read |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['checkpoint_mib']:,} | {r['write_s']:.3f} | {r['write_mib_s']:,.0f} | "
            f"{r['write_longest_wait_ms']:.0f} | {r['lookup_s']:.3f} | "
            f"{r['lookup_mib_s']:,.0f} | {r['lookup_longest_wait_ms']:.0f} | "
            f"{r['copy_mib_s']:,.0f} | {r['file_read_mib_s']:,.0f} | "
            f"{r['lookup_over_file_read']:.2f} |"
        )
    (args.out_dir / "checkpoint_io.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
