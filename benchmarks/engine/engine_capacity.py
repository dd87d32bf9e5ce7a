"""The most concurrent long requests one GPU memory budget serves: p2-offload against resident.

Two real SGLang 0.5.23 engines serve the model-shaped tiny Qwen4Exp of ``engine_offload.py`` (the
real QSA layer geometry) with the same scheduler flags and the same GPU memory budget: SGLang's
``--mem-fraction-static`` set to ``--gpu-budget-gib`` over the GPU's memory, so SGLang's own
profiler sizes each engine's pools from the same bytes. Each engine runs **alone** on the GPU (a
second engine would see the first one's memory as used and size a smaller pool): resident (no
plugin) first, then offload (``p2-offload``), each closed before the next starts.

Both are sent ``--requests`` prompts of ``--context`` tokens at once (``--max-running-requests``
is that count on both; it is also the offload's host-arena rows). Reported per engine:

- the pool SGLang sized (``max_total_num_tokens``) and how many requests of that length it holds;
- **the most requests SGLang decoded together** (the largest ``#running-req`` of its ``Decode
  batch`` log lines while they ran): the measured concurrency. The resident engine admits what
  its pool holds and queues the rest; the offload engine is priced at the compressed index per
  token, so its concurrency is bounded by the host-arena rows given, not by the GPU.

Writes ``<out>/engine_capacity.md`` and ``.json`` after each engine. Needs CUDA: ``nox -s
gpu-engine-bench -- capacity`` runs it on the GPU machine; exits with status 77 without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys
import tempfile
import time
from typing import Any

from _engine_bench import (
    SKIPPED,
    Served,
    lacks_cuda,
    mem_fraction,
    pool_tokens,
    send_together,
    write_json,
)
from engine_offload import engine_configs, tokens_while_all_decode

_ARENA = re.compile(r"offload: host arena ([^;]+);")
#: The order the engines run in; the report's rows.
_ARMS = ("resident", "offload")


@dataclasses.dataclass(frozen=True)
class Capacity:
    """One engine's answer to ``requests`` long prompts sent at once.

    Attributes:
        arm: ``resident`` or ``offload``.
        pool_tokens: SGLang's ``max_total_num_tokens`` at the budget.
        pool_requests: requests of ``context + new tokens`` that pool holds.
        decoded_together: the most requests SGLang decoded in one step (measured).
        decode_tokens_per_s: SGLang's ``gen throughput`` at its last line with that many running.
        wall_s: from sending the first request to the last reply.
        start_s: the engine's start-up, until ``/health`` answered.
        host_arena: the offload's start-up line on its host arena ("" for resident).
    """

    arm: str
    pool_tokens: int
    pool_requests: int
    decoded_together: int
    decode_tokens_per_s: float
    wall_s: float
    start_s: float
    host_arena: str


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=262144, help="prompt tokens per request")
    parser.add_argument(
        "--gpu-budget-gib",
        type=float,
        default=14.0,
        help="GPU memory each engine may hold, GiB (14: two resident 256K requests at 12 layers)",
    )
    parser.add_argument(
        "--requests", type=int, default=10, help="sent at once; also --max-running-requests"
    )
    parser.add_argument(
        "--new-tokens", type=int, default=40, help="greedy steps all requests decode together"
    )
    parser.add_argument("--qsa-layers", type=int, default=12, help="QSA layers of the model")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    for name in ("context", "requests", "new_tokens"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} {getattr(args, name)!r} is not allowed; allowed: >= 1")
    if not args.gpu_budget_gib > 0:
        parser.error(f"--gpu-budget-gib {args.gpu_budget_gib!r} is not allowed; allowed: > 0")
    return args


def _capacity(engine: Any, arm: str, served: Served, tokens: int, context: int) -> Capacity:
    pool = pool_tokens(engine)
    together = served.most_running
    rates = [rate for n, rate in served.decode_lines if n == together]
    arena = _ARENA.findall(engine.log_path.read_text(encoding="utf-8", errors="replace"))
    return Capacity(
        arm=arm,
        pool_tokens=pool,
        pool_requests=pool // (context + tokens),
        decoded_together=together,
        decode_tokens_per_s=rates[-1] if rates else 0.0,
        wall_s=served.wall_s,
        start_s=float(engine.start_seconds),
        host_arena=arena[-1] if arena else "",  # the offload logs one; resident none
    )


def _write(
    out: pathlib.Path, args: argparse.Namespace, fraction: float, rows: list[Capacity]
) -> None:
    data = write_json(
        out,
        "engine_capacity",
        {
            "context": args.context,
            "gpu_budget_gib": args.gpu_budget_gib,
            "mem_fraction_static": fraction,
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "engines": [dataclasses.asdict(r) for r in rows],
        },
    )
    lines = [
        "# The most concurrent long requests at one GPU memory budget, real SGLang 0.5.23 engines",
        "",
        f"GPU {data['machine']['gpu']}, torch {data['machine']['torch']}; the model-shaped tiny "
        f"Qwen4Exp ({args.qsa_layers} QSA layers of the real geometry), decode CUDA graphs on. "
        f"Each engine alone on the GPU with **{args.gpu_budget_gib:g} GiB** "
        f"(`--mem-fraction-static {fraction}`), sent **{args.requests} requests of "
        f"{args.context:,} tokens** at once (`--max-running-requests {args.requests}`, the "
        f"offload's host-arena rows). `{data['command']}`; written by "
        "`benchmarks/engine/engine_capacity.py`.",
        "",
        "| engine | pool tokens | requests the pool holds | decoded together (measured) "
        "| decode tok/s then | wall s | host arena |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    lines += [
        f"| {r.arm} | {r.pool_tokens:,} | {r.pool_requests} | **{r.decoded_together}** "
        f"| {r.decode_tokens_per_s:,.1f} | {r.wall_s:.0f} | {r.host_arena} |"
        for r in rows
    ]
    by_arm = {r.arm: r for r in rows}
    if len(by_arm) == len(_ARMS) and by_arm["resident"].decoded_together > 0:
        resident, offload = by_arm["resident"], by_arm["offload"]
        ratio = offload.decoded_together / resident.decoded_together
        bound = (
            "the host-arena rows given (every request sent), not the GPU"
            if offload.decoded_together == args.requests
            else "below the requests sent: see the engine's log"
        )
        lines += [
            "",
            f"Offloaded / resident: **{ratio:.1f}x** the concurrent {args.context:,}-token "
            f"requests at the same GPU budget. The offload's count is bounded by {bound}; its "
            f"pool alone would hold {offload.pool_requests} such requests.",
        ]
    (out / "engine_capacity.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    """Start each engine alone at the budget, send the requests, write the report."""
    args = _parse_args(argv)
    if lacks_cuda("engine_capacity"):
        return SKIPPED
    from qsa_testing import running_engine, tiny_qwen4_exp

    fraction = mem_fraction(args.gpu_budget_gib)
    tokens = tokens_while_all_decode(args.new_tokens, args.context, args.requests)
    longest = args.context + tokens + 64
    model = tiny_qwen4_exp(
        model_shaped=True, qsa_layers=args.qsa_layers, max_position_embeddings=longest
    )
    configs = engine_configs(
        model,
        context_length=longest,
        max_running_requests=args.requests,
        # SGLang sizes the pool from the budget alone (the harness's default token cap is off).
        pool={"mem_fraction_static": fraction, "max_total_tokens": None},
    )
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="qsa-engine-capacity-"))
    rows: list[Capacity] = []
    for arm in _ARMS:
        started = time.monotonic()
        with running_engine(configs[arm], workdir / arm, timeout=900.0) as engine:
            print(
                f"engine_capacity: {arm} up after {time.monotonic() - started:.0f} s, pool "
                f"{pool_tokens(engine):,} tokens; sending {args.requests} x "
                f"{args.context:,}",
                flush=True,
            )
            served = send_together(engine, args.context, args.requests, tokens, arm)
            rows.append(_capacity(engine, arm, served, tokens, args.context))
        print(f"engine_capacity: {rows[-1]}", flush=True)
        _write(args.out, args, fraction, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
