"""``qsa-plan``: print the capacity plan as a table.

``qsa-plan plan [flags]`` (or ``qsa-plan [flags]``); defaults are the Qwen3.8-Flash-Next TP2 FP8
setup of 8 requests × 262,144 tokens. ``--config`` reads an HF config (JSON) instead of the preset.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

from qsa_core._capacity import plan_capacity
from qsa_core._errors import CapacityError, QSAConfigError
from qsa_core._profile import (
    QWEN38_FLASH_NEXT,
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    KVDType,
    QSAProfile,
)
from qsa_core._render import render_plan

__all__ = ("build_parser", "main")

_GIB = 1 << 30


def _gib(text: str) -> int:
    try:
        value = float(text)
    except ValueError as exc:
        msg = f"{text!r} is not a number of GiB"
        raise argparse.ArgumentTypeError(msg) from exc
    if value < 0:
        msg = f"{text!r} is negative; a budget must be >= 0 GiB"
        raise argparse.ArgumentTypeError(msg)
    return int(value * _GIB)


def _dtype(text: str) -> KVDType:
    try:
        return KVDType.parse(text)
    except QSAConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    """The ``qsa-plan`` argument parser (one ``plan`` command)."""
    parser = argparse.ArgumentParser(prog="qsa-plan", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print the per-rank capacity plan as a table")
    plan.add_argument("--config", type=pathlib.Path, help="HF config.json (default: preset)")
    plan.add_argument("--page-size", type=int, default=64, help="KV page size, tokens (64)")
    plan.add_argument("--tp", type=int, default=2, help="tensor-parallel size (2)")
    plan.add_argument("--kv-dtype", type=_dtype, default=KVDType.FP8_E4M3, help="raw K/V dtype")
    plan.add_argument("--index-dtype", type=_dtype, default=KVDType.BF16, help="index dtype")
    plan.add_argument("--gpu-budget-gib", type=_gib, default=9 * _GIB, help="GPU GiB per rank (9)")
    plan.add_argument("--host-budget-gib", type=_gib, default=12 * _GIB, help="host GiB per rank")
    plan.add_argument("--context-len", type=int, default=262144, help="tokens per request")
    plan.add_argument("--requests", type=int, default=8, help="concurrent requests (8)")
    plan.add_argument("--hot-slots", type=int, default=None, help="hot blocks/layer/request")
    plan.add_argument("--reserved-hot-slots", type=int, default=64, help="extra hot slots (64)")
    plan.add_argument("--state-slots", type=int, default=None, help="recurrent-state slots")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qsa-plan``; returns the exit status (0 ok, 2 bad input)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in {"-h", "--help"}):
        args_list.insert(0, "plan")
    parser = build_parser()
    args = parser.parse_args(args_list)
    try:
        if args.config is None:
            profile = QWEN38_FLASH_NEXT
            if args.page_size != profile.page_size:
                profile = QSAProfile.from_text_config(
                    QWEN38_FLASH_NEXT_TEXT_CONFIG, page_size=args.page_size
                )
        else:
            profile = QSAProfile.from_text_config(
                json.loads(args.config.read_text()), page_size=args.page_size
            )
        plan = plan_capacity(
            profile,
            tp_size=args.tp,
            kv_dtype=args.kv_dtype,
            index_dtype=args.index_dtype,
            gpu_budget_bytes=args.gpu_budget_gib,
            host_budget_bytes=args.host_budget_gib,
            context_len=args.context_len,
            num_requests=args.requests,
            hot_slots=args.hot_slots,
            reserved_hot_slots=args.reserved_hot_slots,
            state_slots=args.state_slots,
        )
    except (QSAConfigError, CapacityError, OSError, json.JSONDecodeError) as exc:
        sys.stderr.write(f"qsa-plan: error: {exc}\n")
        return 2
    sys.stdout.write(render_plan(plan))
    return 0
