"""Benchmark serving under SGLang's own client: ``sglang.bench_serving`` against real HTTP servers.

Each arm is one SGLang 0.5.23 HTTP server of the same dummy Qwen4Exp (``--model shaped``: the
model-shaped tiny one with 12 QSA layers of the real geometry, each after 3 small GDN layers;
``--model full-depth``: Qwen3.8-Flash-Next's 48 layers at the real attention and GDN widths), the
same scheduler flags and decode CUDA graphs on:

- ``upstream``: the plugin off;
- ``resident``: ``p2-resident`` (upstream's kernels, the plugin's lifecycle);
- ``offload``: ``p2-offload``;
- ``offload-cache``: ``p2-offload`` and a host prefix cache of ``--cache-mb``.

SGLang's client (``python -m sglang.benchmark.serving --backend sglang``) drives each in turn, as
an operator would: ``--dataset-name random-ids --tokenize-prompt`` (prompts of random token ids,
``--input-len`` × [1 − ``--range-ratio``, 1] tokens), ``--output-len`` tokens each with
``ignore_eos``, at most ``--max-concurrency`` in flight, after one warm-up request and a cache
flush. Reported per arm: requests, input and output tokens per second, TTFT, TPOT and ITL (mean
and p99), each arm's request rate over the first arm's, and the plugin's own counters over the run
(prefix-cache lookups, hits, hit tokens, checkpoints published, bytes copied in and out,
evictions; decode steps served from the host arena).

The client draws ids below its tokenizer's ``vocab_size``; the tiny model's own tokenizer lists
its byte pieces above the model's 512 ids (which the server rightly refuses), so the client reads
a word-level tokenizer of exactly the model's vocabulary, written beside the model. The server
loads the model's own tokenizer: the client needs text in the stream.

Writes ``<out>/engine_serving.md`` and ``.json``. Needs CUDA, SGLang and ``datasets`` (the client
imports it): ``nox -s gpu-engine-bench -- serving ...`` runs it on the GPU machine with the engine
payload; exits with status 77 without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

from _engine_bench import SKIPPED, lacks_cuda, write_json

_PAGE = 64
_CHUNK = 8192
ARMS = ("upstream", "resident", "offload", "offload-cache")
#: The plugin's counters read before and after each run (a missing one reads 0).
COUNTERS = (
    "qsa_hisparse_prefix_cache_lookups_total",
    "qsa_hisparse_prefix_cache_hits_total",
    "qsa_hisparse_prefix_cache_hit_tokens_total",
    "qsa_hisparse_prefix_cache_publishes_total",
    "qsa_hisparse_prefix_cache_bytes_in_total",
    "qsa_hisparse_prefix_cache_bytes_out_total",
    "qsa_hisparse_prefix_cache_evictions_total",
    "qsa_hisparse_offload_decode_steps_total",
)
#: What the client reports, as its output file names it.
METRICS = (
    "completed",
    "duration",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
)


@dataclasses.dataclass
class Run:
    """One arm's run: the client's metrics and the plugin's counters over it."""

    arm: str
    metrics: dict[str, float]
    counters: dict[str, float]
    held_after: dict[str, float]


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arms", default="upstream,offload,offload-cache", help="of " + ",".join(ARMS)
    )
    parser.add_argument("--model", choices=("shaped", "full-depth"), default="shaped")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32768)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--cache-mb", type=int, default=32768, help="offload-cache's host cache")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    args.arms = args.arms.split(",")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or not args.arms:
        parser.error(f"--arms {unknown!r} are not known; allowed: {', '.join(ARMS)}")
    for flag in ("num_prompts", "input_len", "output_len", "max_concurrency", "cache_mb"):
        if getattr(args, flag) < 1:
            value = getattr(args, flag)
            parser.error(f"--{flag.replace('_', '-')} {value!r} is not allowed; allowed: >= 1")
    if not 0.0 <= args.range_ratio <= 1.0:
        parser.error(f"--range-ratio {args.range_ratio!r} is not allowed; allowed: 0 to 1")
    return args


