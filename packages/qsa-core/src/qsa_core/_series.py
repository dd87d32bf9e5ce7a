"""How a library describes one field of its counts as a metric an engine exports."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("CountSeries",)


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
