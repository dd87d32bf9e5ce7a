"""Benchmark ``--attention-backend qsa_ds`` against SGLang's triton backend in real engines.

SGLang 0.5.23 engines serve the Llama-3.1-8B-shaped dummy model
(:func:`qsa_testing.llama_8b_shaped`: 32 layers, 32 query and 8 K/V heads of dim 128) on one
GPU, one at a time (each arm's engine starts, measures every cell and stops before the next
starts, so each has the whole GPU and host: an 80 GB H100 does not hold qsa_ds's 300,000-token
pool beside a second engine), with the same scheduler flags (except those the offload requires,
below), decode CUDA graphs on and prefill graphs off:

- **triton**: upstream SGLang, no plugin, its dense triton attention backend;
- **qsa_ds**: the plugin's double-sparsity backend with the library's default options (32 heavy
  channels of 128, 256 heavy tokens per KV head, dense below 4,096 tokens) and a channel file of
  seeded random channels (the weights are dummy, so calibrating them would rank noise; the speed
  does not depend on which channels are heavy);
- **ds_offload** (``--arms`` includes it): the same with ``SGLANG_QSA_DS_OFFLOAD=1``, the K/V
  history in pinned host memory, one record per (block, KV head), decode CUDA graphs on (fixed
  token lists of ``DSConfig.fixed_width()`` per KV head). Its host arena holds every running
  request at the longest context: size ``--contexts`` and ``--batches`` to the host's memory;
- **qsa_ds_serial**: resident ``qsa_ds`` with one prefill at a time, as DS-Offload requires, and
  without overlap scheduling (``--disable-overlap-schedule``);
- **ds_offload_serial**: DS-Offload without overlap scheduling, as it ran before it served it:
  ``ds_offload / ds_offload_serial`` is what overlap scheduling gives it, ``ds_offload_serial /
  qsa_ds_serial`` the offload's own cost at equal scheduling;
- **ds_offload_eager**: DS-Offload with decode CUDA graphs off (each step's lists as wide as its
  longest).

For each context length and batch size, ``B`` requests of that many prompt tokens generate
``--new-tokens`` greedy tokens concurrently on each engine; reported per cell: decode
tokens/s from SGLang's own ``Decode batch`` log lines, and their ratio; for DS-Offload, its hot
caches' hit rate and the bytes it read from the host arena per step (its Prometheus counters),
and the time those bytes take at this machine's pinned copy rate (measured before the engines
start), which no overlap can take below. Also the GPU bytes per token each engine's pool sizing
charges (the label cache is ``C / (2 D)`` of the K/V; with DS-Offload the labels alone, plus the
offload's fixed device buffers).

Writes ``<out>/engine_double_sparsity.md`` and ``.json`` after every cell; with ``--profile
CONTEXTxBATCH``, a torch profiler trace of each arm's decode steps at that cell
(``<out>/traces/``) and its summary (``<out>/profile-<arm>-<context>-<batch>.txt``: time per step,
GPU busy time, the heaviest functions and kernels). Needs CUDA and SGLang:
``nox -s gpu-engine-bench -- double_sparsity`` runs it on the GPU machine; exits with status 77
without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import re
import sys
import tempfile
import time
from typing import Any

from _engine_bench import (
    SKIPPED,
    Cell,
    HotCacheUse,
    hot_cache_counters,
    hot_cache_use,
    lacks_cuda,
    log_numbers,
    measure,
    pinned_to_device_rate,
    pool_tokens,
    profile_args,
    profile_cells,
    profile_decode,
    scheduling,
    start_all,
    warm_up,
    write_json,
)

_PRICE = re.compile(r"qsa_ds: pool sizing charges (\d+) B per token \((\d+) B of K/V")
_OFFLOAD_PRICE = re.compile(
    r"DS-Offload: pool sizing charges (\d+) B per token of labels .* plus ([0-9.]+) MiB fixed"
)
_ARMS = ("triton", "qsa_ds", "qsa_ds_serial", "ds_offload", "ds_offload_serial", "ds_offload_eager")
#: The scheduler flag the offload requires (its configuration check refuses others): it stages
#: one prompt at a time.
_ONE_PROMPT = {"prefill_max_requests": 1}


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts", default="32768,131072", help="prompt lengths, comma separated"
    )
    parser.add_argument("--batches", default="1,8", help="concurrent requests, comma separated")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=300_000,
        help="each engine's K/V pool at most, in tokens; a cell that fits no pool is skipped",
    )
    parser.add_argument("--new-tokens", type=int, default=120, help="greedy tokens per request")
    parser.add_argument(
        "--deadline", type=float, default=float("inf"), help="seconds; no cell starts after it"
    )
    parser.add_argument(
        "--arms", default="triton,qsa_ds", help=f"engines, comma separated, of {','.join(_ARMS)}"
    )
    profile_args(parser)
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
    args.arms = tuple(a for a in _ARMS if a in args.arms.split(","))
    if "qsa_ds" not in args.arms or len(args.arms) < 2:
        parser.error(f"--arms {args.arms!r} is not allowed; allowed: qsa_ds and one of the others")
    return args


def _channel_file(model: Any, path: pathlib.Path) -> pathlib.Path:
    """Seeded random channel rankings, one per KV head of every layer, in the library's format."""
    from qsa_kernels.double_sparsity import HeavyChannelType, layer_key

    text = model.text_config
    rng = random.Random(0)
    head_dim = int(text["head_dim"])
    rows = {
        layer_key(layer, HeavyChannelType.QK): [
            rng.sample(range(head_dim), head_dim) for _ in range(int(text["num_key_value_heads"]))
        ]
        for layer in range(int(text["num_hidden_layers"]))
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def _configs(args: argparse.Namespace, workdir: pathlib.Path) -> dict[str, Any]:
    from qsa_testing import EngineConfig, llama_8b_shaped

    longest = max(args.contexts) + args.new_tokens + 64
    model = llama_8b_shaped(max_position_embeddings=longest)
    common = {
        "context_length": longest,
        "max_running_requests": max(args.batches),
        "max_total_tokens": args.max_tokens,
        "chunked_prefill_size": 16384,
        "disable_cuda_graph": False,
        "cuda_graph_backend_prefill": "disabled",  # decode is what is measured
        "cuda_graph_max_bs_decode": max(args.batches),
        "decode_log_interval": 20,
        # Alone on the GPU, each engine takes what it needs up to --max-tokens.
        "mem_fraction_static": 0.9,
    }
    channels = _channel_file(model, workdir / "channels.json")
    ds = {"attention_backend": "qsa_ds", "enable_metrics": True}
    offload = {**common, **ds, **_ONE_PROMPT, "radix_cache_backend": "qsa_hisparse"}
    serial = scheduling("serial")
    resident_switches = {"SGLANG_QSA_DS_CHANNEL_CONFIG": str(channels)}
    offload_switches = {**resident_switches, "SGLANG_QSA_DS_OFFLOAD": "1"}
    configs = {
        "triton": EngineConfig(model, plugin=False, server_args=common),
        "qsa_ds": EngineConfig(model, switches=resident_switches, server_args={**common, **ds}),
        "qsa_ds_serial": EngineConfig(
            model,
            switches=resident_switches,
            server_args={**common, **ds, **_ONE_PROMPT, **serial},
        ),
        "ds_offload": EngineConfig(model, switches=offload_switches, server_args=offload),
        "ds_offload_serial": EngineConfig(
            model, switches=offload_switches, server_args={**offload, **serial}
        ),
        "ds_offload_eager": EngineConfig(
            model,
            switches=offload_switches,
            server_args={**offload, "disable_cuda_graph": True},
        ),
    }
    return {arm: configs[arm] for arm in args.arms}


def _arm_price(arm: str, engine: Any) -> dict[str, float]:
    """What ``arm``'s pool sizing charges: qsa_ds's GPU bytes per token (K/V, and with its
    labels), DS-Offload's bytes per token of labels and fixed MiB; nothing for triton."""
    if arm.startswith("qsa_ds"):
        total, kv = log_numbers(engine, _PRICE)
        return {"kv": kv, "kv_and_labels": total}
    if arm.startswith("ds_offload"):
        text = engine.log_path.read_text(encoding="utf-8", errors="replace")
        labels, fixed = _OFFLOAD_PRICE.findall(text)[-1]
        return {"labels": int(labels), "ds_offload_fixed_mib": float(fixed)}
    return {}


def _record_bytes(model: Any) -> int:
    """DS-Offload's record: one block of one K/V head, K and V, in bf16 (the engines' KV dtype)."""
    from qsa_kernels import BLOCK_TOKENS

    return 2 * BLOCK_TOKENS * int(model.text_config["head_dim"]) * 2


def _ratios(arms: tuple[str, ...]) -> list[tuple[str, str]]:
    """The reported speed ratios: qsa_ds over triton, DS-Offload over dense triton, over resident
    qsa_ds, over itself without overlap scheduling and over its own eager steps."""
    pairs = (
        ("qsa_ds", "triton"),
        ("ds_offload", "triton"),
        ("ds_offload", "qsa_ds"),
        ("qsa_ds_serial", "qsa_ds"),
        ("ds_offload", "ds_offload_serial"),
        ("ds_offload_serial", "qsa_ds_serial"),
        ("ds_offload_eager", "qsa_ds"),
        ("ds_offload", "ds_offload_eager"),
    )
    return [(num, den) for num, den in pairs if num in arms and den in arms]


def _write(  # noqa: PLR0917 (the report's parts)
    out: pathlib.Path,
    args: argparse.Namespace,
    cells: list[Cell],
    price: dict[str, float],
    hot: dict[tuple[str, int, int], HotCacheUse],
    pinned_rate: float,
) -> None:
    data = write_json(
        out,
        "engine_double_sparsity",
        {
            "gpu_bytes_per_token": price,
            "pinned_to_device_bytes_per_s": pinned_rate,
            "cells": [dataclasses.asdict(c) for c in cells],
            "hot_cache": [
                {"arm": a, "context": c, "batch": b, **dataclasses.asdict(use)}
                for (a, c, b), use in hot.items()
            ],
        },
    )
    device, torch_version = data["machine"]["gpu"], data["machine"]["torch"]
    by_key = {(c.arm, c.context, c.batch): c for c in cells}
    graphs = "on, ds_offload_eager's off" if "ds_offload_eager" in args.arms else "on"
    lines = [
        "# Double sparsity (`qsa_ds`) against SGLang's triton backend, real SGLang 0.5.23 engines",
        "",
        f"GPU {device}, torch {torch_version}; the Llama-3.1-8B-shaped dummy model, decode "
        f"CUDA graphs {graphs}, otherwise the same scheduler flags but one prefill at a time in "
        "the DS-Offload arms and qsa_ds_serial, and no overlap scheduling in the `_serial` "
        "arms; qsa_ds with 32 "
        f"heavy channels of 128 and 256 heavy tokens per KV head. `{data['command']}`; written by "
        "`benchmarks/engine/engine_double_sparsity.py`.",
        "",
        "| context | batch | "
        + " | ".join(f"{arm} decode tok/s" for arm in args.arms)
        + " | "
        + " | ".join(f"{num} / {den}" for num, den in _ratios(args.arms))
        + " |",
        "| ---: | ---: | "
        + " | ".join("---:" for _ in range(len(args.arms) + len(_ratios(args.arms))))
        + " |",
    ]
    for context in args.contexts:
        for batch in args.batches:
            got = {arm: by_key.get((arm, context, batch)) for arm in args.arms}
            rates = {arm: c.decode_tokens_per_s for arm, c in got.items() if c is not None}
            if len(rates) < len(args.arms):
                continue
            lines.append(
                f"| {context:,} | {batch} | "
                + " | ".join(f"{rates[arm]:,.1f}" for arm in args.arms)
                + " | "
                + " | ".join(f"{rates[num] / rates[den]:.2f}" for num, den in _ratios(args.arms))
                + " |"
            )
    lines.append("")
    if hot:
        lines += [
            "DS-Offload's reads from the host arena (its hot caches' counters over each cell's "
            f"decode), and their time at this machine's pinned copy rate, "
            f"{pinned_rate / 1e9:.1f} GB/s, against the resident `qsa_ds` step:",
            "",
            "| arm | context | batch | hit rate | fetched per step | at the pinned rate "
            "| qsa_ds step |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for (arm, context, batch), use in hot.items():
            resident = by_key.get(("qsa_ds", context, batch))
            per_step = None if resident is None else batch / resident.decode_tokens_per_s
            step = "-" if per_step is None else f"{per_step * 1e3:.2f} ms"
            lines.append(
                f"| {arm} | {context:,} | {batch} | {use.hit_rate:.3f} "
                f"| {use.fetched_bytes_per_step / 2**20:.1f} MiB "
                f"| {use.fetched_bytes_per_step / pinned_rate * 1e3:.2f} ms | {step} |"
            )
        lines.append("")
    if "kv" in price:
        lines.append(
            f"GPU bytes per token in SGLang's pool sizing: {price['kv']:,.0f} of K/V (triton), "
            f"{price['kv_and_labels']:,.0f} with qsa_ds's labels "
            f"({price['kv_and_labels'] / price['kv']:.3f}x)."
        )
    if "labels" in price and "kv" in price:
        lines.append(
            f"DS-Offload: {price['labels']:,.0f} (the labels alone, "
            f"{price['kv'] / price['labels']:.1f}x fewer than the K/V), plus "
            f"{price['ds_offload_fixed_mib']:,.0f} MiB of staging, hot caches and tables."
        )
    (out / "engine_double_sparsity.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    """Start each arm's engine in turn, measure every (context, batch) cell that fits its pool,
    write the report after each cell."""
    args = _parse_args(argv)
    if lacks_cuda("engine_double_sparsity"):
        return SKIPPED
    started = time.monotonic()
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="qsa-engine-bench-"))
    cells: list[Cell] = []
    price: dict[str, float] = {}
    hot: dict[tuple[str, int, int], HotCacheUse] = {}
    pinned_rate = pinned_to_device_rate()
    print(f"engine_double_sparsity: pinned host-to-device copies at {pinned_rate / 1e9:.1f} GB/s")
    for arm, config in _configs(args, workdir).items():
        engine = start_all({arm: config}, workdir)[arm]
        try:
            warm_up({arm: engine}, 8192)
            price |= _arm_price(arm, engine)
            pool = pool_tokens(engine)
            print(
                f"engine_double_sparsity: {arm} up at {time.monotonic() - started:.0f} s; "
                f"{price}; its pool holds {pool:,} tokens"
            )
            for batch, context in ((b, c) for b in args.batches for c in args.contexts):
                if batch * (context + args.new_tokens) > pool:
                    print(f"engine_double_sparsity: {arm}: {batch} x {context} exceeds its pool")
                    continue
                if time.monotonic() - started > args.deadline:
                    print(
                        f"engine_double_sparsity: deadline reached before {arm} {context} x {batch}"
                    )
                    break
                counted = hot_cache_counters(engine) if arm.startswith("ds_offload") else None
                cell = measure(engine, context, batch, args.new_tokens, arm)
                cells.append(cell)
                if counted is not None:
                    use = hot_cache_use(engine, counted, _record_bytes(config.model))
                    hot[arm, context, batch] = use
                    print(
                        f"engine_double_sparsity: {arm} hot-cache hit rate {use.hit_rate:.3f}, "
                        f"{use.fetched_bytes_per_step / 2**20:.1f} MiB from the host per step"
                    )
                print(
                    f"engine_double_sparsity: {arm:6} context {context:>7} batch {batch}: "
                    f"decode {cell.decode_tokens_per_s:,.1f} tok/s, wall {cell.wall_s:.1f} s",
                    flush=True,
                )
                _write(args.out, args, cells, price, hot, pinned_rate)
            for context, batch in args.profile:
                if batch * (context + args.new_tokens) > pool:
                    continue
                summary = profile_decode(
                    engine, context, batch, args.new_tokens, arm, args.profile_steps, args.out
                )
                print(f"engine_double_sparsity: {arm} {context} x {batch} profiled: {summary}")
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
