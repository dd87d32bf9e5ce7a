"""One capacity model: the price the plugin gives SGLang's pool sizing is the price it prints.

For p2-offload, resident cache sharding, double sparsity and DS-Offload, a fresh process builds
SGLang's real ``DefaultPoolConfigurator`` on CPU for the tiny models (as a model runner does,
without starting an engine), runs the plugin's AFTER hook on it, and reports the per-token price
and the fixed bytes SGLang will size its pools by beside what the capacity plan
(``capacity_plan_from_sglang``, which ``doctor`` and ``plan`` print) and the doctor's
double-sparsity line say for the same flags (``pool_pricing_scenario.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qsa_pytest.processes import hang_guard_s

SCENARIO = Path(__file__).with_name("pool_pricing_scenario.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("pool-pricing")
    done = subprocess.run(
        [sys.executable, str(SCENARIO), str(directory)],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(),
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        pytest.fail(f"rc {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_p2_offload_charges_the_plans_index_price_and_fixed_offload_bytes(
    report: dict[str, Any],
) -> None:
    """A token costs its index (SGLang's QSA pool price equals the plan's); staging, hot caches,
    tails and tables are the fixed bytes the plan's offloaded layout prints."""
    case = report["p2-offload"]
    assert case["token_bytes"] == case["offloaded_token_bytes"] < case["sglang_token_bytes"]
    assert case["sglang_token_bytes"] == case["resident_token_bytes"]
    assert case["fixed_bytes"] == case["offloaded_fixed_bytes"] > 0


def test_resident_sharding_charges_the_plans_sharded_token_price(report: dict[str, Any]) -> None:
    """Index plus half the raw K/V over a shard group of two; the transport buffers are fixed
    bytes of the sharded store the plan does not price."""
    case = report["resident sharding"]
    assert case["token_bytes"] == case["resident_token_bytes"] < case["sglang_token_bytes"]
    assert case["fixed_bytes"] > 0


def test_double_sparsity_adds_the_label_bytes_the_doctor_prints(report: dict[str, Any]) -> None:
    """SGLang's K/V price is the doctor's, and the plugin adds the doctor's label bytes."""
    case = report["double sparsity"]
    assert case["sglang_token_bytes"] == case["kv"]
    assert case["token_bytes"] == case["kv"] + case["labels"]
    assert case["fixed_bytes"] == 0


def test_ds_offload_charges_the_labels_alone_and_qsa_cores_offload_bytes(
    report: dict[str, Any],
) -> None:
    """The doctor's label bytes per token; qsa-core's DS-Offload sizes as the fixed bytes."""
    case = report["DS-Offload"]
    assert case["sglang_token_bytes"] == case["kv"]
    assert case["token_bytes"] == case["labels"]
    assert case["fixed_bytes"] == case["offload_fixed_bytes"] > 0
