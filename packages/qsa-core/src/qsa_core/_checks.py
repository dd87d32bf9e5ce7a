"""Small value checks shared by the modules (no public surface)."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """True for a Python ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
