"""Benchmark the host prefix cache in a real SGLang 0.5.23 engine: warm against cold TTFT.

One engine serves a dummy Qwen4Exp with ``p2-offload`` and ``SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB``,
decode CUDA graphs on, SGLang's overlap scheduling (``--schedule serial``: none) and prefill graphs
as ``--prefill-graphs`` says (``breakable``, SGLang's default on CUDA, or ``disabled``):
``--model full-depth`` (the default) has Qwen3.8-Flash-Next's
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

With ``--store URL`` (``file:///DIR[?max_mb=N]`` or ``mooncake://HOST:PORT[?segment_mb=N]``,
``SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE``) the engine has the shared tier below its arena, and
each context measures a third TTFT, warm from the store:

4. store-warm: once the RAM-warm requests are done and the store's write-throughs have ended,
   ``/flush_cache`` empties the arena, and the turn-2 prompt under turn 1's salt is sent again:
   its ``C`` tokens are read from the store (``cached_tokens_details`` must say ``storage`` for
   all ``C``: none from the device or the arena), verified, copied into the arena and restored;
   its greedy tokens are compared with the cold run's, as the RAM-warm ones are.

The same engine after a flush, not a second engine: SGLang's ``flush_cache`` calls the tree
cache's ``reset``, which drops the arena only (``PromptCache.invalidate`` ends in the arena's
``invalidate_all``); the store keeps its objects, and their names' scope (the weights' version)
does not change with a flush. The request then takes the path a replica with an empty arena
takes (the arena misses, the store is asked, its checkpoint verified, copied into the arena and
restored), without a second engine start (1 to 3 minutes of GPU time each). What it does not
show: the first request of a process (every kernel is compiled here, and the warm-up reads the
store once after a flush of its own), and, for ``file://``, a read from the disk itself (the
file was just written, so it is likely read from the page cache, as by another process of the
same host soon after).

Turn 1's checkpoint must reach the store: at most 4 write-throughs run at once and a checkpoint
beyond stays in RAM only, and a cold prefill publishes a checkpoint at every chunk end. So with
``--store`` a context longer than one chunk is first prefilled up to its last page under turn 1's
salt (the prime, unmeasured), the store's write-throughs are waited for (its write counters
unchanged for ``--store-quiet`` seconds), and turn 1 then loads that checkpoint from RAM and
publishes one checkpoint, its own, which is waited for in the store (an error if it stayed in
RAM). Every salt carries a tag of the run, so a ``file://`` directory kept from an earlier run
answers nothing. A write-through is counted only when it ends, so one that runs longer than
``--store-quiet`` (default 8 s; a 3.3 GB checkpoint at 131,072 tokens takes a few seconds to a
local directory) is not waited for: raise it for a slow store. A ``file://`` store wants a
``max_mb``: every chunk end's checkpoint is written whole (at 131,072 tokens, tens of GB per
context before the least recently used files go), and the GPU machine's disk holds 64 GiB;
``max_mb=16384`` keeps turn 1's and turn 2's. The cold and RAM-warm requests of this engine
pay what the store costs them (a cold request's lookup in the store, the write-through threads
of earlier requests). Reported besides: the three TTFTs, their ratios (cold / RAM, cold /
store, store / RAM), the bytes read from the store for the store-warm request and their rate
over its TTFT (a lower bound on the store's read bandwidth, the arena copy and the restore
included).

Writes ``<out>/engine_prefix_cache.md`` and ``.json`` after every context
(``engine_prefix_cache-store.md`` and ``.json`` with ``--store``: the table above, then the
store's). Needs CUDA and SGLang: ``nox -s gpu-engine-bench -- prefix_cache ...`` runs it on the
GPU machine with the engine payload; exits with status 77 without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time
import uuid
from typing import Any

from _engine_bench import (
    PREFILL_GRAPHS,
    SKIPPED,
    lacks_cuda,
    profile_request,
    schedule_arg,
    scheduling,
    write_json,
)
from _trace import summarize

_PAGE = 64
#: The shared tier's counters (``qsa_hisparse_prefix_cache_shared_<name>_total``, every tier).
_SHARED = "qsa_hisparse_prefix_cache_shared_{}_total"
#: What moves while a write-through to the store runs or ends.
_WRITING = ("writes", "puts", "errors", "unavailable", "bytes_written")
#: Seconds a wait for the store's write-throughs may take before it is an error.
_STORE_TIMEOUT_S = 300.0
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
    store: StoreRow | None = None


@dataclasses.dataclass
class StoreRow:
    """One context's turn-2 request warm from the shared tier (``--store``), after a flush.

    Attributes:
        ttft_s: its TTFT (``first_token_latency``).
        wall_s: the client's time for the whole request.
        cached_tokens: prompt tokens it reported cached (all from ``storage``: checked).
        read_bytes: object bytes read from the store meanwhile.
        restored_bytes: checkpoint bytes restored from the arena to the GPU meanwhile.
        same_tokens: its greedy tokens are the cold run's.
        first_difference: else the first step that differs.
        tie_gap: and the cold run's top-2 logprob gap there (:func:`_divergence`).
    """

    ttft_s: float
    wall_s: float
    cached_tokens: int
    read_bytes: int
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
    schedule_arg(parser)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also trace one more warm request per context (profile-warm-<context>.txt)",
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="the prefix cache's shared tier (file:///DIR[?max_mb=N] or "
        "mooncake://HOST:PORT[?segment_mb=N]): also measure turn 2 warm from it",
    )
    parser.add_argument(
        "--store-quiet",
        type=float,
        default=8.0,
        metavar="SECONDS",
        help="with --store: the store's write-throughs count as ended once its write counters "
        "stay unchanged this long",
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
    if args.store_quiet <= 0:
        parser.error(f"--store-quiet {args.store_quiet!r} is not allowed; allowed: seconds > 0")
    if args.store is not None:
        from qsa_hostcache import CacheConfigError, parse_store_address

        try:
            parse_store_address(args.store)
        except CacheConfigError as exc:
            parser.error(f"--store: {exc}")
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
            **(
                {} if args.store is None else {"SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE": args.store}
            ),
        },
        server_args={
            "context_length": longest,
            "max_running_requests": 2,
            "prefill_max_requests": 1,
            **scheduling(args.schedule),
            "max_total_tokens": 2 * longest,
            "chunked_prefill_size": args.chunk,
            "disable_cuda_graph": False,
            "cuda_graph_backend_prefill": args.prefill_graphs,
            "radix_cache_backend": "qsa_hisparse",
            "enable_metrics": True,
        },
    )


def _timed(engine: Any, request: Any) -> tuple[Any, dict[str, Any], float]:
    """The generation, its reply's ``meta_info`` and the client's seconds for the request."""
    from qsa_testing import Generation

    started = time.monotonic()
    reply = engine.post_json("/generate", request.body(), timeout=1800.0)
    wall = time.monotonic() - started
    return Generation.from_reply(reply), reply["meta_info"], wall


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
    salt = f"turn-{context}-{args.tag}"

    def request(new_tokens: int, cache_salt: str) -> Any:
        return GenerateRequest(turn2, new_tokens, top_logprobs=2, cache_salt=cache_salt)

    if args.store is not None:
        _settle(engine, args.store_quiet)  # the previous context's write-throughs
    # Cold first, under a salt of its own: nothing matches, and the checkpoints it publishes are
    # older than turn 1's, so a budget smaller than both evicts the cold request's first.
    cold, _, cold_wall = _timed(engine, request(args.new_tokens, f"cold-{salt}"))
    if args.store is not None:
        if context > args.chunk:
            # The prime: every chunk end but turn 1's own prompt end, so turn 1 publishes one
            # checkpoint, with no write-through in flight to crowd it out of the store.
            prime = GenerateRequest(turn1[: context - _PAGE], 2, top_logprobs=0, cache_salt=salt)
            engine.generate(prime, timeout=1800.0)
        _settle(engine, args.store_quiet)
    mark = None if args.store is None else _WriteMark.take(engine)
    # Two tokens: a request that ends in the batch completing its prompt publishes no prompt end.
    engine.generate(GenerateRequest(turn1, 2, top_logprobs=0, cache_salt=salt), timeout=1800.0)
    if mark is not None:
        mark.wait_written(engine, context)
    before = engine.metric("qsa_hisparse_prefix_cache_bytes_out_total")
    warm, _, warm_wall = _timed(engine, request(args.new_tokens, salt))
    restored = int(engine.metric("qsa_hisparse_prefix_cache_bytes_out_total") - before)
    # The same hit once more: kernels are compiled for this context's shapes by now.
    again = engine.generate(request(args.new_tokens, salt), timeout=1800.0)
    # The suffix alone, nothing cached: what any request of that length costs.
    alone = engine.generate(
        GenerateRequest(
            turn2[context:], args.new_tokens, top_logprobs=0, cache_salt=f"alone-{args.tag}"
        ),
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
    store = None
    if args.store is not None:
        store = _from_store(engine, args, context, request(args.new_tokens, salt), cold)
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
        store,
    )


def _from_store(
    engine: Any, args: argparse.Namespace, context: int, request: Any, cold: Any
) -> StoreRow:
    """Turn 2 once more after a flush: its ``context`` tokens from the store alone."""
    _settle(engine, args.store_quiet)  # nothing written meanwhile, and nothing cut off
    read = _shared(engine, "bytes_read")
    out = engine.metric("qsa_hisparse_prefix_cache_bytes_out_total")
    engine.flush_cache()  # the arena only: the store keeps every object
    warm, meta, wall = _timed(engine, request)
    read = int(_shared(engine, "bytes_read") - read)
    restored = int(engine.metric("qsa_hisparse_prefix_cache_bytes_out_total") - out)
    details = meta.get("cached_tokens_details")
    if warm.cached_tokens != context or details != {"device": 0, "host": 0, "storage": context}:
        msg = (
            f"{context}-token turn after a flush: {warm.cached_tokens} cached tokens "
            f"({details!r}); expected {context}, all from storage"
        )
        raise RuntimeError(msg)
    step, gap = _divergence(cold, warm)
    return StoreRow(
        _server_seconds(warm), wall, warm.cached_tokens, read, restored, step is None, step, gap
    )


def _shared(engine: Any, counter: str) -> float:
    """The shared tier's ``counter`` (``writes``, ``bytes_read``...), summed over its tiers."""
    return float(engine.metric(_SHARED.format(counter)))


