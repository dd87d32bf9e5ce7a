"""An INT8-row PLE table is the only allocation of its size: no transient bf16 table is made.

``ple_allocation_scenario.py`` builds the tiny model's real ``Qwen4ExpNGramEmbedding`` with the
plugin's hooks on (``SGLANG_QSA_MODEL_COMPAT=1``) in a fresh process and reports every storage
the constructor creates. SGLang's own bf16 table is the control: the record shows it, at full size
(pinned with ``--ple-offload-embedding``, the 102 GB allocation of the production table), so the
instrument sees such a table when one is made. With ``int8_row`` the constructor makes the int8
values and float32 scales and nothing of a table's size besides, on the device or offloaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from qsa_pytest.processes import script_report

SCENARIO = Path(__file__).with_name("ple_allocation_scenario.py")
#: Bytes the constructor may create beside the table: its one-element scale and a row count.
SMALL = 64


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_QSA_")}
    env.update(SGLANG_QSA_MODEL_COMPAT="1", SGLANG_PLUGINS="qsa_hisparse")
    result: dict[str, Any] = script_report(SCENARIO, str(tiny_model_dir), env=env)
    return result


def _largest(case: dict[str, Any]) -> list[tuple[int, str, bool]]:
    storages = case["storages"]
    return sorted(((s["nbytes"], s["dtype"], s["pinned"]) for s in storages), reverse=True)


@pytest.mark.parametrize("place", ["device", "offload"])
def test_sglangs_bf16_table_is_seen_at_full_size(report: dict[str, Any], place: str) -> None:
    case = report[f"bf16/{place}"]
    table_bytes = case["rows"] * case["dim"] * 2
    assert _largest(case)[0] == (table_bytes, "torch.bfloat16", place == "offload")


@pytest.mark.parametrize("place", ["device", "offload"])
def test_an_int8_row_table_is_the_only_table_allocated(report: dict[str, Any], place: str) -> None:
    case = report[f"int8_row/{place}"]
    rows, dim, pinned = case["rows"], case["dim"], place == "offload"
    assert case["table_class"] == "Int8RowPLEEmbedding"
    largest = _largest(case)
    assert largest[:2] == [(rows * dim, "torch.int8", pinned), (rows * 4, "torch.float32", pinned)]
    assert sum(nbytes for nbytes, _, _ in largest[2:]) <= SMALL
    assert not [s for s in case["storages"] if s["dtype"] == "torch.bfloat16" and s["nbytes"] > 2]


def test_the_module_keeps_the_callers_config(report: dict[str, Any]) -> None:
    """SGLang builds from an "offloaded" copy of the config; the module keeps the caller's."""
    assert all(case["config_is_callers"] for case in report.values())
