"""Exceptions raised by qsa-hostcache.

Bad input raises a ``ValueError`` subclass; a call made in the wrong state of a checkpoint's life
raises a ``RuntimeError`` subclass. Running out of room is not an error: ``reserve``/``publish``
return ``None`` and ``match`` misses.
"""

from __future__ import annotations


class HostCacheError(Exception):
    """Base class of every exception this package raises on purpose."""


class CacheConfigError(HostCacheError, ValueError):
    """A size given to the cache (budget, block, page, alignment, entries) is not allowed."""


class ArenaAllocationError(HostCacheError, MemoryError):
    """The host could not allocate (or pin) the arena of the requested size."""


class InvalidKeyError(HostCacheError, ValueError):
    """A namespace, token sequence, page size or page extra identity is malformed."""


class CheckpointTooLarge(HostCacheError, ValueError):  # noqa: N818 (the name states the condition)
    """A checkpoint needs more bytes than the whole arena holds; no eviction could fit it."""

    def __init__(self, checkpoint_bytes: int, capacity_bytes: int, block_bytes: int) -> None:
        self.checkpoint_bytes = checkpoint_bytes
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        super().__init__(
            f"checkpoint of {checkpoint_bytes!r} bytes (rounded up to blocks of {block_bytes!r} "
            f"bytes) exceeds the arena capacity of {capacity_bytes!r} bytes; raise the budget or "
            f"publish a shorter prefix"
        )


class SegmentError(HostCacheError, ValueError):
    """Segments given to publish or restore do not match the checkpoint's declared segments."""


class TicketStateError(HostCacheError, RuntimeError):
    """A publish ticket was used in a state that does not allow the call (e.g. commit twice)."""


class LeaseError(HostCacheError, RuntimeError):
    """A lease was used after release, or released twice."""


class DeviceError(HostCacheError, RuntimeError):
    """A tensor lives on a device the arena cannot copy to or from."""


class CorruptObjectError(HostCacheError, ValueError):
    """An object read from a shared tier has a wrong frame, length or digest (never used)."""


class StoreUnavailableError(HostCacheError, ImportError):
    """A shared tier's store cannot be reached from here: its client is not installed."""
