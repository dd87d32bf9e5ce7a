"""Benchmark p2-offload against resident serving in real SGLang 0.5.23 engines on one GPU.

Two engines serve the model-shaped tiny Qwen4Exp (the real QSA layer geometry: 24 query heads,
2 K/V heads of dim 256, block top-k 512; the rest of the model small) side by side, with the same
scheduler flags (SGLang's overlap scheduling, or ``--schedule serial``), decode CUDA graphs on and
prefill graphs off:

- **resident**: upstream SGLang, no plugin: the QSA layer's K/V in SGLang's pool on the GPU;
- **offload**: the plugin with ``SGLANG_QSA_HISPARSE_V3=p2-offload``: the K/V in pinned host
  memory, only the selected blocks fetched.

For each context length and batch size, ``B`` requests of that many prompt tokens generate
``--new-tokens`` greedy tokens concurrently, on each engine in turn. Reported per cell:

- decode tokens/s: the median ``gen throughput`` of SGLang's own ``Decode batch`` log lines
  while all ``B`` requests decode (the scheduler's count of tokens over wall time);
- prefill tokens/s (batch 1): prompt tokens over the request's wall time less its decode time
  (each engine first serves one unmeasured request, so no cell pays for compiling a kernel);
- whether the greedy tokens agree (batch 1; a near-tie may swap one token within bf16 noise).

And, from the offload engine's start-up log, the GPU bytes SGLang's pool sizer charges per token
with and without the QSA layers' K/V, whose ratio is how many more requests of any context length
the same GPU budget admits (the fixed staging, hot caches and tails aside). Both engines get pools
of ``max batch x longest context`` tokens, so that they can share the GPU.

Writes ``<out>/engine_offload.md`` and ``.json`` after every cell, so a run cut short keeps what
it measured. Needs CUDA and SGLang: ``nox -s gpu-engine-bench`` runs it on the GPU machine with
the engine payload (``nox -s bench`` leaves it out: its scripts are ``bench_*.py``); exits with
status 77 without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
import sys
import tempfile
import time
from typing import Any

from _engine_bench import (
    SKIPPED,
    Cell,
    HotCacheUse,
    first_difference,
    hot_cache_counters,
    hot_cache_use,
    lacks_cuda,
    log_numbers,
    measure,
    profile_args,
    profile_cells,
    profile_decode,
    schedule_arg,
    scheduling,
    start_all,
    warm_up,
    write_json,
)

#: Prefill chunk of both engines. SGLang runs the running requests' decode steps between the
#: chunks of the next prompt, so the first of ``B`` requests decodes about ``(B - 1)`` prompts'
#: chunks' worth of steps before the last one joins: each request generates that many more.
CHUNK = 16384
_PRICE = re.compile(r"pool sizing charges (\d+) B per token \(was (\d+) B")
_OFFLOAD = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"}


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts", default="32768,131072,262144", help="prompt lengths, comma separated"
    )
    parser.add_argument("--batches", default="1,8", help="concurrent requests, comma separated")
    parser.add_argument("--new-tokens", type=int, default=200, help="greedy tokens per request")
    parser.add_argument(
        "--deadline", type=float, default=float("inf"), help="seconds; no cell starts after it"
    )
    parser.add_argument(
        "--qsa-layers", type=int, default=12, help="QSA layers of the model-shaped Qwen4Exp"
    )
    profile_args(parser)
    schedule_arg(parser)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    for name, values in (("--contexts", args.contexts), ("--batches", args.batches)):
        if not values or min(values) < 1:
            parser.error(f"{name} {values!r} is not allowed; allowed: positive integers")
    if args.new_tokens < 80:
        parser.error(f"--new-tokens {args.new_tokens!r} is not allowed; allowed: >= 80")
    profile_cells(parser, args)
    return args


def _new_tokens(args: argparse.Namespace, context: int, batch: int) -> int:
    """Tokens each request of a cell generates: ``--new-tokens`` while all ``batch`` decode."""
    return tokens_while_all_decode(args.new_tokens, context, batch)


def tokens_while_all_decode(new_tokens: int, context: int, batch: int) -> int:
    """Tokens each of ``batch`` requests sent at once generates so that all of them decode
    ``new_tokens`` steps together: the first decodes between the later prompts' chunks."""
    return new_tokens + (batch - 1) * math.ceil(context / CHUNK)


