"""Benchmark of the shared tier over a real Mooncake Store: what a put or get costs the process.

Usage: ``python bench_shared_tier.py --out-dir DIR`` (Mooncake installed:
``pip install 'qsa-hostcache[mooncake]'``, ``mooncake_master`` on ``PATH``) writes
``DIR/shared_tier.md`` and ``DIR/shared_tier.json``.

A ``mooncake_master`` on a free localhost port and one :class:`qsa_hostcache.MooncakeTier`
(TCP transport, ``--segment-mb`` lent to the store). For each object size (``--sizes-mib``) and
part size (``--parts-mib``): the put's and the get's seconds and MiB/s, and the longest time a
second thread of the same process, waking every millisecond, waited meanwhile. That thread stands
for an engine's scheduler: a store call that holds the GIL stalls it. One object of each size is
written and read once per part size (a checkpoint is written once and read by other servers).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import tempfile
from functools import partial
from typing import Any

from _stall import timed

from qsa_hostcache import MooncakeAddress, MooncakeTier
from qsa_pytest.mooncake import MooncakeMaster


def run(sizes_mib: list[int], parts_mib: list[int], segment_mb: int) -> list[dict[str, Any]]:
    """Measure every (object size, part size) pair; one row each."""
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        master = MooncakeMaster(pathlib.Path(directory) / "master.log", segment_mb=segment_mb)
        try:
            for part in parts_mib:
                tier = MooncakeTier(
                    MooncakeAddress.parse(master.address()), part_mb=part, local_buffer_mb=4 * part
                )
                if not tier.wait_connected(60.0):
                    msg = f"the store client did not join the master at {master.address()}"
                    raise SystemExit(msg)
                try:
                    for size in sizes_mib:
                        value = os.urandom(size << 20)
                        key = f"bench-{size}-{part}"
                        put_s, put_wait, stored = timed(partial(tier.put, key, value))
                        get_s, get_wait, read = timed(partial(tier.get, key))
                        if not stored or read != value:
                            msg = f"{size} MiB in parts of {part} MiB did not read back whole"
                            raise SystemExit(msg)
                        rows.append(
                            {
                                "object_mib": size,
                                "part_mib": part,
                                "put_s": put_s,
                                "put_mib_s": size / put_s,
                                "put_longest_wait_ms": put_wait * 1e3,
                                "get_s": get_s,
                                "get_mib_s": size / get_s,
                                "get_longest_wait_ms": get_wait * 1e3,
                            }
                        )
                        print(rows[-1], flush=True)
                finally:
                    tier.close()
        finally:
            master.kill()
    return rows


def main() -> None:
    """Measure and write ``shared_tier.md`` and ``.json`` under ``--out-dir``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="16,100,400")
    parser.add_argument("--parts-mib", default="4,8,16")
    parser.add_argument("--segment-mb", type=int, default=2048)
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("."))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    parts = [int(p) for p in args.parts_mib.split(",")]
    rows = run(sizes, parts, args.segment_mb)
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "shared_tier.json").write_text(json.dumps({"host": host, "rows": rows}))
    lines = [
        "# The shared tier over a real Mooncake Store: a put's and a get's cost to the process",
        "",
        f"Host: {host}; one `mooncake_master` on localhost, TCP transport. "
        '`packages/qsa-hostcache/benchmarks/bench_shared_tier.py`. "Longest wait" is the '
        "longest a second thread of the process, waking every millisecond, waited during the "
        "call (a scheduler's thread would wait as long).",
        "",
        "| object (MiB) | part (MiB) | put (s) | put MiB/s | put: longest wait (ms) | get (s) "
        "| get MiB/s | get: longest wait (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['object_mib']} | {r['part_mib']} | {r['put_s']:.2f} | {r['put_mib_s']:,.0f} "
        f"| {r['put_longest_wait_ms']:.0f} | {r['get_s']:.2f} | {r['get_mib_s']:,.0f} "
        f"| {r['get_longest_wait_ms']:.0f} |"
        for r in rows
    ]
    (args.out_dir / "shared_tier.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
