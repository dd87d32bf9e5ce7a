"""Activation against the real SGLang 0.5.23, each scenario in its own fresh process.

The three scenario processes start together once per session (importing SGLang costs 15-40 s
each); the tests below read their reports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from qsa_pytest.processes import hang_guard_s

SCENARIO = Path(__file__).with_name("sglang_scenario.py")
SWITCH_VARS = (
    "SGLANG_QSA_MODEL_COMPAT",
    "SGLANG_QSA_HISPARSE_V3",
    "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB",
    "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MAX_ENTRIES",
    "SGLANG_QSA_HISPARSE_ACTIVATION_DIR",
    "SGLANG_PLUGINS",
)
FOREIGN_PLUGIN = """
from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def register():
    def around(original, *args, **kwargs):
        return original(*args, **kwargs)

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.resolve_once", around, HookType.AROUND
    )
"""


@dataclass(frozen=True)
class Reports:
    on: dict[str, Any]
    off_then_on: dict[str, Any]
    tampered: dict[str, Any]
    activation_dir: Path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARS}
    env.update(extra)
    return env


def _sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None
    assert spec.submodule_search_locations is not None
    return Path(next(iter(spec.submodule_search_locations)))


def _collect(proc: subprocess.Popen[str], name: str) -> dict[str, Any]:
    out, err = proc.communicate(timeout=hang_guard_s())
    lines = [line for line in out.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"scenario {name} failed (rc {proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


@pytest.fixture(scope="session")
def reports(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Reports:
    """Run the on, off-then-on (with a foreign plugin) and tampered scenarios concurrently."""
    root = tmp_path_factory.mktemp("scenarios")
    activation_dir = root / "activation"

    foreign_site = root / "foreign-site"
    dist_info = foreign_site / "foreign_hooker-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: foreign-hooker\nVersion: 0.1\n", encoding="utf-8"
    )
    (dist_info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nforeign_hooker = foreign_hooker:register\n", encoding="utf-8"
    )
    (foreign_site / "foreign_hooker.py").write_text(FOREIGN_PLUGIN, encoding="utf-8")

    tampered_site = root / "tampered-site"
    tampered_site.mkdir()
    copy = tampered_site / "sglang"
    subprocess.run(["cp", "-rs", str(_sglang_dir()), str(copy)], check=True)
    target = copy / "srt" / "server_args.py"
    text = target.read_text(encoding="utf-8")
    target.unlink()
    target.write_text(text + "\n# one changed byte is enough\n", encoding="utf-8")

    model = str(tiny_model_dir)
    on_env = _env(
        SGLANG_QSA_MODEL_COMPAT="1",
        SGLANG_QSA_HISPARSE_V3="p2-offload",
        SGLANG_QSA_HISPARSE_ACTIVATION_DIR=str(activation_dir),
        SGLANG_PLUGINS="qsa_hisparse",
    )
    procs = {
        "on": subprocess.Popen(
            [sys.executable, str(SCENARIO), "on", model],
            env=on_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        "off-then-on": subprocess.Popen(
            [sys.executable, str(SCENARIO), "off-then-on", model],
            env=_env(PYTHONPATH=str(foreign_site)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        "tampered": subprocess.Popen(
            [sys.executable, str(SCENARIO), "tampered", model],
            env=_env(
                PYTHONPATH=str(tampered_site),
                SGLANG_QSA_MODEL_COMPAT="1",
                SGLANG_PLUGINS="qsa_hisparse",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
    }
    collected = {name: _collect(proc, name) for name, proc in procs.items()}
    return Reports(
        on=collected["on"],
        off_then_on=collected["off-then-on"],
        tampered=collected["tampered"],
        activation_dir=activation_dir,
    )


def test_switches_off_registers_nothing(reports: Reports) -> None:
    """With every switch off, load_plugins() leaves no qsa_hisparse entry and no active state."""
    off = reports.off_then_on
    owners = {owner for entries in off["off_registry"].values() for owner in entries}
    assert "qsa_hisparse" not in owners
    assert "foreign_hooker" in owners  # the foreign plugin did load: the check is not vacuous
    assert off["off_active"] is False
    assert off["off_imported_config_check"] is False
    assert "qsa_hisparse" not in off["off_radix_cache_backends"]


def test_hooks_land_on_sglang_classes(reports: Reports) -> None:
    """Every declared hook wraps the real SGLang definition, registered under qsa_hisparse."""
    on = reports.on
    assert on["resolve_wrapped"] is True
    assert on["configure_wrapped"] is True
    registry = on["registry"]
    assert registry["sglang.srt.server_args.ServerArgs.resolve_once"] == [["after", "qsa_hisparse"]]
    assert registry["sglang.srt.managers.scheduler.configure_scheduler_process"] == [
        ["after", "qsa_hisparse"]
    ]
    wrapper = "sglang.srt.layers.attention.attention_registry.attn_backend_wrapper"
    assert registry[wrapper] == [["after", "qsa_hisparse"]]  # p2-offload's backend
    pool = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class"
    assert registry[pool] == [["after", "qsa_hisparse"]]  # the offload's one-page K/V pool
    sizer = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__"
    assert registry[sizer] == [["after", "qsa_hisparse"]]


def test_offload_switch_registers_the_lifecycle_radix_cache_backend(reports: Reports) -> None:
    """p2-offload adds radix-cache backend qsa_hisparse to SGLang's registry."""
    assert "qsa_hisparse" in reports.on["radix_cache_backends"]


