"""``nox -s demo``: the plan, then a real engine serving requests that share a prefix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qsa_testing.demo import Served, main, render_report

METRICS = {
    "qsa_hisparse_host_arena_bytes": 16 << 20,
    "qsa_hisparse_offload_decode_steps_total": 93.0,
    "qsa_hisparse_selected_blocks_total": 1000.0,
    "qsa_hisparse_fetched_blocks_total": 50.0,
    "qsa_hisparse_prefix_cache_publishes_total": 3.0,
    "qsa_hisparse_prefix_cache_bytes_in_total": 3 << 20,
    "qsa_hisparse_prefix_cache_payload_bytes": 3 << 20,
    "qsa_hisparse_prefix_cache_loaded_tokens_total": 6144.0,
    "qsa_hisparse_prefix_cache_pinned_memory": 0.0,
    "qsa_hisparse_live_leases": 0.0,
    "qsa_hisparse_offload_rows_in_use": 0.0,
}


def test_the_report_shows_each_request_and_what_the_metrics_say() -> None:
    served = [Served("alice", 3300, 0, 20.0), Served("bob", 3300, 3072, 3.5)]
    report = render_report(served, METRICS)
    assert re.search(r"alice\s+3,300\s+0\s+20\.0", report)
    assert re.search(r"bob\s+3,300\s+3,072\s+3\.5", report)
    assert "hit rate 0.950" in report
    assert "6,144 prompt tokens served from it" in report
    assert "Leases held now: 0; host arena rows in use: 0." in report


def test_the_demo_serves_its_requests_from_a_real_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "QSA capacity plan (per TP rank)" in out
    rows = re.findall(r"^\s+(alice|bob|carol)\s+([\d,]+)\s+([\d,]+)\s", out, re.MULTILINE)
    assert [(who, cached) for who, _, cached in rows] == [
        ("alice", "0"),
        ("bob", "3,072"),
        ("carol", "3,072"),
    ]
    assert "Leases held now: 0; host arena rows in use: 0." in out
    assert (tmp_path / "server.log").is_file()
