"""A library's counts, snapshot after snapshot, handed to an engine's metrics change by change."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from qsa_core._series import CountSeries

__all__ = ("CountsExport",)


class CountsExport:
    """Each :class:`CountSeries`' change of successive snapshots, given to that series' sink.

    A sink records one number: a gauge's value (its ``set``), a counter's increase (its ``inc``),
    as :meth:`CountSeries.change` says; a counter that added nothing is not called.

    Args:
        sinks: ``(series, sink)`` pairs, one per field of the counts to export.
    """

    def __init__(self, sinks: Iterable[tuple[CountSeries, Callable[[int], object]]]) -> None:
        self._sinks = tuple(sinks)
        self._seen: object | None = None

    def update(self, now: object) -> None:
        """Hand snapshot ``now``'s changes since the last snapshot (since zero at the first)."""
        for series, sink in self._sinks:
            value = series.change(self._seen, now)
            if value is not None:
                sink(value)
        self._seen = now