def test_unsupported_configuration_stops_resolution(reports: Reports) -> None:
    """p2-offload without the plugin's tree cache (SGLang's defaults) is refused at
    resolve_once, naming the flag; with it and the offload's flags, overlap scheduling on, the
    arguments resolve."""
    err = reports.on["defaults_refused"]
    assert err is not None
    assert err["type"] == "ConfigurationError"
    assert "--radix-cache-backend=None is not supported" in err["message"]
    assert "supported: 'qsa_hisparse'" in err["message"]
    assert reports.on["supported_resolved"] is True


def test_scheduler_process_writes_one_record(reports: Reports) -> None:
    """configure_scheduler_process writes a verified record for TP rank 0 with the features."""
    from qsa_sglang_plugin import ActivationRecord

    names = reports.on["records"]
    assert len(names) == 1
    record = ActivationRecord.from_json((reports.activation_dir / names[0]).read_text())
    assert (record.role, record.tp_rank, record.pp_rank) == ("scheduler", 0, 0)
    assert record.features == (
        "framework",
        "model_compat",
        "hisparse",
        "lifecycle",
        "qsa_backend",
        "kv_pool",
    )
    assert record.hisparse_mode == "p2-offload"
    assert record.verified is True
    assert record.versions["sglang"] == "0.5.23"
    # The frame's four (configuration check, prompt check, record, pool sizing), p2-offload's
    # backend and pool, and model compatibility's four (the INT8-row PLE table's constructor,
    # the host-table allocator it keeps from allocating bf16, the table's loading, and the GPTQ
    # Marlin MoE scales in the model's dtype): every declared hook of the record's features,
    # none other.
    from qsa_sglang_plugin._hooks import specs_for
    from qsa_sglang_plugin._switches import Feature

    declared = specs_for(Feature(name) for name in record.features)
    assert record.hooks == tuple((s.target, s.kind.value, s.feature.value) for s in declared)
    assert len(record.hooks) == 10
    assert record.registrations == (("radix_cache_backend", "qsa_hisparse", "lifecycle"),)


def test_foreign_hook_after_activation_is_refused(reports: Reports) -> None:
    """A hook registered on a target after activation fails the per-process re-check."""
    err = reports.on["late_foreign"]
    assert err is not None
    assert err["type"] == "ForeignHookError"
    assert "late_plugin" in err["message"]
    assert "ServerArgs.resolve_once" in err["message"]


def test_foreign_plugin_on_target_is_refused(reports: Reports) -> None:
    """An installed plugin hooking our target stops load_plugins() despite its Exception guard."""
    err = reports.off_then_on["on_with_foreign"]
    assert err is not None
    assert err["type"] == "ForeignHookError"
    assert "foreign_hooker" in err["message"]
    assert "around" in err["message"]


def test_tampered_target_module_is_refused(reports: Reports) -> None:
    """A changed byte in a copy of server_args.py stops activation before any hook registers."""
    rep = reports.tampered
    assert "tampered-site" in rep["sglang_file"]
    err = rep["error"]
    assert err is not None
    assert err["type"] == "FingerprintMismatchError"
    assert "sglang.srt.server_args" in err["message"]
    assert "tampered-site" in err["message"]
    assert "sglang.srt.server_args.ServerArgs.resolve_once" not in rep["registry"]
    assert "sglang.srt.managers.scheduler.configure_scheduler_process" not in rep["registry"]
