"""A library's counts handed to sinks: gauges set each snapshot, counters increased."""

from __future__ import annotations

from dataclasses import dataclass

from qsa_core import CountSeries, CountsExport


@dataclass(frozen=True)
class _Counts:
    rows: int = 0
    steps: int = 0


ROWS = CountSeries("rows", "rows_in_use", False, "Rows in use.")
STEPS = CountSeries("steps", "decode_steps", True, "Decode steps.", ("mode", "eager"))


def test_each_snapshot_hands_gauges_their_value_and_counters_what_they_added() -> None:
    """Gauges every snapshot; counters from zero at the first, then only what they added."""
    gauge: list[int] = []
    counter: list[int] = []
    export = CountsExport([(ROWS, gauge.append), (STEPS, counter.append)])
    export.update(_Counts(rows=2, steps=5))
    export.update(_Counts(rows=0, steps=5))  # the counter added nothing: not called
    export.update(_Counts(rows=1, steps=9))
    assert gauge == [2, 0, 1]
    assert counter == [5, 4]


def test_a_first_snapshot_of_zero_counts_calls_only_the_gauges() -> None:
    """Nothing counted yet: the gauge still reads 0, the counter is left alone."""
    calls: list[tuple[str, int]] = []
    export = CountsExport(
        [
            (ROWS, lambda v: calls.append(("rows", v))),
            (STEPS, lambda v: calls.append(("steps", v))),
        ]
    )
    export.update(_Counts())
    assert calls == [("rows", 0)]
