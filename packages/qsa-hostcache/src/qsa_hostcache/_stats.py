"""A snapshot of the cache's counters and occupancy, and its Prometheus text rendering."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Final

from qsa_core import CountSeries

_COUNTER_HELP: Final = {
    "lookups": "Prefix lookups (match and acquire calls).",
    "hits": "Lookups that found a checkpoint.",
    "lookup_tokens": "Tokens in the queries of all lookups.",
    "hit_tokens": "Tokens covered by the checkpoints that lookups found.",
    "publishes": "Checkpoints that became visible.",
    "bytes_in": "Payload bytes copied into published checkpoints.",
    "shared_bytes": (
        "Payload bytes of published checkpoints read from the shorter checkpoints they extend "
        "instead of copied again."
    ),
    "restores": "Restore calls.",
    "bytes_out": "Payload bytes restored.",
    "evictions": "Checkpoints evicted to make room.",
    "evicted_bytes": "Payload bytes of evicted checkpoints.",
    "refusals": "Publishes refused because nothing evictable made room.",
    "too_large": "Publishes rejected because the checkpoint exceeds the arena.",
    "duplicates": "Publishes skipped because the same key material was already cached.",
    "aborts": "Publishes aborted by the caller.",
    "stale_publishes": "Publishes dropped because the cache was invalidated during the copy.",
    "invalidations": "invalidate_all calls.",
    "invalidated_entries": "Checkpoints dropped by invalidate_all.",
}

_GAUGE_HELP: Final = {
    "entries": "Live checkpoints (reserved, ready and retired).",
    "ready_entries": "Checkpoints that can match.",
    "reserved_entries": "Checkpoints being written.",
    "retired_entries": "Invalidated checkpoints still pinned by a restore or extended by one.",
    "pinned_entries": "Checkpoints pinned by at least one lease.",
    "used_bytes": "Arena bytes held by live checkpoints (whole blocks).",
    "payload_bytes": "Payload bytes live checkpoints store (shared rows counted once).",
    "capacity_bytes": "Arena size in bytes.",
    "block_bytes": "Arena block size in bytes.",
    "max_entries": "Most checkpoints kept at once.",
    "pinned_memory": "1 if the arena is pinned (page-locked) host memory, else 0.",
}


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since construction (monotonic) and occupancy now. Bytes are bytes, tokens tokens."""

    lookups: int
    hits: int
    lookup_tokens: int
    hit_tokens: int
    publishes: int
    bytes_in: int
    shared_bytes: int
    restores: int
    bytes_out: int
    evictions: int
    evicted_bytes: int
    refusals: int
    too_large: int
    duplicates: int
    aborts: int
    stale_publishes: int
    invalidations: int
    invalidated_entries: int
    entries: int
    ready_entries: int
    reserved_entries: int
    retired_entries: int
    pinned_entries: int
    used_bytes: int
    payload_bytes: int
    capacity_bytes: int
    block_bytes: int
    max_entries: int
    pinned_memory: bool

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        """Hits per lookup (0.0 before the first lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0

    @staticmethod
    def series() -> tuple[CountSeries, ...]:
        """Every field, in declaration order, with its kind and help text (named as the field)."""
        return tuple(
            CountSeries(f.name, f.name, True, _COUNTER_HELP[f.name])
            if f.name in _COUNTER_HELP
            else CountSeries(f.name, f.name, False, _GAUGE_HELP[f.name])
            for f in fields(CacheStats)
        )

    def to_prometheus(
        self, prefix: str = "qsa_hostcache", labels: Mapping[str, str] | None = None
    ) -> str:
        """Render as Prometheus text exposition lines (counters get a ``_total`` suffix).

        Args:
            prefix: Metric name prefix.
            labels: Constant labels for every sample, e.g. ``{"tp_rank": "0"}``.

        Returns:
            ``# HELP``/``# TYPE``/sample lines, newline-terminated.
        """
        label_text = ""
        if labels:
            parts = []
            for name, value in sorted(labels.items()):
                escaped = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
                parts.append(f'{name}="{escaped}"')
            label_text = "{" + ",".join(parts) + "}"
        lines: list[str] = []
        for series in self.series():
            value = getattr(self, series.name)
            if series.counter:
                metric, kind = f"{prefix}_{series.name}_total", "counter"
            else:
                metric, kind = f"{prefix}_{series.name}", "gauge"
            lines.append(f"# HELP {metric} {series.help}")
            lines.append(f"# TYPE {metric} {kind}")
            lines.append(f"{metric}{label_text} {int(value)}")
        return "\n".join(lines) + "\n"
