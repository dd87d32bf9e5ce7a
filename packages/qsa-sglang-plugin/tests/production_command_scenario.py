"""SGLang 0.5.23's resolution of the production command, with the plugin's checks; JSON report.

Usage: ``python production_command_scenario.py <model_dir> <flags as JSON> [<extra flags as JSON>
...]``, with the production switches in the environment. Runs in a fresh process (it loads the
plugins): for the flags alone, then with each list of extra flags added to them, SGLang parses the
command (``prepare_server_args``) and resolves it (``resolve_once``, whose AFTER hook is the
plugin's configuration check). Each result is ``{"error": None, "facts": {...}}`` (what the
check read) or ``{"error": {"type", "message"}}``. The last stdout line is the JSON report.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _resolve(args: list[str]) -> dict[str, Any]:
    from sglang.srt.server_args import prepare_server_args

    from qsa_sglang_plugin._config_check import facts_from_server_args

    try:
        server_args = prepare_server_args(args)
        server_args.resolve_once()
    except BaseException as exc:  # a refusal is the result
        return {"error": {"type": type(exc).__name__, "message": str(exc)}}
    facts = facts_from_server_args(server_args)
    return {
        "error": None,
        "facts": {
            "ple_embedding_dtype": facts.text_config.get("ple_embedding_dtype"),
            "tp_size": facts.tp_size,
            "kv_cache_dtype": facts.kv_cache_dtype,
            "page_size": facts.page_size,
            "prefill_graph_backend": facts.prefill_graph_backend,
            "radix_cache_backend": facts.radix_cache_backend,
            "prefill_max_requests": facts.prefill_max_requests,
            "ple_offload_embedding": bool(server_args.ple_offload_embedding),
        },
    }


def main(model_dir: str, flags: list[str], extras: list[list[str]]) -> list[dict[str, Any]]:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    base = ["--model-path", model_dir, *flags]
    return [_resolve(base), *(_resolve([*base, *extra]) for extra in extras)]


if __name__ == "__main__":
    extra_lists = [json.loads(arg) for arg in sys.argv[3:]]
    result = main(sys.argv[1], json.loads(sys.argv[2]), extra_lists)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
