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


def test_labelled_series_of_one_name_are_one_family_and_advance_apart() -> None:
    """``DSCounts``' rows by path: one family ``..._decode_rows{path}``, each path its own."""
    from qsa_kernels.double_sparsity import DSCounts
    from qsa_sglang_plugin._adapters._metrics import CountsMirror

    prefix = "qsa_test_labelled"
    mirror = CountsMirror(RankMetrics(2), prefix, DSCounts.series())
    mirror.update(DSCounts(eager_steps=1, dense_rows=3))
    mirror.update(DSCounts(eager_steps=2, dense_rows=3, sparse_rows=4))
    rows = f"{prefix}_decode_rows_total"
    assert REGISTRY.get_sample_value(rows, {"tp_rank": "2", "path": "dense"}) == 3
    assert REGISTRY.get_sample_value(rows, {"tp_rank": "2", "path": "sparse"}) == 4
    steps = f"{prefix}_decode_steps_total"
    assert REGISTRY.get_sample_value(steps, {"tp_rank": "2", "mode": "eager"}) == 2
    assert REGISTRY.get_sample_value(steps, {"tp_rank": "2", "mode": "graph"}) == 0


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
