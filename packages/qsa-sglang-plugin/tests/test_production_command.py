"""The production command through ``qsa-hisparse launch``'s checks, on a model-shaped model.

:data:`qsa_testing.PRODUCTION_FLAGS` is the maintainer's production command (the seed,
docs/plugin.md "The production command") minus ``--model-path``, under its switches
(:data:`qsa_testing.PRODUCTION_SWITCHES`). The model is the model-shaped tiny Qwen4Exp (real QSA
geometry, 262,144 positions, one PLE layer) with an INT8-row PLE table written beside its config
(``production_model_dir``, conftest). The checks: the launcher's own before it starts anything
(topology, serving flags; this process), then SGLang 0.5.23's parser and resolution with the
plugin's configuration check (its AFTER hook on ``resolve_once``), in a fresh process.
``test_engine_production.py`` starts the command on one CUDA GPU.

This machine has no accelerator, and SGLang's resolution of an unset ``--device`` asks for one;
:data:`DEVICE` names the device it picks on the GPU machine the command is for. The launcher's
own NVIDIA-driver check is pointed at a file that exists (a machine with a driver).

The seed as given is refused for two flags it does not pass, one at a time (the check stops at the
first): ``--radix-cache-backend`` (unset: SGLang's own tree cache), then
``--prefill-max-requests`` (unset: no limit); with both (:data:`PLUGIN_FLAGS`, from
:data:`qsa_testing.PRODUCTION_PLUGIN_FLAGS`) it is accepted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from qsa_pytest.processes import script_report
from qsa_sglang_plugin import launch
from qsa_sglang_plugin._readiness import server_topology
from qsa_testing import PRODUCTION_FLAGS, PRODUCTION_PLUGIN_FLAGS, PRODUCTION_SWITCHES

SCENARIO = Path(__file__).with_name("production_command_scenario.py")
DEVICE = ["--device", "cuda"]
RADIX_CACHE_BACKEND, PREFILL_MAX_REQUESTS = (list(flag) for flag in PRODUCTION_PLUGIN_FLAGS)
PLUGIN_FLAGS = [*RADIX_CACHE_BACKEND, *PREFILL_MAX_REQUESTS]


@pytest.fixture(scope="module")
def resolved(production_model_dir: Path) -> list[dict[str, Any]]:
    """The seed's flags, with the radix-cache backend, and with both plugin flags (in order)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_QSA_")}
    env.update(PRODUCTION_SWITCHES)
    flags = [*PRODUCTION_FLAGS, *DEVICE]
    result: list[dict[str, Any]] = script_report(
        SCENARIO,
        str(production_model_dir),
        json.dumps(flags),
        json.dumps(RADIX_CACHE_BACKEND),
        json.dumps(PLUGIN_FLAGS),
        env=env,
    )
    return result


def test_the_launcher_accepts_the_seeds_flags_before_starting_anything(
    production_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = tmp_path / "nvidiactl"
    driver.touch()
    monkeypatch.setattr(launch, "_NVIDIA_DRIVER_PATHS", (driver,))
    command = ["--model-path", str(production_model_dir), *PRODUCTION_FLAGS]
    assert server_topology(command).tp_size == 2
    launch._check_serving_flags(command)  # raises LaunchError on a refused flag


def test_the_seed_alone_is_refused_for_its_unset_radix_cache_backend(
    resolved: list[dict[str, Any]],
) -> None:
    error = resolved[0]["error"]
    assert error is not None
    assert error["type"] == "ConfigurationError"
    assert error["message"].startswith("--radix-cache-backend=None is not supported")
    assert "supported: 'qsa_hisparse'" in error["message"]


def test_then_for_its_unset_prefill_max_requests(resolved: list[dict[str, Any]]) -> None:
    error = resolved[1]["error"]
    assert error is not None
    assert error["type"] == "ConfigurationError"
    assert error["message"].startswith("--prefill-max-requests=None is not supported")


def test_with_the_two_plugin_flags_the_production_command_is_accepted(
    resolved: list[dict[str, Any]],
) -> None:
    accepted = resolved[2]
    assert accepted["error"] is None
    assert accepted["facts"] == {
        "ple_embedding_dtype": "int8_row",
        "tp_size": 2,
        "kv_cache_dtype": "fp8_e4m3",
        "page_size": 64,
        "prefill_graph_backend": "disabled",
        "radix_cache_backend": "qsa_hisparse",
        "prefill_max_requests": 1,
        "ple_offload_embedding": True,
    }
