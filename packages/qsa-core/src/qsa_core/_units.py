"""Byte counts as an operator reads them."""

from __future__ import annotations

__all__ = ("format_bytes",)

_KIB = 1024


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1, three decimals (``1.500 GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < _KIB or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.3f} {unit}"
        value /= _KIB
    raise AssertionError  # pragma: no cover - the loop always returns
