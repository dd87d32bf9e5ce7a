"""``qsa-plan`` (also ``qsa-hisparse plan``): print the capacity plan as a table.

``qsa-plan plan [flags]`` (or ``qsa-plan [flags]``); defaults are the Qwen3.8-Flash-Next TP2 FP8
setup of 8 requests × 262,144 tokens. ``--config`` reads an HF config (JSON) instead of the preset.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections.abc import Callable, Sequence

from qsa_core._capacity import plan_capacity
from qsa_core._errors import CapacityError, JSONFileError, QSAConfigError
from qsa_core._jsonfile import CONFIG_JSON_MAX_BYTES, read_json_file
from qsa_core._profile import (
    QWEN38_FLASH_NEXT,
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    KVDType,
    QSAProfile,
)
from qsa_core._render import render_plan

__all__ = ("MAX_BUDGET_GIB", "build_parser", "gib_bytes", "int_in", "main")

_GIB = 1 << 30


#: The largest budget a GiB argument takes (1 PiB): a larger one is a mistake, not a machine.
MAX_BUDGET_GIB = 1 << 20


def gib_bytes(text: str) -> int:
    """A ``--*-budget-gib`` argument as bytes: a finite number of GiB in [0, 1,048,576].

    Raises:
        argparse.ArgumentTypeError: not a number, not finite, negative or above the maximum (the
            message names the text and the allowed range; argparse adds the flag).
    """
    allowed = f"allowed: a number of GiB from 0 to {MAX_BUDGET_GIB}"
    try:
        value = float(text)
    except ValueError:
        msg = f"{text!r} is not a number of GiB; {allowed}"
        raise argparse.ArgumentTypeError(msg) from None
    if not 0 <= value <= MAX_BUDGET_GIB:  # also refuses nan and inf
        msg = f"{text!r} is not allowed; {allowed}"
        raise argparse.ArgumentTypeError(msg)
    return int(value * _GIB)


_DECIMAL = re.compile(r"[+-]?([0-9]+)")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``, written in decimal digits.

    The digits are counted before conversion, so a value of thousands of digits is refused by
    name instead of by CPython's conversion limit.
    """
    allowed = f"allowed: an integer from {low:,} to {high:,}"

    def parse(text: str) -> int:
        written = _DECIMAL.fullmatch(text.strip())
        if written is None or len(written[1]) > len(str(high)) + 1:
            shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
            msg = f"{shown!r} is not allowed; {allowed}"
            raise argparse.ArgumentTypeError(msg)
        value = int(written[0])
        if not low <= value <= high:
            msg = f"{text!r} is not allowed; {allowed}"
            raise argparse.ArgumentTypeError(msg)
        return value

    return parse


def _dtype(text: str) -> KVDType:
    try:
        return KVDType.parse(text)
    except QSAConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser(prog: str = "qsa-plan") -> argparse.ArgumentParser:
    """The plan command's argument parser; ``prog`` is the name the user typed."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan",
        help="print the per-rank capacity plan as a table",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    dtypes = "{" + ",".join(d.value for d in KVDType) + "}"
    plan.add_argument(
        "--config",
        type=pathlib.Path,
        help="HF config.json; None: the Qwen3.8-Flash-Next preset",
    )
    plan.add_argument("--page-size", type=int, default=64, help="KV page size, tokens")
    plan.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    plan.add_argument(
        "--kv-dtype",
        type=_dtype,
        default=KVDType.FP8_E4M3.value,
        metavar=dtypes,
        help="raw K/V dtype",
    )
    plan.add_argument(
        "--index-dtype", type=_dtype, default=KVDType.BF16.value, metavar=dtypes, help="index dtype"
    )
    plan.add_argument("--gpu-budget-gib", type=gib_bytes, default="9", help="GPU GiB per rank")
    plan.add_argument("--host-budget-gib", type=gib_bytes, default="12", help="host GiB per rank")
    plan.add_argument("--context-len", type=int, default=262144, help="tokens per request")
    plan.add_argument("--requests", type=int, default=8, help="concurrent requests")
    plan.add_argument(
        "--hot-slots", type=int, default=None, help="hot blocks per layer and request (None: auto)"
    )
    plan.add_argument(
        "--state-slots", type=int, default=None, help="recurrent-state slots (None: auto)"
    )
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "qsa-plan") -> int:
    """Run the plan command; returns the exit status (0 ok, 2 bad input)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in {"-h", "--help"}):
        args_list.insert(0, "plan")
    parser = build_parser(prog)
    args = parser.parse_args(args_list)
    try:
        if args.config is None:
            profile = QWEN38_FLASH_NEXT
            if args.page_size != profile.page_size:
                profile = QSAProfile.from_text_config(
                    QWEN38_FLASH_NEXT_TEXT_CONFIG, page_size=args.page_size
                )
        else:
            config = read_json_file(args.config, what="--config", max_bytes=CONFIG_JSON_MAX_BYTES)
            if not isinstance(config, dict):
                msg = (
                    f"--config {str(args.config)!r} holds a {type(config).__name__}, not an object"
                )
                raise QSAConfigError(msg)
            profile = QSAProfile.from_text_config(config, page_size=args.page_size)
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
            state_slots=args.state_slots,
        )
    except (QSAConfigError, CapacityError, JSONFileError) as exc:
        sys.stderr.write(f"{prog} plan: error: {exc}\n")
        return 2
    sys.stdout.write(render_plan(plan))
    return 0
