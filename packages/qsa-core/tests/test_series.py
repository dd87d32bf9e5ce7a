"""A count's series: what an exporter records of each snapshot, and the sinks it feeds."""

from __future__ import annotations

from dataclasses import dataclass

from qsa_core import CountSeries, CountsExport


@dataclass(frozen=True)
class _Counts:
    rows: int = 0
    steps: int = 0


ROWS = CountSeries("rows", "rows_in_use", False, "Rows in use.")
STEPS = CountSeries("steps", "decode_steps", True, "Decode steps.", ("mode", "eager"))


def test_a_gauge_records_its_value_each_snapshot() -> None:
    assert ROWS.change(None, _Counts(rows=2)) == 2
    assert ROWS.change(_Counts(rows=2), _Counts(rows=0)) == 0


def test_a_counter_records_what_it_added_from_zero_at_the_first_snapshot() -> None:
    assert STEPS.change(None, _Counts(steps=5)) == 5
    assert STEPS.change(_Counts(steps=5), _Counts(steps=9)) == 4
    assert STEPS.change(_Counts(steps=9), _Counts(steps=9)) is None
    assert STEPS.change(None, _Counts()) is None


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
