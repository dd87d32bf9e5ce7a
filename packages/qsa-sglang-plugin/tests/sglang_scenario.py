"""Runs one activation scenario against the real SGLang in a fresh process; prints a JSON report.

Usage: ``python sglang_scenario.py <on|off-then-on|tampered> <model_dir>``. The last stdout line is
the JSON report; tests in ``test_activation_sglang.py`` start this script and read it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _error(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


def _resolve(model_dir: str, *extra: str) -> Any:
    from sglang.srt.server_args import prepare_server_args

    args = ["--model-path", model_dir, "--device", "cpu", "--disable-radix-cache", *extra]
    server_args = prepare_server_args(args)
    server_args.resolve_once()
    return server_args


def scenario_on(model_dir: str) -> dict[str, Any]:
    """Switches on: hooks land, configuration is checked, a record is written."""
    import sglang.srt.managers.scheduler as scheduler_mod
    import sglang.srt.server_args as server_args_mod
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    original_resolve = server_args_mod.ServerArgs.__dict__["resolve_once"]
    original_configure = scheduler_mod.configure_scheduler_process
    load_plugins()
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    report: dict[str, Any] = {
        "radix_cache_backends": registered_radix_cache_backends(),
        "registry": {
            t: [[ht.value, getattr(src, "plugin_name", None)] for ht, _h, src in entries]
            for t, entries in HookRegistry._hooks.items()
        },
        "resolve_wrapped": server_args_mod.ServerArgs.__dict__["resolve_once"].__wrapped__
        is original_resolve,
        "configure_wrapped": scheduler_mod.configure_scheduler_process.__wrapped__
        is original_configure,
    }
    try:
        _resolve(model_dir)
        report["defaults_refused"] = None
    except BaseException as exc:
        report["defaults_refused"] = _error(exc)
    server_args = _resolve(  # SGLang's overlap scheduling (its default) stays on
        model_dir,
        "--radix-cache-backend",
        "qsa_hisparse",
        "--max-running-requests",
        "4",
        "--prefill-max-requests",
        "1",
    )
    report["supported_resolved"] = True

    from sglang.srt.runtime_context import SpawnRanks, publish

    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    scheduler_mod.configure_scheduler_process(server_args, 0)
    directory = os.environ["SGLANG_QSA_HISPARSE_ACTIVATION_DIR"]
    report["records"] = sorted(os.listdir(directory))

    def foreign(result: object, *args: object, **kwargs: object) -> None:
        return None

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.resolve_once",
        foreign,
        HookType.AFTER,
        source=HookSource(plugin_name="late_plugin", dist_name="late-dist"),
    )
    from qsa_sglang_plugin._activation import verify_active

    try:
        verify_active()
        report["late_foreign"] = None
    except BaseException as exc:
        report["late_foreign"] = _error(exc)
    return report


def scenario_off_then_on(model_dir: str) -> dict[str, Any]:
    """Switches off: nothing registered. Then on, with a foreign plugin on a target: refused."""
    del model_dir
    import sglang.srt.plugins as plugins_mod
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry

    import qsa_sglang_plugin._switches as switches_mod

    plugins_mod.load_plugins()
    import qsa_sglang_plugin._activation as activation_mod

    report: dict[str, Any] = {
        "off_registry": {
            t: [getattr(src, "plugin_name", None) for _ht, _h, src in entries]
            for t, entries in HookRegistry._hooks.items()
        },
        "off_active": activation_mod.activation_state() is not None,
        "off_radix_cache_backends": registered_radix_cache_backends(),
        "off_imported_config_check": "qsa_sglang_plugin._config_check" in sys.modules,
    }
    os.environ["SGLANG_QSA_MODEL_COMPAT"] = "1"
    switches_mod.current_switches.cache_clear()
    plugins_mod._plugins_loaded = False
    try:
        plugins_mod.load_plugins()
        report["on_with_foreign"] = None
    except BaseException as exc:
        report["on_with_foreign"] = _error(exc)
    return report


def scenario_tampered(model_dir: str) -> dict[str, Any]:
    """Switches on against a tampered SGLang copy: refused before any hook is registered."""
    del model_dir
    import sglang
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    report: dict[str, Any] = {"sglang_file": sglang.__file__}
    try:
        load_plugins()
        report["error"] = None
    except BaseException as exc:
        report["error"] = _error(exc)
    report["registry"] = sorted(HookRegistry._hooks)
    return report


SCENARIOS = {"on": scenario_on, "off-then-on": scenario_off_then_on, "tampered": scenario_tampered}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](sys.argv[2])
    sys.stdout.write("\n" + json.dumps(result) + "\n")