def _settle(engine: Any, quiet_s: float) -> None:
    """Wait until the store's write-throughs have ended: its write counters unchanged for
    ``quiet_s`` seconds (a write-through in flight is not counted until it ends).

    Raises:
        RuntimeError: they still moved after :data:`_STORE_TIMEOUT_S` seconds.
    """
    started = time.monotonic()
    last: tuple[float, ...] = ()
    since = started
    while True:
        now = tuple(_shared(engine, c) for c in _WRITING)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        if time.monotonic() - started > _STORE_TIMEOUT_S:
            msg = f"the store's write counters still moved after {_STORE_TIMEOUT_S:.0f} s"
            raise RuntimeError(msg)
        time.sleep(0.25)


@dataclasses.dataclass(frozen=True)
class _WriteMark:
    """The engine's log length and the store's write counters before a request."""

    log_bytes: int
    writes: float
    errors: float

    @classmethod
    def take(cls, engine: Any) -> _WriteMark:
        return cls(
            engine.log_path.stat().st_size, _shared(engine, "writes"), _shared(engine, "errors")
        )

    def wait_written(self, engine: Any, context: int) -> None:
        """Wait until the request's ``context``-token checkpoint is in the store, the only write
        since the mark.

        Raises:
            RuntimeError: the engine logged since the mark that it stayed in RAM, a
                write-through failed, or none ended within :data:`_STORE_TIMEOUT_S` seconds.
        """
        started = time.monotonic()
        while _shared(engine, "writes") < self.writes + 1:
            with engine.log_path.open("rb") as log:
                log.seek(self.log_bytes)
                text = log.read().decode("utf-8", "replace")
            if f"checkpoint of {context} tokens stays in the arena only" in text:
                msg = f"turn 1's {context}-token checkpoint stayed in RAM: write-throughs in flight"
                raise RuntimeError(msg)
            if "to the shared tier failed" in text or _shared(engine, "errors") > self.errors:
                msg = (
                    f"writing turn 1's {context}-token checkpoint to the store failed; see the log"
                )
                raise RuntimeError(msg)
            if time.monotonic() - started > _STORE_TIMEOUT_S:
                msg = (
                    f"turn 1's {context}-token checkpoint not in the store after "
                    f"{_STORE_TIMEOUT_S:.0f} s"
                )
                raise RuntimeError(msg)
            time.sleep(0.25)


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
    out: pathlib.Path,
    model: str,
    new_tokens: int,
    prefill_graphs: str,
    rows: list[Row],
    *,
    store: str | None = None,
) -> None:
    """``<out>/engine_prefix_cache.md`` and ``.json`` (``engine_prefix_cache-store`` with a
    store: the same table, then the store's, :func:`_store_lines`)."""
    name = "engine_prefix_cache" if store is None else "engine_prefix_cache-store"
    fields: dict[str, Any] = {"model": model, "prefill_graphs": prefill_graphs}
    if store is not None:
        fields["store"] = store
    fields["rows"] = [_row_fields(r) for r in rows]
    data = write_json(out, name, fields)
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
    if store is not None:
        lines += ["", *_store_lines(store, rows)]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _row_fields(row: Row) -> dict[str, Any]:
    """A row as the JSON holds it (no ``store`` key without a store, as before it existed)."""
    fields = dataclasses.asdict(row)
    if row.store is None:
        del fields["store"]
    return fields


