"""The plugin's Prometheus series: one family per name and process, one series per TP rank."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from qsa_sglang_plugin._adapters._metrics import RankMetrics


def test_two_ranks_in_one_process_share_a_family_and_keep_their_series() -> None:
    name = "qsa_test_shared_family_bytes"
    RankMetrics(0).gauge(name, "test").set(3)
    RankMetrics(1).gauge(name, "test").set(5)
    RankMetrics(0).gauge(name, "test").inc(1)  # the same rank again: the same series
    assert REGISTRY.get_sample_value(name, {"tp_rank": "0"}) == 4
    assert REGISTRY.get_sample_value(name, {"tp_rank": "1"}) == 5


def test_a_name_asked_for_as_another_kind_is_refused_naming_both() -> None:
    name = "qsa_test_kind_clash"
    RankMetrics(0).counter(name, "test").inc()
    with pytest.raises(ValueError, match=r"'qsa_test_kind_clash' is a Counter .* for a Gauge"):
        RankMetrics(0).gauge(name, "test")
    assert REGISTRY.get_sample_value(f"{name}_total", {"tp_rank": "0"}) == 1


def test_library_counts_advance_their_counters_by_what_they_added() -> None:
    from qsa_kernels.offload import OffloadCounts
    from qsa_sglang_plugin._adapters._metrics import advance_counters

    name = "qsa_test_advanced_steps"
    counters = {"decode_steps": RankMetrics(0).counter(name, "test")}
    before, now = OffloadCounts(decode_steps=3), OffloadCounts(decode_steps=7, rows_in_use=2)
    advance_counters(counters, now, before)
    advance_counters(counters, now, now)  # nothing added: nothing counted
    assert REGISTRY.get_sample_value(f"{name}_total", {"tp_rank": "0"}) == 4


def test_a_mirror_sets_gauges_and_advances_counters_from_zero_at_its_first_snapshot() -> None:
    from qsa_kernels.offload import OffloadCounts
    from qsa_sglang_plugin._adapters._metrics import CountsMirror

    prefix = "qsa_test_mirror"
    mirror = CountsMirror(RankMetrics(3), prefix, OffloadCounts.series())
    rank = {"tp_rank": "3"}
    mirror.update(OffloadCounts(rows_in_use=2, decode_steps=5))
    mirror.update(OffloadCounts(rows_in_use=1, decode_steps=9, verified_bytes=64))
    assert REGISTRY.get_sample_value(f"{prefix}_offload_rows_in_use", rank) == 1
    assert REGISTRY.get_sample_value(f"{prefix}_offload_decode_steps_total", rank) == 9
    assert REGISTRY.get_sample_value(f"{prefix}_offload_verified_bytes_total", rank) == 64
    assert REGISTRY.get_sample_value(f"{prefix}_selected_blocks_total", rank) == 0
