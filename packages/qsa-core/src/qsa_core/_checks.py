"""Small value checks shared by the modules (no public surface)."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """True for a Python ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