def _configs(args: argparse.Namespace) -> dict[str, Any]:
    from qsa_testing import tiny_qwen4_exp

    longest = max(args.contexts) + _new_tokens(args, max(args.contexts), max(args.batches)) + 64
    model = tiny_qwen4_exp(
        model_shaped=True, qsa_layers=args.qsa_layers, max_position_embeddings=longest
    )
    # 12 resident QSA layers at 8 x 256K tokens take 53 GB: more than the harness's 0.3 of an
    # H200. Each engine still allocates only its --max-total-tokens.
    return engine_configs(
        model,
        context_length=longest,
        max_running_requests=max(args.batches),
        pool={"max_total_tokens": max(args.batches) * longest, "mem_fraction_static": 0.6},
        schedule=args.schedule,
    )


def engine_configs(
    model: Any,
    *,
    context_length: int,
    max_running_requests: int,
    pool: dict[str, Any],
    schedule: str = "overlap",
) -> dict[str, Any]:
    """The ``resident`` and ``offload`` engines' configurations: the same scheduler flags
    (``schedule``, of :data:`SCHEDULES`), decode CUDA graphs on (prefill graphs off: p2-offload
    captures decode only), and ``pool`` (SGLang's ``max_total_tokens`` and/or
    ``mem_fraction_static``) for both.
    """
    from qsa_testing import EngineConfig

    common = {
        "context_length": context_length,
        "max_running_requests": max_running_requests,
        "prefill_max_requests": 1,
        **scheduling(schedule),
        "chunked_prefill_size": CHUNK,
        "disable_cuda_graph": False,
        "cuda_graph_backend_prefill": "disabled",
        "cuda_graph_max_bs_decode": max_running_requests,
        "decode_log_interval": 20,
        **pool,
    }
    return {
        "resident": EngineConfig(model, plugin=False, server_args=common),
        "offload": EngineConfig(
            model,
            switches=_OFFLOAD,
            server_args={**common, "radix_cache_backend": "qsa_hisparse", "enable_metrics": True},
        ),
    }


def _record_bytes(model: Any) -> int:
    """One block of one QSA layer, K and V, in bf16 (the engines' KV dtype)."""
    text = model.text_config
    return 2 * 4 * int(text["num_key_value_heads"]) * int(text["head_dim"]) * 2


def _token_prices(engine: Any) -> dict[str, int]:
    """GPU bytes per token the offload engine's pool sizer charges, and would charge resident."""
    offload, resident = log_numbers(engine, _PRICE)
    return {"offload": offload, "resident": resident}


