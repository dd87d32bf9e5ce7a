"""The ``qsa-hisparse`` command: one entry for operators, dispatching to each job's package.

Subcommands import their package only when chosen, so ``qsa-hisparse plan`` never loads torch or
SGLang, and ``qsa-hisparse launch`` loads SGLang only in the server it starts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _demo(argv: Sequence[str]) -> int:
    from qsa_hisparse._demo import main

    return main(argv)


def _plan(argv: Sequence[str]) -> int:
    from qsa_core.cli import main

    return main(["plan", *argv], prog="qsa-hisparse")


def _launch(argv: Sequence[str]) -> int:
    from qsa_sglang_plugin.launch import main

    return main(argv)


def _calibrate(argv: Sequence[str]) -> int:
    from qsa_hisparse._calibrate import main

    return main(argv)


def _doctor(argv: Sequence[str]) -> int:
    from qsa_sglang_plugin.doctor import main

    return main(argv)


_COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "demo": (
        _demo,
        "walk through the offload plan and the host prefix cache on a synthetic workload",
    ),
    "plan": (_plan, "print the memory plan of a model under host KV offload"),
    "launch": (_launch, "start an SGLang server with QSA HiSparse verified on every TP rank"),
    "doctor": (_doctor, "check that this machine and installation can serve"),
    "calibrate": (_calibrate, "write a double-sparsity channel file from a model and a text set"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="qsa-hisparse",
        description="Serve Qwen Sparse Attention models on SGLang with host KV offload.",
        epilog="Run 'qsa-hisparse <command> --help' for the options of one command.",
    )
    parser.add_argument(
        "command",
        choices=sorted(_COMMANDS),
        metavar="command",
        help="; ".join(f"{n}: {h}" for n, (_, h) in sorted(_COMMANDS.items())),
    )
    if not args or args[0] in {"-h", "--help"}:
        parser.print_help()
        return 0 if args else 2
    namespace = parser.parse_args(args[:1])
    run, _ = _COMMANDS[namespace.command]
    return run(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