def _ratios(row: Row, store: StoreRow) -> tuple[float, float, float]:
    """TTFT cold / RAM-warm, cold / store-warm and store-warm / RAM-warm."""
    return (
        row.cold_ttft_s / row.warm_ttft_s,
        row.cold_ttft_s / store.ttft_s,
        store.ttft_s / row.warm_ttft_s,
    )


def _store_lines(store: str, rows: list[Row]) -> list[str]:
    """The markdown section of the store-warm requests of ``rows`` (those measured with one)."""
    lines = [
        f"## Warm from the shared tier: `{store}`",
        "",
        "After the RAM-warm requests and the store's write-throughs, `/flush_cache` empties the "
        "arena (the store keeps its objects) and the turn-2 prompt is sent once more: its turn-1 "
        "tokens are read from the store, verified, copied into the arena and restored "
        "(`cached_tokens_details`: all `storage`, checked). The engine had the store on for "
        "every request, so the cold and RAM-warm TTFTs include what the store costs them. Read: "
        "the object bytes the store gave meanwhile; MiB/s: over the store-warm TTFT (a lower "
        "bound on the store's read bandwidth).",
        "",
        "| turn-1 tokens | cold TTFT s | RAM-warm TTFT s | store-warm TTFT s | cold / RAM "
        "| cold / store | store / RAM | cached tokens from storage | read from the store MiB "
        "| read MiB/s of store-warm TTFT | store-warm wall s | same greedy tokens as cold (else: "
        "first differing step, the cold run's top-2 logprob gap there) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r.store is None:
            continue
        s = r.store
        cold_ram, cold_store, store_ram = _ratios(r, s)
        mib = s.read_bytes / (1 << 20)
        lines.append(
            f"| {r.context:,} | {r.cold_ttft_s:.3f} | {r.warm_ttft_s:.3f} | {s.ttft_s:.3f} | "
            f"{cold_ram:.1f} | {cold_store:.1f} | {store_ram:.2f} | {s.cached_tokens:,} | "
            f"{mib:,.1f} | {mib / s.ttft_s:,.0f} | {s.wall_s:.3f} | {_same(s)} |"
        )
    return lines


def _store_progress(row: Row, store: StoreRow) -> str:
    """The progress line of one context's store-warm request."""
    cold_ram, cold_store, store_ram = _ratios(row, store)
    mib = store.read_bytes / (1 << 20)
    return (
        f"engine_prefix_cache: {row.context:>7} tokens: TTFT store-warm {store.ttft_s:.3f} s "
        f"(cold / RAM {cold_ram:.1f}x, cold / store {cold_store:.1f}x, store / RAM "
        f"{store_ram:.2f}x; wall {store.wall_s:.3f} s), {mib:,.1f} MiB read from the store "
        f"({mib / store.ttft_s:,.0f} MiB/s of its TTFT), same tokens: {_same(store)}"
    )


def _same(row: Row | StoreRow) -> str:
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

    args.tag = uuid.uuid4().hex[:12]  # in every salt: a store kept from another run answers none
    started = time.monotonic()
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="qsa-prefix-bench-"))
    with start_engine(_config(args), workdir / "prefix_cache", timeout=900.0) as engine:
        # Compile every kernel once (prefill with and without a prefix, the restore path).
        warmup = engine.config.model.prompt(2 * args.chunk, seed=7)
        request = GenerateRequest(
            warmup + (11,) * 64, 2, top_logprobs=0, cache_salt=f"warmup-{args.tag}"
        )
        for _ in range(2):
            engine.generate(request)
        if args.store is not None:  # and the store's read path, from an empty arena
            _settle(engine, args.store_quiet)
            engine.flush_cache()
            engine.generate(request)
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
            if row.store is not None:
                print(_store_progress(row, row.store), flush=True)
            _write(
                args.out,
                _MODELS[args.model],
                args.new_tokens,
                args.prefill_graphs,
                rows,
                store=args.store,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
