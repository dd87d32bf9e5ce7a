"""Host time of planning one offloaded decode step: the rows, their lengths, the plan's buffers.

Without overlap scheduling (which the offload requires), SGLang's GPU waits while the scheduler
plans the next step, so every microsecond of host work per step is a microsecond of step time.
The H100 profile of DS-Offload at 32K, batch 1 (``engine_ds_offload.md``) put the offload
runtime's ``plan_decode`` at about 1 ms of a profiled step, most of it
:meth:`StepPlan.load <qsa_kernels.offload._plan.StepPlan.load>` filling the plan's pinned host
buffer with about thirty small torch operations.

This times :meth:`RowPlanner.check_advance` and :meth:`RowPlanner.advance` (the planner's part
of ``plan_decode``) for ``B`` active rows, padded to a captured batch, on this machine's CPU with
a CPU device (the host work is the same; the buffer's copy to a GPU is not timed). Reported: the
median microseconds per step over ``--steps`` steps after a warm-up, per batch, with and without
a shard group of 2 (the plan then localizes each closing block).

Writes ``<out-dir>/step_planning.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

import _report
import torch

if TYPE_CHECKING:
    from qsa_kernels.offload._plan import RowPlanner

_ROWS, _MAX_TOKENS, _CONTEXT, _WARM_UP = 64, 1 << 20, 32_768, 20


def _planner(batch: int, sharded: bool) -> RowPlanner:
    """A CPU planner with ``batch`` rows admitted; with ``sharded``, rank 0 of a group of 2.

    The planner reads only a shard group's placement and rank (planning never communicates), so
    a namespace of the two stands in for a group that would need a second process.
    """
    from qsa_core import ShardPlacement
    from qsa_kernels.offload._plan import RowPlanner

    shard = SimpleNamespace(placement=ShardPlacement(2, 16, 4), rank=0) if sharded else None
    planner = RowPlanner(_ROWS, _MAX_TOKENS, torch.device("cpu"), shard)  # type: ignore[arg-type]
    for row in range(batch):
        planner.admit(row, _CONTEXT + row)
    return planner


def _time(batch: int, pad_to: int, steps: int, *, sharded: bool) -> float:
    """Median host microseconds of one step's ``check_advance`` and ``advance``."""
    planner = _planner(batch, sharded)
    rows = list(range(batch))
    times = []
    for step in range(_WARM_UP + steps):
        t0 = time.perf_counter()
        planner.advance(planner.check_advance(rows, pad_to=pad_to))
        if step >= _WARM_UP:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Time every (batch, sharding) pair, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--label", default="", help="a name for this tree in the report")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        pad_to = 1 << (batch - 1).bit_length()  # a captured batch size at or above it
        for sharded in (False, True):
            us = _time(batch, pad_to, args.steps, sharded=sharded)
            rows.append({"batch": batch, "pad_to": pad_to, "sharded": sharded, "us": us})
            print(f"bench_step_planning: {rows[-1]}", flush=True)
    machine = _report.machine()
    lines = [
        "# Host time of planning one offloaded decode step",
        "",
        f"{machine['device']}, torch {machine['torch']}, one torch thread; "
        f"{args.label + '; ' if args.label else ''}`RowPlanner.check_advance` and `advance` "
        f"over B rows of {_CONTEXT:,}-token prompts, padded to a captured batch; median of "
        f"{args.steps:,} steps. `packages/qsa-kernels/benchmarks/bench_step_planning.py`.",
        "",
        "| batch | padded to | shard group | us per step |",
        "| ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        shard = "2 ranks" if r["sharded"] else "none"
        lines.append(f"| {r['batch']} | {r['pad_to']} | {shard} | {r['us']:.1f} |")
    data = {"machine": machine, "args": vars(args) | {"out_dir": None}, "rows": rows}
    _report.write(args.out_dir, "step_planning", data, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
