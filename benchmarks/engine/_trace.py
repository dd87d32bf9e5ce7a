"""Summarise a torch profiler trace of an engine's decode steps: where a step's time goes.

SGLang's ``/start_profile`` writes a Chrome trace (``*.trace.json.gz``) of the scheduler process:
Python function ranges (``with_stack``), torch operators, CUDA runtime calls and the GPU's kernels
and copies. :func:`summarize` reduces one to text a reader can compare across two engines:

- the step count (SGLang's ``run_batch`` calls) and the wall time per step;
- GPU busy time per step (kernels and copies), the rest of the step being host work the GPU waits
  for (no overlap scheduling here);
- the Python functions with the most inclusive time per step, and the kernels with the most GPU
  time per step.

Run it as a script on a trace: ``python _trace.py TRACE [--top N]``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ("summarize",)

_STEP = "run_batch"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # a built-in method's receiver: one name per method
_GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def _events(path: pathlib.Path) -> list[Mapping[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _busy_us(spans: Iterable[tuple[float, float]]) -> float:
    """Microseconds covered by the union of ``(start, end)`` spans."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _table(
    title: str, totals: Mapping[str, float], counts: Mapping[str, int], steps: int, top: int
) -> list[str]:
    lines = [f"{title} (us per step, calls per step):"]
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / steps:10.1f}  {counts[name] / steps:7.2f}  {name[:150]}")
    return lines


def summarize(path: pathlib.Path, *, top: int = 40) -> str:
    """The text summary of one trace (see the module docstring)."""
    events = _events(path)
    python = [e for e in events if e.get("cat") == "python_function"]
    steps = sum(1 for e in python if e["name"].endswith(f": {_STEP}")) or 1
    gpu = [e for e in events if e.get("cat") in _GPU_CATEGORIES]
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime")]
    start = min(float(e["ts"]) for e in host)
    stop = max(float(e["ts"]) + float(e["dur"]) for e in host)
    busy = _busy_us((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu)
    lines = [
        f"trace {path.name}: {steps} steps, host span {(stop - start) / 1e3:.2f} ms, "
        f"{(stop - start) / steps:.1f} us per step; GPU busy {busy / steps:.1f} us per step "
        f"({busy / (stop - start):.0%})",
        "",
    ]
    for title, chosen in (
        ("Python functions, inclusive", python),
        ("GPU kernels and copies", gpu),
        ("CUDA runtime calls", [e for e in events if e.get("cat") == "cuda_runtime"]),
    ):
        totals: dict[str, float] = collections.defaultdict(float)
        counts: collections.Counter[str] = collections.Counter()
        for e in chosen:
            name = _ADDRESS.sub("", e["name"])
            totals[name] += float(e["dur"])
            counts[name] += 1
        lines += [*_table(title, totals, counts, steps, top), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=pathlib.Path)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    print(summarize(args.trace, top=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