def _write(
    out: pathlib.Path,
    args: argparse.Namespace,
    cells: list[Cell],
    prices: dict[str, int],
    hot: dict[tuple[int, int], HotCacheUse],
) -> None:
    data = write_json(
        out,
        "engine_offload",
        {
            "gpu_bytes_per_token": prices,
            "cells": [dataclasses.asdict(c) for c in cells],
            "hot_cache": [
                {"context": c, "batch": b, **dataclasses.asdict(use)} for (c, b), use in hot.items()
            ],
        },
    )
    device, torch_version = data["machine"]["gpu"], data["machine"]["torch"]
    by_key = {(c.arm, c.context, c.batch): c for c in cells}
    lines = [
        "# p2-offload against resident serving, real SGLang 0.5.23 engines",
        "",
        f"GPU {device}, torch {torch_version}; the model-shaped tiny Qwen4Exp ({args.qsa_layers} "
        "QSA layers of the real geometry, each after 3 tiny GDN layers), decode CUDA graphs on "
        f"in both engines, the same scheduler flags ({args.schedule} scheduling). "
        f"`{data['command']}`; written by `benchmarks/engine/"
        "engine_offload.py`.",
        "",
        "| context | batch | resident decode tok/s | offload decode tok/s | offload / resident "
        "| resident prefill tok/s | offload prefill tok/s | same greedy tokens "
        "| hot-cache hit rate | fetched per step |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for context in args.contexts:
        for batch in args.batches:
            r, o = by_key.get(("resident", context, batch)), by_key.get(("offload", context, batch))
            if r is None and o is None:
                continue

            def rate(x: float | None) -> str:
                return "" if x is None else f"{x:,.0f}"

            def decode(cell: Cell | None) -> str:  # a lost cell (see the run's output) shows "-"
                return "-" if cell is None else f"{cell.decode_tokens_per_s:,.1f}"

            same = first_difference(r, o) if r is not None and o is not None else "-"
            speed = (
                f"{o.decode_tokens_per_s / r.decode_tokens_per_s:.2f}"
                if r is not None and o is not None
                else "-"
            )
            use = hot.get((context, batch)) if o is not None else None
            hits = "" if use is None else f"{use.hit_rate:.3f}"
            fetched = "" if use is None else f"{use.fetched_bytes_per_step / 2**20:.2f} MiB"
            lines.append(
                f"| {context:,} | {batch} | {decode(r)} | {decode(o)} | {speed} "
                f"| {rate(r.prefill_tokens_per_s if r else None)} "
                f"| {rate(o.prefill_tokens_per_s if o else None)} | {same} | {hits} | {fetched} |"
            )
    ratio = prices["resident"] / prices["offload"]
    lines += [
        "",
        f"GPU bytes per token in SGLang's pool sizing: {prices['resident']:,} resident, "
        f"{prices['offload']:,} offloaded (the compressed index only): the same GPU budget holds "
        f"**{ratio:.1f}x** the tokens, and as many more concurrent requests of any context length, "
        "as far as the host arena's rows allow.",
    ]
    (out / "engine_offload.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    """Start both engines, measure every (context, batch) cell, write the report."""
    args = _parse_args(argv)
    if lacks_cuda("engine_offload"):
        return SKIPPED
    started = time.monotonic()
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="qsa-engine-bench-"))
    engines = start_all(_configs(args), workdir)
    try:
        warm_up(engines, min(args.contexts))
        prices = _token_prices(engines["offload"])
        print(f"engine_offload: engines up after {time.monotonic() - started:.0f} s; {prices}")
        cells: list[Cell] = []
        hot: dict[tuple[int, int], HotCacheUse] = {}
        # In the order given (batches outer): a run cut short by --deadline keeps the first cells.
        for batch, context in ((b, c) for b in args.batches for c in args.contexts):
            if time.monotonic() - started > args.deadline:
                print(f"engine_offload: deadline reached before {context} x {batch}")
                break
            for arm in ("resident", "offload"):
                counted = hot_cache_counters(engines[arm]) if arm == "offload" else None
                tokens = _new_tokens(args, context, batch)
                try:
                    cell = measure(engines[arm], context, batch, tokens, arm)
                except RuntimeError as exc:  # the cell is lost, not the run
                    print(f"engine_offload: {arm} {context} x {batch}: {exc}", flush=True)
                    continue
                cells.append(cell)
                if counted is not None:
                    hot[context, batch] = hot_cache_use(
                        engines[arm], counted, _record_bytes(engines[arm].config.model)
                    )
                print(
                    f"engine_offload: {arm:8} context {context:>7} batch {batch}: "
                    f"decode {cell.decode_tokens_per_s:,.1f} tok/s, wall {cell.wall_s:.1f} s, "
                    f"prefill {cell.prefill_tokens_per_s or 0:,.0f} tok/s",
                    flush=True,
                )
            _write(args.out, args, cells, prices, hot)
        for context, batch in args.profile:
            for arm in ("resident", "offload"):
                tokens = _new_tokens(args, context, batch)
                summary = profile_decode(
                    engines[arm], context, batch, tokens, arm, args.profile_steps, args.out
                )
                print(f"engine_offload: {arm} {context} x {batch} profiled: {summary}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
