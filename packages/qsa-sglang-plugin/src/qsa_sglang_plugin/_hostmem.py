"""What this host can lend as memory: a ``/proc/meminfo`` field."""

from __future__ import annotations

from pathlib import Path

__all__ = ("meminfo_bytes",)


def meminfo_bytes(field: str, path: Path = Path("/proc/meminfo")) -> int | None:
    """A ``/proc/meminfo``-style field (``"MemAvailable"``) in bytes; None if unreadable."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
