"""A server's command-line flags as :class:`~qsa_testing.EngineConfig` server arguments.

SGLang 0.5.23's own parser reads the flags (``ServerArgs.add_cli_args``, as ``sglang serve``
does) and its own constructor turns them into a record (``ServerArgs.from_cli_args``, unresolved:
resolution runs when the server starts). The fields that differ from the record of no flags are
the ones the flags set; a flag given at SGLang's default value sets nothing, as it would change
nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Sequence
from typing import Any, Final

from qsa_testing._errors import EngineConfigError

__all__ = ("server_args_of_flags",)

#: Stands in for ``--model-path``, which SGLang's parser requires and the harness owns.
_MODEL_PATH: Final = "qsa-testing-model-path"
#: ``ServerArgs`` fields the harness sets for every engine (``EngineConfig`` refuses them).
_HARNESS_FIELDS: Final = frozenset({"model_path", "host", "port"})


def server_args_of_flags(flags: Sequence[str]) -> dict[str, Any]:
    """The ``ServerArgs`` fields ``flags`` set to other than SGLang's defaults, by field name.

    Fields whose names start with ``_`` are SGLang's bookkeeping, never a flag's, and are left
    out. The values are what SGLang's parser gives (ints, floats, strings, lists), so they pass
    as JSON to the server.

    Args:
        flags: ``sglang serve`` flags, without ``--model-path``.

    Raises:
        EngineConfigError: SGLang's parser refuses ``flags`` (its message), or they set a field
            the harness owns (``--model-path``, ``--host``, ``--port``).
    """
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    given = _parse(parser, ["--model-path", _MODEL_PATH, *flags])
    default = _parse(parser, ["--model-path", _MODEL_PATH])
    server_args = ServerArgs.from_cli_args(given)
    defaults = ServerArgs.from_cli_args(default)
    changed = {
        field.name: getattr(server_args, field.name)
        for field in record_fields(ServerArgs)
        if not field.name.startswith("_")
        and getattr(server_args, field.name) != getattr(defaults, field.name)
    }
    owned = sorted(_HARNESS_FIELDS & set(changed))
    if owned:
        msg = f"flags {list(flags)!r} set {owned!r}; the harness sets those, leave them out"
        raise EngineConfigError(msg)
    return changed


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, its refusal raised instead of exiting the process."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(argv)
    except SystemExit:
        lines = errors.getvalue().strip().splitlines()
        msg = f"SGLang's parser refuses {argv[2:]!r}: {lines[-1] if lines else 'no message'}"
        raise EngineConfigError(msg) from None
