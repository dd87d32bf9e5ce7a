"""``nox -s demo``: QSA HiSparse serving inside a real SGLang 0.5.23 engine, on this machine.

Prints the per-rank memory plan of Qwen3.8-Flash-Next with and without host offload, then starts a
real SGLang engine with the plugin (``p2-offload`` and the host prefix cache) on the tiny dummy
Qwen4Exp (random weights, one QSA layer), sends a few requests that share a long prefix, and
reports what the engine did: how many prompt tokens came from the host prefix cache, the bytes on
the host, the hot cache's hit rate, and that every lease came back. On a machine without a GPU the
engine runs with this package's named stand-ins for SGLang's CUDA-only kernels (see
``docs/testing.md``); the plugin's paths are the real ones.

Run: ``python -m qsa_testing.demo [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from qsa_core.cli import main as plan_main
from qsa_testing._engine import Engine, EngineConfig, GenerateRequest, start_engine
from qsa_testing._models import tiny_qwen4_exp

__all__ = ("DEMO_ENGINE", "Served", "main", "render_report")

_MODEL: Final = tiny_qwen4_exp()
#: The plugin's serving configuration for the tiny model (README "Serve", scaled down).
DEMO_ENGINE: Final = EngineConfig(
    _MODEL,
    switches={
        "SGLANG_QSA_MODEL_COMPAT": "1",
        "SGLANG_QSA_HISPARSE_V3": "p2-offload",
        "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64",
    },
    server_args={
        "radix_cache_backend": "qsa_hisparse",
        "enable_metrics": True,
        "enable_cache_report": True,
        "max_running_requests": 4,
        "prefill_max_requests": 2,
        "context_length": 8192,
        "chunked_prefill_size": 1024,
        "cuda_graph_backend_prefill": "disabled",
    },
)
#: A shared 3,100-token prefix (a long system prompt or document; checkpointed at 1,024, 2,048
#: and 3,072 tokens) followed by each user's own 200 tokens.
_SHARED_TOKENS: Final = 3100
_USER_TOKENS: Final = 200
_USERS: Final = ("alice", "bob", "carol")
_NEW_TOKENS: Final = 32


@dataclass(frozen=True, slots=True)
class Served:
    """One request of the demo as the engine answered it."""

    who: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float


def _requests() -> list[tuple[str, GenerateRequest]]:
    shared = _MODEL.prompt(_SHARED_TOKENS, seed=1)
    return [
        (who, GenerateRequest(shared + _MODEL.prompt(_USER_TOKENS, seed=10 + i), _NEW_TOKENS))
        for i, who in enumerate(_USERS)
    ]


def _serve(engine: Engine) -> list[Served]:
    served = []
    for who, request in _requests():
        started = time.monotonic()
        reply = engine.generate(request)
        served.append(
            Served(who, reply.prompt_tokens, reply.cached_tokens, time.monotonic() - started)
        )
    return served


def _metrics(engine: Engine) -> dict[str, float]:
    names = (
        "qsa_hisparse_host_arena_bytes",
        "qsa_hisparse_offload_decode_steps_total",
        "qsa_hisparse_selected_blocks_total",
        "qsa_hisparse_fetched_blocks_total",
        "qsa_hisparse_prefix_cache_publishes_total",
        "qsa_hisparse_prefix_cache_bytes_in_total",
        "qsa_hisparse_prefix_cache_payload_bytes",
        "qsa_hisparse_prefix_cache_loaded_tokens_total",
        "qsa_hisparse_prefix_cache_pinned_memory",
        "qsa_hisparse_live_leases",
        "qsa_hisparse_offload_rows_in_use",
    )
    return {name: engine.metric(name) for name in names}


def _mib(value: float) -> str:
    return f"{value / (1 << 20):,.1f} MiB"


def render_report(served: Sequence[Served], metrics: dict[str, float]) -> str:
    """The demo's report: one line per request, then what the plugin's metrics say."""
    m = metrics
    lines = ["", "Served by SGLang 0.5.23 with QSA HiSparse (p2-offload + host prefix cache):", ""]
    lines.append(f"  {'request':<8} {'prompt tokens':>13} {'from host cache':>15} {'seconds':>8}")
    lines += [
        f"  {s.who:<8} {s.prompt_tokens:>13,} {s.cached_tokens:>15,} {s.seconds:>8.1f}"
        for s in served
    ]
    selected = m["qsa_hisparse_selected_blocks_total"]
    fetched = m["qsa_hisparse_fetched_blocks_total"]
    hit_rate = 1.0 - fetched / selected if selected else 0.0
    memory = "pinned" if m["qsa_hisparse_prefix_cache_pinned_memory"] else "pageable"
    lines += [
        "",
        f"  K/V history of the QSA layer on the host: arena of "
        f"{_mib(m['qsa_hisparse_host_arena_bytes'])}; decode steps read it there "
        f"({int(m['qsa_hisparse_offload_decode_steps_total']):,} steps).",
        f"  Hot cache: {int(selected):,} selected blocks, {int(fetched):,} fetched from the host "
        f"(hit rate {hit_rate:.3f}).",
        f"  Host prefix cache ({memory}): {int(m['qsa_hisparse_prefix_cache_publishes_total'])} "
        f"checkpoints written ({_mib(m['qsa_hisparse_prefix_cache_bytes_in_total'])}), "
        f"{_mib(m['qsa_hisparse_prefix_cache_payload_bytes'])} held now; "
        f"{int(m['qsa_hisparse_prefix_cache_loaded_tokens_total']):,} prompt tokens served from "
        "it instead of computed.",
        f"  Leases held now: {int(m['qsa_hisparse_live_leases'])}; host arena rows in use: "
        f"{int(m['qsa_hisparse_offload_rows_in_use'])}.",
        "",
    ]
    return "\n".join(lines)


def _say(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan, serve the demo's requests in a real engine, print the report."""
    parser = argparse.ArgumentParser(prog="python -m qsa_testing.demo", description=__doc__)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the model and logs go (default: a temp dir)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    status = plan_main(["plan"], prog="qsa-hisparse plan")
    if status:
        return status
    with tempfile.TemporaryDirectory(prefix="qsa-demo-") as scratch:
        workdir = args.workdir if args.workdir is not None else Path(scratch)
        _say(
            f"\nStarting a real SGLang engine on the tiny dummy Qwen4Exp (log: "
            f"{workdir / 'server.log'}); one to three minutes on 2 CPU cores...\n"
        )
        with start_engine(DEMO_ENGINE, workdir) as engine:
            _say(f"Engine up after {engine.start_seconds:.0f} s.\n")
            served = _serve(engine)
            report = render_report(served, _metrics(engine))
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