def _configs(args: argparse.Namespace) -> dict[str, Any]:
    from qsa_testing import EngineConfig, full_depth_qwen4_exp, tiny_qwen4_exp

    longest = args.input_len + args.output_len + _PAGE
    if args.model == "full-depth":
        model = full_depth_qwen4_exp(max_position_embeddings=longest, vision=True)
    else:
        model = tiny_qwen4_exp(
            model_shaped=True, qsa_layers=12, max_position_embeddings=longest, vision=True
        )
    common = {
        "context_length": longest,
        "max_running_requests": args.max_concurrency,
        "max_total_tokens": args.max_concurrency * longest,
        "mem_fraction_static": 0.6,
        "prefill_max_requests": 1,
        "disable_overlap_schedule": True,
        "chunked_prefill_size": _CHUNK,
        "disable_cuda_graph": False,
        "cuda_graph_backend_prefill": "disabled",
        "cuda_graph_max_bs_decode": args.max_concurrency,
        "enable_metrics": True,
    }
    plugin = {**common, "radix_cache_backend": "qsa_hisparse"}
    compat = {"SGLANG_QSA_MODEL_COMPAT": "1"}
    offload = {**compat, "SGLANG_QSA_HISPARSE_V3": "p2-offload"}
    every = {
        "upstream": EngineConfig(model, plugin=False, server_args=common),
        "resident": EngineConfig(
            model, switches={**compat, "SGLANG_QSA_HISPARSE_V3": "p2-resident"}, server_args=plugin
        ),
        "offload": EngineConfig(model, switches=offload, server_args=plugin),
        "offload-cache": EngineConfig(
            model,
            switches={**offload, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": str(args.cache_mb)},
            server_args=plugin,
        ),
    }
    return {arm: every[arm] for arm in args.arms}


def client_tokenizer(directory: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """A word-level tokenizer of exactly ``vocab_size`` ids (``t0`` ...), for the client only."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (directory / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = {"tokenizer_class": "TokenizersBackend", "model_max_length": 1 << 24}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def _counters(engine: Any) -> dict[str, float]:
    return {name: engine.metric(name) for name in COUNTERS}


def _held(engine: Any) -> dict[str, float]:
    names = (
        "qsa_hisparse_live_leases",
        "qsa_hisparse_offload_rows_in_use",
        "qsa_hisparse_prefix_cache_reserved_entries",
    )
    return {name: engine.metric(name) for name in names}


def serve(
    engine: Any, args: argparse.Namespace, tokenizer: pathlib.Path, result: pathlib.Path
) -> dict[str, float]:
    """Run SGLang's client against ``engine``; its metrics, from the file it writes."""
    command = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--backend", "sglang",
        "--base-url", engine.address,
        "--dataset-name", "random-ids",
        "--tokenize-prompt",
        "--tokenizer", str(tokenizer),
        "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.input_len),
        "--random-range-ratio", str(args.range_ratio),
        "--random-output-len", str(args.output_len),
        "--max-concurrency", str(args.max_concurrency),
        "--seed", str(args.seed),
        "--flush-cache",
        "--disable-tqdm",
        "--output-file", str(result),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    sys.stdout.write(done.stdout[-3000:])
    if done.returncode != 0:
        msg = f"the client exited {done.returncode}: {done.stderr[-3000:]}"
        raise RuntimeError(msg)
    line = result.read_text(encoding="utf-8").splitlines()[-1]
    reply = json.loads(line)
    return {name: float(reply[name]) for name in METRICS}


def _write(out: pathlib.Path, args: argparse.Namespace, runs: list[Run]) -> None:
    data = write_json(out, "engine_serving", {"runs": [dataclasses.asdict(r) for r in runs]})
    base = runs[0]
    lines = [
        "# Serving under SGLang's own client: offload against resident, real SGLang 0.5.23 servers",
        "",
        f"GPU {data['machine']['gpu']}, torch {data['machine']['torch']}; the {args.model} dummy "
        f"Qwen4Exp, decode CUDA graphs on, prefill chunks of {_CHUNK}, "
        f"`--max-running-requests {args.max_concurrency}` in every arm. Client: "
        f"`sglang.benchmark.serving --backend sglang --dataset-name random-ids --tokenize-prompt "
        f"--num-prompts {args.num_prompts} --random-input-len {args.input_len} "
        f"--random-range-ratio {args.range_ratio} --random-output-len {args.output_len} "
        f"--max-concurrency {args.max_concurrency} --flush-cache`. "
        f"`{data['command']}`; written by "
        "`packages/qsa-sglang-plugin/benchmarks/engine_serving.py`. Arms ran one after another, "
        "each server alone on the GPU.",
        "",
        f"| arm | req/s | / {base.arm} | input tok/s | output tok/s | TTFT mean / p99 (ms) "
        "| TPOT mean / p99 (ms) | ITL mean / p99 (ms) | cache hits / lookups | checkpoints "
        "| bytes in / out | held after |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for run in runs:
        m, c = run.metrics, run.counters
        ratio = m["request_throughput"] / base.metrics["request_throughput"]
        held = "none" if not any(run.held_after.values()) else json.dumps(run.held_after)
        lines.append(
            f"| {run.arm} | {m['request_throughput']:.3f} | {ratio:.2f} "
            f"| {m['input_throughput']:,.0f} | {m['output_throughput']:,.0f} "
            f"| {m['mean_ttft_ms']:,.0f} / {m['p99_ttft_ms']:,.0f} "
            f"| {m['mean_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} "
            f"| {m['mean_itl_ms']:.1f} / {m['p99_itl_ms']:.1f} "
            f"| {c['qsa_hisparse_prefix_cache_hits_total']:.0f} / "
            f"{c['qsa_hisparse_prefix_cache_lookups_total']:.0f} "
            f"| {c['qsa_hisparse_prefix_cache_publishes_total']:.0f} "
            f"| {c['qsa_hisparse_prefix_cache_bytes_in_total'] / 2**30:.1f} / "
            f"{c['qsa_hisparse_prefix_cache_bytes_out_total'] / 2**30:.1f} GiB | {held} |"
        )
    (out / "engine_serving.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    """Start every arm's server, drive each with SGLang's client in turn, write the report."""
    args = _parse_args(argv)
    if lacks_cuda("engine_serving"):
        return SKIPPED
    from qsa_testing import start_engine

    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="qsa-engine-serving-"))
    configs = _configs(args)
    model = next(iter(configs.values())).model
    tokenizer = client_tokenizer(workdir / "client-tokenizer", model.vocab_size)
    runs: list[Run] = []
    for arm, config in configs.items():  # one server at a time: each has the GPU to itself
        started = time.monotonic()
        with start_engine(config, workdir / arm, timeout=900.0) as engine:
            before = _counters(engine)
            metrics = serve(engine, args, tokenizer, workdir / f"{arm}.jsonl")
            after = _counters(engine)
            gained = {name: after[name] - before[name] for name in COUNTERS}
            runs.append(Run(arm, metrics, gained, _held(engine)))
        print(f"{arm}: {metrics} ({time.monotonic() - started:.0f} s with the start)", flush=True)
        _write(args.out, args, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
