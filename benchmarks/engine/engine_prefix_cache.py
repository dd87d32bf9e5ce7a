"""Benchmark the host prefix cache in a real SGLang 0.5.23 engine: warm against cold TTFT.

One engine serves a dummy Qwen4Exp with ``p2-offload`` and ``SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB``,
decode CUDA graphs on and prefill graphs as ``--prefill-graphs`` says (``breakable``, SGLang's
default on CUDA, or ``disabled``): ``--model full-depth`` (the default) has Qwen3.8-Flash-Next's
48 layers and the real width of every attention and GDN layer, small experts
(:func:`qsa_testing.full_depth_qwen4_exp`), so a cold prefill costs about what the real model's
does (less: its experts are small); ``--model shaped`` has one QSA layer of the real geometry and
three small GDN layers, where the fixed costs of a request dominate. For each context length
``C`` (a multiple of 64):

1. cold: the turn-2 prompt (a ``C``-token turn 1 plus ``--suffix`` new tokens) under a
   ``cache_salt`` of its own, so nothing matches: every token is prefilled;
2. turn 1: the ``C``-token prompt, two generated tokens (its prompt end is checkpointed);
3. warm: the turn-2 prompt under turn 1's salt: ``C`` tokens come from the host prefix cache
   (``cached_tokens`` is checked), only the suffix is prefilled.

Reported per context: the cold and warm time to first token as SGLang measures it
(``first_token_latency``: from the server's receipt of the request to its prefill's end), their
ratio, the TTFT of the same hit once more (every kernel compiled for the context's shapes by
then), the TTFT of the suffix alone as a prompt of its own (nothing cached: the floor of any
request of that length), the client's wall time of each whole request (``--new-tokens`` greedy
tokens over HTTP, which must agree), the checkpoint bytes restored and the bytes per second of
the warm TTFT (a lower bound on the restore bandwidth; the library's own ``bench_hostcache.py``
measures the copy alone against a pinned host-to-device copy).

With ``--profile``, one more warm request per context runs under SGLang's torch profiler
(``/start_profile`` to ``/stop_profile``: every scheduling round and step in between), summarised
in ``<out>/profile-warm-<C>.txt`` (:mod:`_trace`), the trace under ``<out>/traces``.

Writes ``<out>/engine_prefix_cache.md`` and ``.json`` after every context. Needs CUDA and SGLang:
``nox -s gpu-engine-bench -- prefix_cache ...`` runs it on the GPU machine with the engine
payload; exits with status 77 without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time
from typing import Any

from _engine_bench import PREFILL_GRAPHS, SKIPPED, lacks_cuda, profile_request, write_json
from _trace import summarize

_PAGE = 64
_MODELS = {
    "full-depth": "the full-depth dummy Qwen4Exp (48 layers, 12 QSA, the real attention and GDN "
    "widths, 4 small experts)",
    "shaped": "the model-shaped tiny Qwen4Exp (one QSA layer of the real geometry, three small GDN "
    "layers)",
}


@dataclasses.dataclass
class Row:
    """One context length's measurement."""

    context: int
    suffix: int
    cold_ttft_s: float
    warm_ttft_s: float
    warm_again_ttft_s: float
    alone_ttft_s: float
    cold_wall_s: float
    warm_wall_s: float
    cached_tokens: int
    restored_bytes: int
    same_tokens: bool
    first_difference: int | None
    tie_gap: float | None


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="32768,131072,262144", help="turn-1 prompt lengths")
    parser.add_argument(
        "--model", choices=("full-depth", "shaped"), default="full-depth", help="the dummy model"
    )
    parser.add_argument("--suffix", type=int, default=64, help="new tokens of turn 2")
    parser.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size")
    parser.add_argument("--budget-mb", type=int, default=32768, help="prefix cache MiB")
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy tokens compared")
    parser.add_argument(
        "--prefill-graphs",
        choices=PREFILL_GRAPHS,
        default=PREFILL_GRAPHS[0],
        help="--cuda-graph-backend-prefill (decode graphs are on)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also trace one more warm request per context (profile-warm-<context>.txt)",
    )
    parser.add_argument(
        "--deadline", type=float, default=float("inf"), help="seconds; no context starts after it"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",")]
    bad = [c for c in args.contexts if c < _PAGE or c % _PAGE]
    if bad:
        parser.error(f"--contexts {bad!r} are not allowed; allowed: multiples of {_PAGE}")
    for flag, value in (("--suffix", args.suffix), ("--chunk", args.chunk)):
        if value < 1:
            parser.error(f"{flag} {value!r} is not allowed; allowed: a positive integer")
    if args.chunk % _PAGE:
        parser.error(f"--chunk {args.chunk!r} is not allowed; allowed: a multiple of {_PAGE}")
    return args


