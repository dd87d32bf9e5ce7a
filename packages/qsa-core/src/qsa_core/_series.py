"""How a library describes one field of its counts as a metric, and hands an engine its changes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ("CountSeries", "CountsExport")


@dataclass(frozen=True, slots=True)
class CountSeries:
    """One field of a library's counts (a frozen dataclass of ints) as a metric.

    Attributes:
        field: the field's name (``decode_steps``...).
        name: the metric's name after an engine's prefix (a counter's without the ``_total``
            its exposition adds). Fields with one ``name`` and a ``label`` each are one family.
        counter: True for a monotonic counter (the field is cumulative), False for a gauge.
        help: one line that says what it counts, for the metric's help text.
        label: ``(label name, value)`` of this field within its family, or None.
    """

    field: str
    name: str
    counter: bool
    help: str
    label: tuple[str, str] | None = None

    def change(self, before: object | None, now: object) -> int | None:
        """What an exporter records of snapshot ``now`` after ``before`` (None: the first).

        A gauge: the field's value in ``now``. A counter: what the field added since ``before``
        (since zero at the first snapshot); None where it added nothing.
        """
        value = int(getattr(now, self.field))
        if not self.counter:
            return value
        added = value - (0 if before is None else int(getattr(before, self.field)))
        return added if added > 0 else None


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
