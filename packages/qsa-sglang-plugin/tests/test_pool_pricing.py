"""One capacity model: the price the plugin gives SGLang's pool sizing is the price it prints.

For every feature configuration that prices the pool (p2-resident, p2-offload with staged
prompts, hot blocks, a sharded host arena with or without the index sharded (D1, D1 + D2) or the
prefix cache, resident cache sharding D1 and with the index sharded D2, the index sharded alone
(D2 without D1, at TP2, resident or offloaded), double sparsity and DS-Offload), a fresh process
builds SGLang's real ``DefaultPoolConfigurator`` on CPU for the tiny models (as a model runner
does, without starting an engine), runs the plugin's AFTER hook on it, and reports the per-token
price, the fixed bytes and the pool's token slots SGLang will size its pools by beside what the
capacity plan (``capacity_plan_from_sglang``, which ``doctor`` and ``plan`` print) and the
doctor's double-sparsity line say for the same flags (``pool_pricing_scenario.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from qsa_pytest.processes import script_report

SCENARIO = Path(__file__).with_name("pool_pricing_scenario.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("pool-pricing")
    result: dict[str, Any] = script_report(SCENARIO, str(directory))
    return result


#: Every configuration of the scenario, and the plan layout its switches run.
CASES = {
    "p2-resident": "resident",
    "p2-offload": "offloaded",
    "p2-offload, hot blocks": "offloaded",
    "p2-offload, host arena sharded (D1)": "offloaded",
    "p2-offload, host arena and index sharded (D1 + D2)": "offloaded",
    "p2-offload, prefix cache": "offloaded",
    "p2-offload, verify": "offloaded",
    "resident sharding (D1)": "resident",
    "resident sharding, index sharded (D2)": "resident",
    "index sharded alone (D2 without D1)": "resident",
    "p2-offload, index sharded alone (D2 without D1)": "offloaded",
    "qsa_ds": "resident",
    "DS-Offload": "offloaded",
    "DS-Offload, verify": "offloaded",
    "DS-Offload, whole staging": "offloaded",
}


def test_the_scenario_prices_every_configuration(report: dict[str, Any]) -> None:
    """No configuration is left out of the agreement test below."""
    assert set(report) == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_the_pool_price_sglang_uses_is_the_capacity_plans(
    report: dict[str, Any], name: str
) -> None:
    """Bytes per token, fixed device bytes and the pool's token slots that the plugin writes into
    SGLang equal those the plan prints for the same flags and switches: the layout of
    ``capacity_plan_from_sglang`` its switches run (QSA), or ``ds_capacity`` (double
    sparsity, the doctor's line)."""
    engine, plan = report[name]["engine"], report[name]["plan"]
    assert plan["layout"] == CASES[name]
    assert (engine["token_bytes"], engine["fixed_bytes"], engine["pool_tokens"]) == (
        plan["token_bytes"],
        plan["fixed_bytes"],
        plan["pool_tokens"],
    )
    assert engine["pool_tokens"] > 0


def test_each_feature_reprices_sglangs_own_price(report: dict[str, Any]) -> None:
    """The configurations differ where their features do: offload charges the index alone and
    the offload's buffers, sharding a share of the raw K/V and the transport buffers, D2 a share
    of the index too (with the offload: a share of the index, and its candidate buffers fixed);
    p2-resident and the prefix cache leave the price as it was."""

    def engine(name: str) -> dict[str, int]:
        case: dict[str, int] = report[name]["engine"]
        return case

    resident, offload = engine("p2-resident"), engine("p2-offload")
    assert (resident["token_bytes"], resident["fixed_bytes"]) == (resident["sglang_token_bytes"], 0)
    assert offload["token_bytes"] < offload["sglang_token_bytes"] == resident["token_bytes"]
    assert offload["fixed_bytes"] > 0
    assert engine("p2-offload, prefix cache") == offload
    assert engine("p2-offload, hot blocks")["fixed_bytes"] != offload["fixed_bytes"]
    d1, d2 = engine("resident sharding (D1)"), engine("resident sharding, index sharded (D2)")
    assert d2["token_bytes"] < d1["token_bytes"] < d1["sglang_token_bytes"]
    assert d2["fixed_bytes"] > d1["fixed_bytes"] > 0
    arena = engine("p2-offload, host arena sharded (D1)")
    both = engine("p2-offload, host arena and index sharded (D1 + D2)")
    assert both["token_bytes"] == -(-arena["token_bytes"] // 2)
    assert both["fixed_bytes"] > arena["fixed_bytes"]
    assert both["pool_tokens"] > arena["pool_tokens"]
    # D2 alone at TP2: the raw K/V whole, half of the index (SGLang's price at TP2 is the plain
    # resident one of this rank's K/V heads), and the candidate buffers fixed.
    alone = engine("index sharded alone (D2 without D1)")
    assert alone["token_bytes"] < alone["sglang_token_bytes"]
    assert alone["fixed_bytes"] > 0
    # With the offload at TP2: half of the index is all a token costs (the plain offload's
    # price at TP1 is the whole index), and the offload's buffers plus the candidates are fixed.
    offloaded_alone = engine("p2-offload, index sharded alone (D2 without D1)")
    assert offloaded_alone["token_bytes"] == -(-offload["token_bytes"] // 2)
    assert offloaded_alone["fixed_bytes"] > 0


def test_double_sparsity_charges_what_the_doctor_prints(report: dict[str, Any]) -> None:
    """SGLang's K/V price is the doctor's; the plugin adds the doctor's label bytes, or with
    DS-Offload charges them alone and the offload's buffers fixed."""
    for name in ("qsa_ds", "DS-Offload"):
        engine, doctor = report[name]["engine"], report[name]["doctor"]
        assert engine["sglang_token_bytes"] == doctor["kv"]
        assert engine["token_bytes"] == doctor["token_bytes"]
    assert report["qsa_ds"]["doctor"]["token_bytes"] == 256 + 64
    assert report["qsa_ds"]["engine"]["fixed_bytes"] == 0
    assert report["DS-Offload"]["doctor"]["token_bytes"] == report["DS-Offload"]["doctor"]["labels"]
    assert report["DS-Offload"]["engine"]["fixed_bytes"] > 0
    # The tiny Llama has two layers: a window of two holds as much as the whole prompt, plus the
    # open block of each of its 2 x 2 record layers (one KV head of 16 dims, 256 B a record).
    window, whole = (report[n]["engine"] for n in ("DS-Offload", "DS-Offload, whole staging"))
    assert whole["token_bytes"] == window["token_bytes"]
    assert window["fixed_bytes"] - whole["fixed_bytes"] == 2 * 2 * 256
