"""A count's series: what an exporter records of each snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from qsa_core import CountSeries


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
