"""The cache's and the prompts' counts are described as ``qsa_core.CountSeries``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from qsa_core import CountSeries
from qsa_hostcache import CacheStats, PromptCounts


@pytest.mark.parametrize("counts", [CacheStats, PromptCounts])
def test_series_are_count_series_named_as_their_fields(
    counts: type[CacheStats | PromptCounts],
) -> None:
    """One series a field, in order, named as it, unlabelled, with a help line."""
    series = counts.series()
    assert all(isinstance(s, CountSeries) for s in series)
    assert [s.field for s in series] == [f.name for f in dataclasses.fields(counts)]
    assert all(s.name == s.field and s.label is None and s.help for s in series)


def test_cache_stats_kinds_and_exposition_unchanged() -> None:
    """Occupancy fields are gauges, the rest counters; the text exposition names them so."""
    kinds = {s.field: s.counter for s in CacheStats.series()}
    assert (kinds["hits"], kinds["used_bytes"], kinds["pinned_memory"]) == (True, False, False)
    zeros: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(CacheStats)}
    stats = CacheStats(**zeros)
    text = stats.to_prometheus(labels={"tp_rank": "0"})
    assert "# TYPE qsa_hostcache_hits_total counter" in text
    assert 'qsa_hostcache_used_bytes{tp_rank="0"} 0' in text
