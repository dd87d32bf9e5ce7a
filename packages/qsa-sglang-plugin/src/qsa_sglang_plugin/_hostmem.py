"""What this host can lend as memory: free RAM, and bytes shown the way an operator reads them."""

from __future__ import annotations

from pathlib import Path

__all__ = ("format_bytes", "meminfo_bytes")


def format_bytes(n: int) -> str:
    """``n`` bytes as ``"1.5 GiB"``, ``"12.0 MiB"``, ``"3.0 KiB"`` or ``"512 B"``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def meminfo_bytes(field: str, path: Path = Path("/proc/meminfo")) -> int | None:
    """A ``/proc/meminfo``-style field (``"MemAvailable"``) in bytes; None if unreadable."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
