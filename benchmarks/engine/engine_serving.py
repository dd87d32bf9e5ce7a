"""Benchmark serving under SGLang's own client: ``sglang.bench_serving`` against real HTTP servers.

Each arm is one SGLang 0.5.23 HTTP server of the same dummy Qwen4Exp (``--model shaped``: the
model-shaped tiny one with 12 QSA layers of the real geometry, each after 3 small GDN layers;
``--model full-depth``: Qwen3.8-Flash-Next's 48 layers at the real attention and GDN widths), the
same scheduler flags (SGLang's default prefill batching unless an arm says otherwise; SGLang's
overlap scheduling, or none with ``--schedule serial`` as in every run before the offload served
it), decode CUDA graphs on and prefill graphs as ``--prefill-graphs`` says (``breakable``,
SGLang's default on CUDA, or ``disabled``, as in every run before the twenty-ninth session):

- ``upstream``: the plugin off;
- ``resident``: ``p2-resident`` (upstream's kernels, the plugin's lifecycle);
- ``resident-one-prompt``: ``p2-resident`` with ``--prefill-max-requests 1`` (one prompt per
  prefill batch), so the cost of that limit shows apart;
- ``offload``: ``p2-offload`` with ``--prefill-max-requests`` of ``--staged-prompts`` (default 2:
  the end of one prompt and the head of the next share a prefill batch, as they do by default);
- ``offload-cache``: ``p2-offload`` and a host prefix cache of ``--cache-mb``.
- ``offload-cache-second``: the same, checkpointing a prefix only the second time a request
  reaches it (``SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT=second``).

SGLang's client (``python -m sglang.benchmark.serving --backend sglang``) drives each server with
every workload in turn, as an operator would, at most ``--max-concurrency`` requests in flight.
Before each measured run the client runs ``--warmup-prompts`` (default ``--max-concurrency``)
unmeasured requests of the same workload with another seed (so no arm pays for compiling a kernel)
and flushes the server's caches:

- ``random``: ``--dataset-name random-ids --tokenize-prompt``, ``--input-len`` × [``--range-ratio``,
  1] tokens, ``--output-len`` tokens each with ``ignore_eos``. The client's prompts are runs of
  consecutive ids from a random start, modulo the vocabulary. With the dummy models' 512 ids, two
  prompts whose starts meet modulo 512 share their head. So a few prefix hits happen: 6 in 35
  lookups in run 5. Otherwise nothing can be reused, and the workload shows what serving costs.
- ``shared-prefix``: ``--dataset-name generated-shared-prefix --tokenize-prompt``, one system
  prompt of ``--shared-prefix-len`` tokens before each request's own ``--question-len`` tokens,
  ``--output-len`` tokens each with ``ignore_eos``, as in the random workload (the plugin loads
  an ``ignore_eos`` request's host hit like any other's).

Reported per arm and workload: requests, input and output tokens per second, TTFT, TPOT and ITL
(mean and p99), the request rate and mean TTFT over the base arm's (``resident`` when it ran, else
the first arm), and the plugin's own counters over the measured run (prefix-cache lookups, hits,
loads, checkpoints published, bytes copied in and out, evictions), and what the plugin still held
once the server was idle.

The client reads a word-level tokenizer of exactly the model's vocabulary
(:func:`qsa_testing.word_level_tokenizer`): it draws ids below its tokenizer's ``vocab_size``, and
the tiny model's own tokenizer lists its byte pieces above the model's 512 ids. The server loads
the model's own tokenizer: the client needs text in the stream.

``--gpu-budget-gib G`` gives every arm the same GPU memory budget (SGLang's
``--mem-fraction-static``, no ``--max-total-tokens``), so each sizes its pool from the same bytes:
the tight-GPU workload, e.g. ``--arms resident,offload --workloads random --input-len 131072
--range-ratio 1 --num-prompts 8 --output-len 2048 --staged-prompts 1 --gpu-budget-gib 8``, where
the resident pool holds two of the eight 128K requests (25,344 B a token for the 12 QSA layers'
K/V) and the offload's all eight. The offload's staging area is fixed GPU memory of
``--staged-prompts`` whole prompts: two 128K prompts take 6 GiB of an 8 GiB budget and leave its
pool one request (docs/bench/engine_serving-tight.md), hence one staged prompt here; and with
a few hundred output tokens the workload is bound by prefill in both arms, hence 2,048. Each
arm's pool (``max_total_num_tokens``) is in the report.

Without ``--gpu-budget-gib`` every arm's pool is capped by ``--max-total-tokens``, so the servers
start together (a fresh GPU machine spends minutes compiling and capturing each one) and are then
measured one at a time: the others wait idle on the same GPU, holding memory and no compute.
With a budget each server sizes its pool from the free memory it measures, so each starts and is
measured alone. ``--start apart`` forces that everywhere.

``--repeats N`` measures each workload N times on the same server (each run after a flush), one
row per run and a table of each arm's median, range and the medians' ratios: what a ratio is
worth on this machine. Servers on different machines differ by more than that (the offload
arms by up to 30%: they read the host arena every step); the report's header names the host.

``--append FILE`` adds this run's arms to an earlier ``engine_serving.json`` of the same machine
(the same boot id) and the same settings, and reports them together: a GPU machine's calls are
limited in time, and two arms with their starts and warm-ups can take longer than one call, so
each arm can run in its own call on the same warm machine. A file of another boot, other
settings, or an arm it already holds is refused before any server starts.

Writes ``<out>/engine_serving.md`` and ``.json``. Needs CUDA, SGLang and ``datasets`` (the client
imports it): ``nox -s gpu-engine-bench -- serving ...`` runs it on the GPU machine with the engine
payload; exits with status 77 without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from _engine_bench import (
    PREFILL_GRAPHS,
    SKIPPED,
    boot_id,
    lacks_cuda,
    mem_fraction,
    pool_tokens,
    schedule_arg,
    scheduling,
    write_json,
)

_PAGE = 64
_CHUNK = 8192
ARMS = (
    "upstream",
    "resident",
    "resident-one-prompt",
    "offload",
    "offload-cache",
    "offload-cache-second",
)
WORKLOADS = ("random", "shared-prefix")
#: The plugin's counters read before and after each run (a missing one reads 0).
COUNTERS = (
    "qsa_hisparse_prefix_cache_lookups_total",
    "qsa_hisparse_prefix_cache_hits_total",
    "qsa_hisparse_prefix_cache_hit_tokens_total",
    "qsa_hisparse_prefix_cache_loads_total",
    "qsa_hisparse_prefix_cache_loaded_tokens_total",
    "qsa_hisparse_prefix_cache_publishes_total",
    "qsa_hisparse_prefix_cache_bytes_in_total",
    "qsa_hisparse_prefix_cache_bytes_out_total",
    "qsa_hisparse_prefix_cache_evictions_total",
    "qsa_hisparse_prefix_cache_deferred_total",
    "qsa_hisparse_offload_decode_steps_total",
)


@dataclasses.dataclass
class Run:
    """One arm's measured run of one workload: the client's metrics and the plugin's counters."""

    arm: str
    workload: str
    metrics: dict[str, float]
    counters: dict[str, float]
    held_after: dict[str, float]
    repeat: int = 0  # which of the arm's ``--repeats`` measured runs of the workload
    pool_tokens: int = 0  # SGLang's max_total_num_tokens for this arm


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arms", default="resident,offload,offload-cache", help="of " + ",".join(ARMS)
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="of " + ",".join(WORKLOADS)
    )
    parser.add_argument("--model", choices=("shaped", "full-depth"), default="shaped")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32768)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--shared-prefix-len", type=int, default=16384)
    parser.add_argument("--question-len", type=int, default=1024)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument(
        "--warmup-prompts",
        type=int,
        default=None,
        help="requests of the unmeasured run before each measured one (default: --max-concurrency)",
    )
    parser.add_argument("--cache-mb", type=int, default=32768, help="offload-cache's host cache")
    parser.add_argument(
        "--staged-prompts",
        type=int,
        default=2,
        help="the offload arms' --prefill-max-requests (prompts staged at once)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--prefill-graphs",
        choices=PREFILL_GRAPHS,
        default=PREFILL_GRAPHS[0],
        help="--cuda-graph-backend-prefill in every arm (decode graphs are on)",
    )
    schedule_arg(parser)
    parser.add_argument(
        "--gpu-budget-gib",
        type=float,
        default=None,
        help="one GPU memory budget for every arm (default: a token cap fitting every request)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="measured runs per arm and workload, one server"
    )
    parser.add_argument(
        "--start",
        choices=("together", "apart"),
        default="together",
        help="start every server at once (with a token cap only) or each after the last stopped",
    )
    parser.add_argument(
        "--append",
        type=pathlib.Path,
        default=None,
        help="an earlier engine_serving.json of this machine and these settings: report its arms "
        "with this run's",
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.warmup_prompts is None:
        args.warmup_prompts = args.max_concurrency
    for flag, allowed in (("arms", ARMS), ("workloads", WORKLOADS)):
        names = getattr(args, flag).split(",")
        unknown = [n for n in names if n not in allowed]
        if unknown or len(set(names)) != len(names):
            parser.error(
                f"--{flag} {getattr(args, flag)!r} is not allowed; allowed: distinct names of "
                f"{', '.join(allowed)}"
            )
        setattr(args, flag, names)
    for flag in (
        "num_prompts",
        "input_len",
        "output_len",
        "max_concurrency",
        "cache_mb",
        "shared_prefix_len",
        "question_len",
        "repeats",
        "warmup_prompts",
        "staged_prompts",
    ):
        if getattr(args, flag) < 1:
            value = getattr(args, flag)
            parser.error(f"--{flag.replace('_', '-')} {value!r} is not allowed; allowed: >= 1")
    if args.gpu_budget_gib is not None and not args.gpu_budget_gib > 0:
        parser.error(f"--gpu-budget-gib {args.gpu_budget_gib!r} is not allowed; allowed: > 0")
    if not 0.0 <= args.range_ratio <= 1.0:
        parser.error(f"--range-ratio {args.range_ratio!r} is not allowed; allowed: 0 to 1")
    if args.gpu_budget_gib is not None:  # each pool is sized from the free memory it measures
        args.start = "apart"
    args.earlier = [] if args.append is None else _earlier(args, parser)
    return args


#: The flags that define what a run measures: an appended file's must equal this run's.
SETTINGS = (
    "model",
    "workloads",
    "num_prompts",
    "input_len",
    "range_ratio",
    "output_len",
    "shared_prefix_len",
    "question_len",
    "max_concurrency",
    "warmup_prompts",
    "cache_mb",
    "staged_prompts",
    "seed",
    "prefill_graphs",
    "schedule",
    "gpu_budget_gib",
    "repeats",
    "start",
)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in SETTINGS}