def _config(args: argparse.Namespace) -> Any:
    from qsa_testing import EngineConfig, full_depth_qwen4_exp, tiny_qwen4_exp

    longest = max(args.contexts) + args.suffix + args.new_tokens + 64
    if args.model == "full-depth":
        model = full_depth_qwen4_exp(max_position_embeddings=longest)
    else:
        model = tiny_qwen4_exp(model_shaped=True, max_position_embeddings=longest)
    return EngineConfig(
        model,
        switches={
            "SGLANG_QSA_MODEL_COMPAT": "1",
            "SGLANG_QSA_HISPARSE_V3": "p2-offload",
            "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": str(args.budget_mb),
        },
        server_args={
            "context_length": longest,
            "max_running_requests": 2,
            "prefill_max_requests": 1,
            "disable_overlap_schedule": True,
            "max_total_tokens": 2 * longest,
            "chunked_prefill_size": args.chunk,
            "disable_cuda_graph": False,
            "cuda_graph_backend_prefill": args.prefill_graphs,
            "radix_cache_backend": "qsa_hisparse",
            "enable_metrics": True,
        },
    )


def _timed(engine: Any, request: Any) -> tuple[Any, float]:
    started = time.monotonic()
    reply = engine.generate(request, timeout=1800.0)
    return reply, time.monotonic() - started


def _server_seconds(reply: Any) -> float:
    if reply.first_token_s is None:
        msg = "the reply carries no first_token_latency; the engine needs --enable-metrics"
        raise RuntimeError(msg)
    return float(reply.first_token_s)


def _measure(engine: Any, args: argparse.Namespace, context: int) -> Row:
    from qsa_testing import GenerateRequest

    model = engine.config.model
    turn1 = model.prompt(context, seed=context)
    turn2 = turn1 + model.prompt(args.suffix, seed=context + 1)
    salt = f"turn-{context}"

    def request(new_tokens: int, cache_salt: str) -> Any:
        return GenerateRequest(turn2, new_tokens, top_logprobs=2, cache_salt=cache_salt)

    # Cold first, under a salt of its own: nothing matches, and the checkpoints it publishes are
    # older than turn 1's, so a budget smaller than both evicts the cold request's first.
    cold, cold_wall = _timed(engine, request(args.new_tokens, f"cold-{salt}"))
    # Two tokens: a request that ends in the batch completing its prompt publishes no prompt end.
    engine.generate(GenerateRequest(turn1, 2, top_logprobs=0, cache_salt=salt), timeout=1800.0)
    before = engine.metric("qsa_hisparse_prefix_cache_bytes_out_total")
    warm, warm_wall = _timed(engine, request(args.new_tokens, salt))
    restored = int(engine.metric("qsa_hisparse_prefix_cache_bytes_out_total") - before)
    # The same hit once more: kernels are compiled for this context's shapes by now.
    again = engine.generate(request(args.new_tokens, salt), timeout=1800.0)
    # The suffix alone, nothing cached: what any request of that length costs.
    alone = engine.generate(
        GenerateRequest(turn2[context:], args.new_tokens, top_logprobs=0, cache_salt="alone"),
        timeout=1800.0,
    )
    if cold.cached_tokens != 0 or warm.cached_tokens != context or again.cached_tokens != context:
        msg = (
            f"{context}-token turn: cached tokens cold {cold.cached_tokens}, warm "
            f"{warm.cached_tokens} and {again.cached_tokens}; expected 0 and {context}"
        )
        raise RuntimeError(msg)
    step, gap = _divergence(cold, warm)
    if args.profile:
        trace = profile_request(engine, request(1, salt), args.out / "traces", f"warm-{context}")
        summary = args.out / f"profile-warm-{context}.txt"
        summary.write_text(summarize(trace, top=60), encoding="utf-8")
        print(f"engine_prefix_cache: {context} warm request profiled: {summary}", flush=True)
    return Row(
        context,
        args.suffix,
        _server_seconds(cold),
        _server_seconds(warm),
        _server_seconds(again),
        _server_seconds(alone),
        cold_wall,
        warm_wall,
        warm.cached_tokens,
        restored,
        step is None,
        step,
        gap,
    )


