"""Prometheus series of one TP rank, made the one way SGLang's multiprocess registry reads them.

Every series carries a ``tp_rank`` label; gauges are summed over the live processes
(``multiprocess_mode="livesum"``: SGLang serves ``/metrics`` from another process than the
schedulers that set them). A family is registered once per process and shared by every object
that reports to it (two runtimes of one process, each with its own ``tp_rank``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, TypeVar

from qsa_core import CountSeries, CountsExport

__all__ = ("CountsMirror", "RankMetrics")

_Label = TypeVar("_Label", bound=enum.Enum)

#: Families this process registered, by name: (kind, label names, family).
_FAMILIES: dict[str, tuple[type[Any], tuple[str, ...], Any]] = {}


def _family(kind: type[Any], name: str, doc: str, labels: tuple[str, ...], **options: Any) -> Any:
    """The family ``name``: registered on first use, the same object after.

    Raises:
        ValueError: ``name`` was registered as another kind or with other labels.
    """
    known = _FAMILIES.get(name)
    if known is None:
        known = _FAMILIES[name] = (kind, labels, kind(name, doc, labelnames=labels, **options))
    elif known[:2] != (kind, labels):
        msg = (
            f"metric {name!r} is a {known[0].__name__} labelled {known[1]!r}; asked for a "
            f"{kind.__name__} labelled {labels!r}"
        )
        raise ValueError(msg)
    return known[2]


class RankMetrics:
    """Makes the series of TP rank ``tp_rank`` (counters named without the ``_total`` added)."""

    def __init__(self, tp_rank: int) -> None:
        self._rank = str(tp_rank)

    def counter(self, name: str, doc: str, label: tuple[str, str] | None = None) -> Any:
        """A counter of this rank, with ``label`` (name, value) in its family if given."""
        from prometheus_client import Counter

        names: tuple[str, ...] = ("tp_rank",)
        values = {"tp_rank": self._rank}
        if label is not None:
            names, values = (*names, label[0]), {**values, label[0]: label[1]}
        return _family(Counter, name, doc, names).labels(**values)

    def gauge(self, name: str, doc: str) -> Any:
        """A gauge of this rank, summed over live processes."""
        from prometheus_client import Gauge

        family = _family(Gauge, name, doc, ("tp_rank",), multiprocess_mode="livesum")
        return family.labels(tp_rank=self._rank)

    def counters_by(
        self, name: str, doc: str, label: str, values: Iterable[_Label]
    ) -> dict[_Label, Any]:
        """One counter of this rank per member of ``values``, labelled ``label=member.value``."""
        return {v: self.counter(name, doc, (label, v.value)) for v in values}


class CountsMirror:
    """A library's counts (a dataclass), snapshot after snapshot, as ``prefix``'s series.

    ``series`` describes the fields; :class:`qsa_core.CountsExport` hands each snapshot's
    changes to the series' counters (``inc``) and gauges (``set``).
    """

    def __init__(self, make: RankMetrics, prefix: str, series: Iterable[CountSeries]) -> None:
        self._export = CountsExport(
            (s, make.counter(f"{prefix}_{s.name}", s.help, s.label).inc)
            if s.counter
            else (s, make.gauge(f"{prefix}_{s.name}", s.help).set)
            for s in series
        )

    def update(self, now: object) -> None:
        """Mirror the snapshot ``now``."""
        self._export.update(now)