def _earlier(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Run]:
    """The runs of ``--append``'s file, once it is shown to come from this machine's boot, with
    this run's settings and none of this run's arms (else ``parser.error`` names the mismatch)."""
    path = args.append
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        runs = [Run(**run) for run in data["runs"]]
        theirs, boot = data["settings"], data["machine"]["host"]["boot_id"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--append {str(path)!r} is not an engine_serving.json: {exc!r}")
    here = boot_id()
    if here is None or boot != here:
        parser.error(
            f"--append {str(path)!r} was written on machine boot {boot!r}, this is {here!r}; "
            "allowed: a file of this machine, started once (ratios across machines mean nothing)"
        )
    ours = _settings(args)
    differ = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    if differ:
        parser.error(
            f"--append {str(path)!r} was measured with other settings (its, this run's): {differ}"
        )
    again = sorted({r.arm for r in runs} & set(args.arms))
    if again:
        parser.error(f"--append {str(path)!r} already holds the arms {again}; --arms {args.arms}")
    return runs


def _configs(args: argparse.Namespace) -> dict[str, Any]:
    from qsa_testing import EngineConfig, full_depth_qwen4_exp, tiny_qwen4_exp

    prompt = max(args.input_len, args.shared_prefix_len + args.question_len)
    longest = prompt + args.output_len + _PAGE
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
        **scheduling(args.schedule),
        "chunked_prefill_size": _CHUNK,
        "disable_cuda_graph": False,
        "cuda_graph_backend_prefill": args.prefill_graphs,
        "cuda_graph_max_bs_decode": args.max_concurrency,
        "enable_metrics": True,
    }
    if args.gpu_budget_gib is not None:  # the budget alone sizes every arm's pool
        common |= {
            "mem_fraction_static": mem_fraction(args.gpu_budget_gib),
            "max_total_tokens": None,
        }
    plugin = {**common, "radix_cache_backend": "qsa_hisparse"}
    one_prompt = {**plugin, "prefill_max_requests": 1}
    staged = {**plugin, "prefill_max_requests": args.staged_prompts}
    compat = {"SGLANG_QSA_MODEL_COMPAT": "1"}
    resident = {**compat, "SGLANG_QSA_HISPARSE_V3": "p2-resident"}
    offload = {**compat, "SGLANG_QSA_HISPARSE_V3": "p2-offload"}
    cached = {**offload, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": str(args.cache_mb)}
    every = {
        "upstream": EngineConfig(model, plugin=False, server_args=common),
        "resident": EngineConfig(model, switches=resident, server_args=plugin),
        "resident-one-prompt": EngineConfig(model, switches=resident, server_args=one_prompt),
        "offload": EngineConfig(model, switches=offload, server_args=staged),
        "offload-cache": EngineConfig(model, switches=cached, server_args=staged),
        "offload-cache-second": EngineConfig(
            model,
            switches={**cached, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT": "second"},
            server_args=staged,
        ),
    }
    return {arm: every[arm] for arm in args.arms}


def _counters(engine: Any) -> dict[str, float]:
    return {name: engine.metric(name) for name in COUNTERS}


def _held(engine: Any) -> dict[str, float]:
    names = (
        "qsa_hisparse_live_leases",
        "qsa_hisparse_offload_rows_in_use",
        "qsa_hisparse_prefix_cache_reserved_entries",
    )
    return {name: engine.metric(name) for name in names}


def workload_flags(args: argparse.Namespace, workload: str, prompts: int) -> list[str]:
    """The client's dataset flags for ``prompts`` requests of ``workload`` (module docstring)."""
    from qsa_testing import random_ids_flags, shared_prefix_flags

    if workload == "random":
        return random_ids_flags(
            prompts,
            input_len=args.input_len,
            range_ratio=args.range_ratio,
            output_len=args.output_len,
        )
    return shared_prefix_flags(
        prompts,
        prefix_len=args.shared_prefix_len,
        question_len=args.question_len,
        output_len=args.output_len,
    )


def serve(
    engine: Any,
    args: argparse.Namespace,
    workload: str,
    tokenizer: pathlib.Path,
    report: pathlib.Path,
    *,
    warm_up: bool = False,
) -> dict[str, float]:
    """Run SGLang's client with ``workload`` against ``engine``; what it measured.

    With ``warm_up``, an unmeasured run of ``--warmup-prompts`` requests (another seed) that
    compiles and captures whatever the measured run will need. A measured run flushes the
    server's caches first.
    """
    from qsa_testing import run_serving_client

    prompts, seed = (
        (args.warmup_prompts, args.seed + 1) if warm_up else (args.num_prompts, args.seed)
    )
    measured = run_serving_client(
        engine.address,
        workload_flags(args, workload, prompts),
        tokenizer=tokenizer,
        max_concurrency=args.max_concurrency,
        seed=seed,
        flush_cache=not warm_up,
        report=report,
    )
    if measured.completed != prompts:
        msg = f"{workload}: {measured.completed} of {prompts} requests completed"
        raise RuntimeError(msg)
    return dataclasses.asdict(measured)


def _workload_line(args: argparse.Namespace, workload: str) -> str:
    """The measured run's dataset flags, as the client got them."""
    return f"`{' '.join(workload_flags(args, workload, args.num_prompts))}`"


def _median(runs: list[Run], arm: str, metric: str) -> float:
    return statistics.median(r.metrics[metric] for r in runs if r.arm == arm)


def _table(runs: list[Run]) -> list[str]:
    """One workload's rows, with each run's request rate and mean TTFT over the base arm's
    (its median over repeated runs)."""
    base = next((r for r in runs if r.arm == "resident"), runs[0])
    b = {m: _median(runs, base.arm, m) for m in ("request_throughput", "mean_ttft_ms")}
    repeated = any(r.repeat for r in runs)
    lines = [
        f"| arm | req/s | req/s / {base.arm} | mean TTFT / {base.arm} | input tok/s "
        "| output tok/s | pool tokens | TTFT mean / p99 (ms) | TPOT mean / p99 (ms) "
        "| ITL mean / p99 (ms) "
        "| hits / lookups | loaded tokens | checkpoints | bytes in / out | held when idle |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | --- |",
    ]
    for run in runs:
        m, c = run.metrics, run.counters
        held = "none" if not any(run.held_after.values()) else json.dumps(run.held_after)
        label = f"{run.arm} #{run.repeat + 1}" if repeated else run.arm
        lines.append(
            f"| {label} | {m['request_throughput']:.3f} "
            f"| {m['request_throughput'] / b['request_throughput']:.2f} "
            f"| {m['mean_ttft_ms'] / b['mean_ttft_ms']:.2f} "
            f"| {m['input_throughput']:,.0f} | {m['output_throughput']:,.0f} "
            f"| {run.pool_tokens:,} "
            f"| {m['mean_ttft_ms']:,.0f} / {m['p99_ttft_ms']:,.0f} "
            f"| {m['mean_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} "
            f"| {m['mean_itl_ms']:.1f} / {m['p99_itl_ms']:.1f} "
            f"| {c['qsa_hisparse_prefix_cache_hits_total']:.0f} / "
            f"{c['qsa_hisparse_prefix_cache_lookups_total']:.0f} "
            f"| {c['qsa_hisparse_prefix_cache_loaded_tokens_total']:,.0f} "
            f"| {c['qsa_hisparse_prefix_cache_publishes_total']:.0f} "
            f"| {c['qsa_hisparse_prefix_cache_bytes_in_total'] / 2**30:.1f} / "
            f"{c['qsa_hisparse_prefix_cache_bytes_out_total'] / 2**30:.1f} GiB | {held} |"
        )
    if repeated:
        lines += _spread(runs, base.arm, b)
    return lines


def _spread(runs: list[Run], base: str, b: dict[str, float]) -> list[str]:
    """Per arm over its repeated runs: the median request rate and mean TTFT, their range, and
    the medians' ratios to ``b``, the base arm's medians."""
    lines = [
        "",
        f"| arm | runs | req/s median (min – max) | spread | req/s / {base} (medians) "
        f"| mean TTFT median (ms) | mean TTFT / {base} (medians) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arm in dict.fromkeys(r.arm for r in runs):
        rates = [r.metrics["request_throughput"] for r in runs if r.arm == arm]
        rate, ttft = _median(runs, arm, "request_throughput"), _median(runs, arm, "mean_ttft_ms")
        lines.append(
            f"| {arm} | {len(rates)} | {rate:.3f} ({min(rates):.3f} – {max(rates):.3f}) "
            f"| {max(rates) / min(rates) - 1:.0%} "
            f"| {rate / b['request_throughput']:.2f} | {ttft:,.0f} "
            f"| {ttft / b['mean_ttft_ms']:.2f} |"
        )
    return lines


def _host_line(host: dict[str, Any]) -> str:
    node = host["gpu_numa_node"]
    return (
        f"{host['cpu']}, {host['logical_cpus']} CPUs, NUMA nodes: {host['numa_nodes']} (the "
        f"GPU's: {'not reported' if node is None else node}), {host['memory_gib']} GiB"
    )


def _write(out: pathlib.Path, args: argparse.Namespace, runs: list[Run]) -> None:
    runs = [*args.earlier, *runs]
    data = write_json(
        out,
        "engine_serving",
        {"settings": _settings(args), "runs": [dataclasses.asdict(r) for r in runs]},
    )
    lines = [
        "# Serving under SGLang's own client: offload against resident, real SGLang 0.5.23 servers",
        "",
        f"GPU {data['machine']['gpu']}, torch {data['machine']['torch']}; host "
        f"{_host_line(data['machine']['host'])}; the {args.model} dummy "
        f"Qwen4Exp, decode CUDA graphs on, prefill graphs {args.prefill_graphs}, prefill chunks "
        f"of {_CHUNK}, "
        f"`--max-running-requests {args.max_concurrency}` in every arm, "
        f"`--prefill-max-requests {args.staged_prompts}` in the offload arms, 1 in "
        "`resident-one-prompt`. Client: "
        "`sglang.benchmark.serving --backend sglang --tokenize-prompt --max-concurrency "
        f"{args.max_concurrency} --flush-cache` and each workload's flags. "
        f"`{data['command']}`; written by "
        "`benchmarks/engine/engine_serving.py`. "
        + (
            "Servers started and measured one at a time, each alone on the GPU"
            if args.start == "apart"
            else "Servers started together, then measured one at a time (the others idle on "
            "the GPU)"
        )
        + (
            f" (arms {sorted({r.arm for r in args.earlier})} in an earlier call on this "
            "machine, the same boot, reported with `--append`)"
            if args.earlier
            else ""
        )
        + "; each serves every workload in turn, each measured run after an unmeasured "
        f"one of {args.warmup_prompts} requests (another seed) and a cache flush. Counters are "
        'the plugin\'s over the measured run; "held when idle" is '
        "what the plugin's gauges read once the run ended.",
    ]
    for workload in args.workloads:
        mine = [r for r in runs if r.workload == workload]
        if mine:
            lines += ["", f"## {workload}: {_workload_line(args, workload)}", "", *_table(mine)]
    (out / "engine_serving.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _measure(
    engine: Any, arm: str, args: argparse.Namespace, tokenizer: pathlib.Path, workdir: pathlib.Path
) -> list[Run]:
    """Drive one arm's server with each workload in turn: a warm-up, then ``--repeats`` runs."""
    runs: list[Run] = []
    for workload in args.workloads:
        began = time.monotonic()
        warm = workdir / f"{arm}-{workload}-warm-up.jsonl"
        serve(engine, args, workload, tokenizer, warm, warm_up=True)
        for repeat in range(args.repeats):
            before = _counters(engine)
            result = workdir / f"{arm}-{workload}-{repeat}.jsonl"
            metrics = serve(engine, args, workload, tokenizer, result)
            after = _counters(engine)
            gained = {name: after[name] - before[name] for name in COUNTERS}
            runs.append(
                Run(arm, workload, metrics, gained, _held(engine), repeat, pool_tokens(engine))
            )
            print(
                f"{arm} {workload} #{repeat + 1}: {metrics} ({time.monotonic() - began:.0f} s)",
                flush=True,
            )
    return runs


def main(argv: list[str]) -> int:
    """Start the arms' servers, drive each with every workload in turn, write the report."""
    args = _parse_args(argv)
    if lacks_cuda("engine_serving"):
        return SKIPPED
    from qsa_testing import start_engine, word_level_tokenizer

    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="qsa-engine-serving-"))
    configs = _configs(args)
    model = next(iter(configs.values())).model
    tokenizer = word_level_tokenizer(workdir / "client-tokenizer", model.vocab_size)
    runs: list[Run] = []

    def start(arm: str) -> Any:
        started = time.monotonic()
        engine = start_engine(configs[arm], workdir / arm, timeout=900.0)
        print(f"{arm}: up in {time.monotonic() - started:.0f} s", flush=True)
        return engine

    if args.start == "apart":
        for arm in configs:  # one server at a time: each has the GPU to itself
            with start(arm) as engine:
                runs += _measure(engine, arm, args, tokenizer, workdir)
                _write(args.out, args, runs)
        return 0
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(configs)) as pool:
        starting = {arm: pool.submit(start, arm) for arm in configs}
        wait(starting.values())
        for future in starting.values():  # every server that came up stops, whatever failed
            if future.exception() is None:
                stack.enter_context(future.result())
        engines = {arm: future.result() for arm, future in starting.items()}  # raises a failure
        for arm, engine in engines.items():  # measured one at a time; the others wait idle
            runs += _measure(engine, arm, args, tokenizer, workdir)
            _write(args.out, args, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