def _divergence(cold: Any, warm: Any) -> tuple[int | None, float | None]:
    """The first step whose greedy tokens differ, and how close the cold run's choice was there.

    The gap is the cold run's logprob of its own token less that of the warm run's token (both
    among the cold step's top 2; ``None`` if the warm token is not there): a gap near zero is a
    near-tie that bf16 rounding can flip, a large one a wrong prefix.
    """
    for step, (a, b) in enumerate(zip(cold.output_ids, warm.output_ids, strict=True)):
        if a != b:
            tops = dict(cold.top_logprobs[step])
            gap = None if b not in tops else tops[a] - tops[b]
            return step, gap
    return None, None


def _write(
    out: pathlib.Path, model: str, new_tokens: int, prefill_graphs: str, rows: list[Row]
) -> None:
    data = write_json(
        out,
        "engine_prefix_cache",
        {
            "model": model,
            "prefill_graphs": prefill_graphs,
            "rows": [dataclasses.asdict(r) for r in rows],
        },
    )
    device, torch_version, command = (
        data["machine"]["gpu"],
        data["machine"]["torch"],
        data["command"],
    )
    lines = [
        "# Host prefix cache: warm against cold time to first token, a real SGLang 0.5.23 engine",
        "",
        f"GPU {device}, torch {torch_version}; {model}, with p2-offload and the host prefix "
        f"cache, decode CUDA graphs on, prefill graphs {prefill_graphs}. TTFT: SGLang's "
        "`first_token_latency` (from the server's receipt of the request to its prefill's "
        "end); wall: the client's time for the whole "
        f"request over HTTP ({new_tokens} greedy tokens, compared). `{command}`; written by "
        "`benchmarks/engine/engine_prefix_cache.py`.",
        "",
        "| turn-1 tokens | new prompt tokens | cold TTFT s | warm TTFT s | cold / warm "
        "| warm again TTFT s | suffix alone TTFT s | cold / warm wall s | cached tokens "
        "| restored MiB "
        "| restored MiB/s of warm TTFT | same greedy tokens (else: first differing step, the "
        "cold run's top-2 logprob gap there) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        mib = r.restored_bytes / (1 << 20)
        lines.append(
            f"| {r.context:,} | {r.suffix} | {r.cold_ttft_s:.3f} | {r.warm_ttft_s:.3f} | "
            f"{r.cold_ttft_s / r.warm_ttft_s:.1f} | {r.warm_again_ttft_s:.3f} | "
            f"{r.alone_ttft_s:.3f} | "
            f"{r.cold_wall_s:.3f} / {r.warm_wall_s:.3f} | "
            f"{r.cached_tokens:,} | {mib:,.1f} | {mib / r.warm_ttft_s:,.0f} | "
            f"{_same(r)} |"
        )
    (out / "engine_prefix_cache.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _same(row: Row) -> str:
    if row.same_tokens:
        return "yes"
    gap = "not in the top 2" if row.tie_gap is None else f"gap {row.tie_gap:.2e}"
    return f"no: step {row.first_difference}, {gap}"


def main(argv: list[str]) -> int:
    """Start the engine, measure every context, write the report."""
    args = _parse_args(argv)
    if lacks_cuda("engine_prefix_cache"):
        return SKIPPED
    from qsa_testing import GenerateRequest, start_engine

    started = time.monotonic()
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="qsa-prefix-bench-"))
    with start_engine(_config(args), workdir / "prefix_cache", timeout=900.0) as engine:
        # Compile every kernel once (prefill with and without a prefix, the restore path).
        warmup = engine.config.model.prompt(2 * args.chunk, seed=7)
        for _ in range(2):
            engine.generate(GenerateRequest(warmup + (11,) * 64, 2, top_logprobs=0))
        print(f"engine_prefix_cache: engine up after {time.monotonic() - started:.0f} s")
        rows: list[Row] = []
        for context in args.contexts:
            if time.monotonic() - started > args.deadline:
                print(f"engine_prefix_cache: deadline reached before {context}")
                break
            row = _measure(engine, args, context)
            rows.append(row)
            print(
                f"engine_prefix_cache: {context:>7} tokens: TTFT cold {row.cold_ttft_s:.3f} s, "
                f"warm {row.warm_ttft_s:.3f} s ({row.cold_ttft_s / row.warm_ttft_s:.1f}x; wall "
                f"{row.cold_wall_s:.3f} / {row.warm_wall_s:.3f} s), "
                f"{row.restored_bytes / (1 << 20):,.1f} MiB restored, same tokens: {_same(row)}",
                flush=True,
            )
            _write(args.out, _MODELS[args.model], args.new_tokens, args.prefill_graphs, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
