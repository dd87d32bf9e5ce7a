"""The public facade: :class:`HostPrefixCache`, its publish tickets, matches and leases.

Every public method takes the cache's lock only for bookkeeping; bytes move outside it, so a copy
worker can write a large checkpoint while the scheduler thread matches.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

import torch

from qsa_hostcache._arena import CopyFence, HostArena, byte_view
from qsa_hostcache._errors import (
    CacheConfigError,
    InvalidKeyError,
    LeaseError,
    SegmentError,
    TicketStateError,
)
from qsa_hostcache._index import EntryState, IndexEntry, PrefixIndex
from qsa_hostcache._keys import DEFAULT_HASHER, PageHasher, PrefixKey
from qsa_hostcache._layout import CheckpointLayout, SegmentSpec
from qsa_hostcache._stats import CacheStats

logger = logging.getLogger(__name__)


class TicketState(enum.Enum):
    """Where a publish is.

    ``RESERVED``: space held, segments being written, never matched. ``COMMITTING``: committed,
    device copies still in flight (visible once they finish; see :meth:`HostPrefixCache.poll`).
    ``PUBLISHED``: matchable. ``ABORTED``: space freed by the caller. ``STALE``: the cache was
    invalidated before the checkpoint became visible; space freed.
    """

    RESERVED = "reserved"
    COMMITTING = "committing"
    PUBLISHED = "published"
    ABORTED = "aborted"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class Match:
    """A published checkpoint that is a prefix of a query.

    Attributes:
        entry_id: The checkpoint's id in this cache.
        num_pages: Complete pages the checkpoint covers.
        num_tokens: ``num_pages * page_size``: the query's first ``num_tokens`` tokens are cached.
        segments: The checkpoint's segments, in publish order.
        cache_id: The cache that found it (:meth:`HostPrefixCache.pin` refuses another cache's).
    """

    entry_id: int
    num_pages: int
    num_tokens: int
    segments: tuple[SegmentSpec, ...]
    cache_id: int = -1

    def segment(self, name: str) -> SegmentSpec:
        """The spec of the segment called ``name``.

        Raises:
            SegmentError: No such segment.
        """
        for spec in self.segments:
            if spec.name == name:
                return spec
        raise SegmentError(
            f"checkpoint has no segment {name!r}; its segments are "
            f"{[s.name for s in self.segments]!r}"
        )


def _match_of(entry: IndexEntry, cache_id: int) -> Match:
    return Match(entry.entry_id, entry.num_pages, entry.num_tokens, entry.layout.segments, cache_id)


class Lease:
    """A pin on one checkpoint: while held, the checkpoint is never evicted or freed.

    Not a request lease (that is ``qsa_core.LeaseTable``, a request's offload lifecycle): this
    pins cached bytes for the time one restore's copies take.

    Release it (or leave its ``with`` block) after the restore's copies are enqueued; the arena
    orders any later overwrite of the blocks after those copies.
    """

    __slots__ = ("_cache", "_entry", "_released", "match")

    def __init__(self, cache: HostPrefixCache, entry: IndexEntry) -> None:
        self._cache = cache
        self._entry = entry
        self._released = False
        self.match = _match_of(entry, cache._cache_id)

    @property
    def active(self) -> bool:
        return not self._released

    def release(self) -> None:
        """Drop the pin.

        Raises:
            LeaseError: Already released.
        """
        with self._cache._lock:
            if self._released:
                raise LeaseError(f"lease on entry {self.match.entry_id!r} was already released")
            self._released = True
            self._cache._index.unpin(self._entry)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._released:
            self.release()


class PublishTicket:
    """One checkpoint being published: write its segments, then commit (or abort).

    A ticket belongs to one thread at a time (typically the copy worker).
    """

    __slots__ = ("_cache", "_entry", "_fences", "_state", "_written")

    def __init__(self, cache: HostPrefixCache, entry: IndexEntry) -> None:
        self._cache = cache
        self._entry = entry
        self._written: set[str] = set()
        self._fences: list[CopyFence] = []
        self._state = TicketState.RESERVED

    @property
    def entry_id(self) -> int:
        return self._entry.entry_id

    @property
    def num_tokens(self) -> int:
        return self._entry.num_tokens

    @property
    def segments(self) -> tuple[SegmentSpec, ...]:
        return self._entry.layout.segments

    @property
    def state(self) -> TicketState:
        return self._state

    def write(self, segments: Mapping[str, torch.Tensor]) -> CopyFence:
        """Copy segments in: from CPU tensors synchronously, from CUDA tensors on the write stream.

        Each segment is written once; several calls may split the segments between them. A CUDA
        copy starts after the work already queued on the current stream (the producer); the
        producer must not overwrite a source before the returned fence (``fence.wait()`` orders
        the current stream after it).

        Args:
            segments: Name -> tensor; the tensor's bytes must equal the spec's ``nbytes`` (and
                its dtype and shape the spec's, where the spec has them).

        Returns:
            The fence of this call's copies (done already when every source is on the CPU).

        Raises:
            TicketStateError: The ticket is no longer RESERVED.
            SegmentError: Unknown or repeated name, or a tensor that does not fit its spec.
            DeviceError: A tensor on a device other than CPU or the arena's CUDA device.
        """
        if self._state is not TicketState.RESERVED:
            raise TicketStateError(
                f"write needs a 'reserved' ticket; entry {self.entry_id!r} is {self._state.value!r}"
            )
        entry = self._entry
        items = []
        for name, tensor in _checked(
            entry.layout, segments, self._cache._arena, target=False, written=self._written
        ):
            # Rows the base holds are not copied again: only the rest goes to this entry's blocks.
            shared = entry.shared.get(name, 0)
            tail = tensor[shared:] if shared else tensor
            items.append((entry.stored.offsets[entry.stored.index(name)], tail))
        fence = self._cache._arena.write(entry.blocks, items)
        self._fences.append(fence)
        self._written.update(segments)
        return fence

    def commit(self) -> TicketState:
        """Publish: visible now if the copies are done, else once they finish.

        Returns:
            ``PUBLISHED``, ``COMMITTING`` (device copies in flight), or ``STALE``.

        Raises:
            TicketStateError: Not RESERVED, or a segment was never written (the message lists
                the missing names).
        """
        if self._state is not TicketState.RESERVED:
            raise TicketStateError(
                f"commit needs a 'reserved' ticket; entry {self.entry_id!r} is "
                f"{self._state.value!r}"
            )
        missing = [s.name for s in self.segments if s.name not in self._written]
        if missing:
            raise TicketStateError(
                f"entry {self.entry_id!r}: segments {missing!r} were never written"
            )
        with self._cache._lock:
            if all(f.done() for f in self._fences):
                self._finish()
            else:
                self._state = TicketState.COMMITTING
                self._cache._committing.append(self)
        return self._state

    def wait(self) -> bool:
        """Block until the copies finish and the commit lands; True if the checkpoint is visible.

        Raises:
            TicketStateError: Still RESERVED (commit first).
        """
        if self._state is TicketState.RESERVED:
            raise TicketStateError(f"entry {self.entry_id!r}: commit before wait")
        for fence in self._fences:
            fence.synchronize()
        with self._cache._lock:
            if self._state is TicketState.COMMITTING:
                self._cache._committing.remove(self)
                self._finish()
        return self._state is TicketState.PUBLISHED

    def abort(self) -> None:
        """Give the space back. Waits for copies in flight. No-op once aborted or stale.

        Raises:
            TicketStateError: Already published.
        """
        if self._state in (TicketState.ABORTED, TicketState.STALE):
            return
        if self._state is TicketState.PUBLISHED:
            raise TicketStateError(f"entry {self.entry_id!r} is published; it cannot abort")
        for fence in self._fences:
            fence.synchronize()
        with self._cache._lock:
            if self._state is TicketState.COMMITTING:
                self._cache._committing.remove(self)
            if self._entry.state is EntryState.RESERVED:
                self._cache._index.abort(self._entry)
            self._state = TicketState.ABORTED

    def _finish(self) -> None:
        """Commit in the index; the caller holds the lock and every fence is done."""
        ok = self._cache._index.commit(self._entry)
        self._state = TicketState.PUBLISHED if ok else TicketState.STALE

    def __repr__(self) -> str:
        return (
            f"PublishTicket(entry_id={self.entry_id!r}, num_tokens={self.num_tokens!r}, "
            f"state={self._state.value!r})"
        )


def _checked(
    layout: CheckpointLayout,
    tensors: Mapping[str, torch.Tensor],
    arena: HostArena,
    *,
    target: bool,
    written: set[str] | frozenset[str] = frozenset(),
) -> list[tuple[str, torch.Tensor]]:
    """``(segment name, tensor)`` for each named tensor, each checked; copies nothing.

    Checked: the name is a segment of ``layout`` not in ``written``, the arena can copy the
    tensor, and it fits its segment.

    Raises:
        SegmentError: An unknown name, a name in ``written``, a tensor the arena cannot copy
            (:meth:`HostArena.check`), or one that does not fit.
        DeviceError: A tensor on a device the arena does not copy.
    """
    items = []
    for name, tensor in tensors.items():
        i = layout.index(name)
        if name in written:
            raise SegmentError(f"segment {name!r} was already written")
        arena.check(tensor, target=target)
        _check_fits(layout.segments[i], tensor)
        items.append((name, tensor))
    return items


def _check_fits(spec: SegmentSpec, tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != spec.nbytes:
        raise SegmentError(
            f"segment {spec.name!r} holds {spec.nbytes!r} bytes; the tensor has {nbytes!r} "
            f"(shape {tuple(tensor.shape)!r}, dtype {tensor.dtype!r})"
        )
    if spec.dtype is not None and str(tensor.dtype) != spec.dtype:
        raise SegmentError(
            f"segment {spec.name!r} has dtype {spec.dtype!r}; the tensor has {str(tensor.dtype)!r}"
        )
    if spec.shape is not None and tuple(tensor.shape) != spec.shape:
        raise SegmentError(
            f"segment {spec.name!r} has shape {spec.shape!r}; the tensor has "
            f"{tuple(tensor.shape)!r}"
        )


_CACHE_IDS = itertools.count()


class HostPrefixCache:
    """Prefix checkpoints in one host arena, matched by exact key material, evicted LRU.

    Args:
        budget_bytes: Host bytes for checkpoints (per TP rank). The arena holds
            ``budget_bytes // block_bytes`` blocks and is allocated here, once.
        max_entries: Most checkpoints alive at once (being written, matchable, or retired).
        page_size: Tokens per page; every key must use it.
        block_bytes: Allocation unit of the arena. A checkpoint occupies
            ``ceil(total_bytes / block_bytes)`` blocks.
        segment_align: Byte alignment of each segment inside a checkpoint.
        pin_memory: Pin the arena. ``None`` (default) pins exactly when CUDA is available;
            ``True`` without CUDA raises :class:`DeviceError`.
        device: CUDA device whose tensors the arena copies (default: the current one).
        hasher: Page hasher for the key chain (default xxh3-64). Change it only for tests.

    Raises:
        CacheConfigError: a size that is not a positive int, or ``budget_bytes`` below one block.
        ArenaAllocationError: the host cannot allocate (or pin) an arena of that size.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        max_entries: int = 256,
        page_size: int = 64,
        block_bytes: int = 1 << 20,
        segment_align: int = 256,
        pin_memory: bool | None = None,
        device: torch.device | str | int | None = None,
        hasher: PageHasher = DEFAULT_HASHER,
    ) -> None:
        sizes: tuple[tuple[str, object], ...] = (
            ("budget_bytes", budget_bytes),
            ("block_bytes", block_bytes),
            ("page_size", page_size),
            ("segment_align", segment_align),
            ("max_entries", max_entries),
        )
        for name, value in sizes:  # typed as object: callers pass what they pass
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CacheConfigError(f"{name}={value!r} is not allowed; it must be an int >= 1")
        num_blocks = budget_bytes // block_bytes
        if num_blocks < 1:
            raise CacheConfigError(
                f"budget_bytes {budget_bytes!r} is below one block of {block_bytes!r} bytes"
            )
        self._segment_align = segment_align
        self._lock = threading.RLock()
        self._cache_id = next(_CACHE_IDS)
        # The arena first: a size the host cannot hold fails here, before any per-block table.
        self._arena = HostArena(
            num_blocks * block_bytes, block_bytes, pin_memory=pin_memory, device=device
        )
        self._index = PrefixIndex(
            num_blocks, block_bytes, max_entries, page_size, hasher, segment_align=segment_align
        )
        self._committing: list[PublishTicket] = []

    # ---- configuration ---------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self._index.page_size

    @property
    def capacity_bytes(self) -> int:
        """Arena bytes (``num_blocks * block_bytes`` <= the budget)."""
        return self._arena.capacity_bytes

    @property
    def block_bytes(self) -> int:
        return self._index.block_bytes

    @property
    def max_entries(self) -> int:
        return self._index.max_entries

    @property
    def pinned(self) -> bool:
        """True when the arena is page-locked host memory."""
        return self._arena.pinned

    @property
    def hasher(self) -> PageHasher:
        return self._index.hasher

    # ---- publish ---------------------------------------------------------------------------

    def layout(self, segments: Sequence[SegmentSpec]) -> CheckpointLayout:
        """Where ``segments`` would sit in a checkpoint (for sizing before a publish)."""
        return CheckpointLayout.plan(tuple(segments), self._segment_align)

    def reserve(self, key: PrefixKey, segments: Sequence[SegmentSpec]) -> PublishTicket | None:
        """Hold space for a checkpoint of ``key``; evicts LRU unpinned checkpoints if that helps.

        Args:
            key: The checkpoint's key: whole pages only (use :meth:`PrefixKey.prefix`).
            segments: The checkpoint's segments, in the order they are laid out.

        Returns:
            A ticket to write and commit, or ``None`` when no eviction can make room or the same
            key material is already cached or being written.

        Raises:
            InvalidKeyError: Wrong page size, no complete page, or a trailing partial page.
            SegmentError: No segments or a repeated name.
            CheckpointTooLarge: The checkpoint exceeds the whole arena; states both sizes.
        """
        self._check_key(key)
        if key.num_pages < 1 or key.num_tokens % key.page_size:
            raise InvalidKeyError(
                f"a checkpoint covers whole pages; got {key.num_tokens!r} tokens with page size "
                f"{key.page_size!r} (use key.prefix(num_pages))"
            )
        layout = self.layout(segments)
        with self._lock:
            self._poll_locked()
            entry = self._index.reserve(key, layout)
        return None if entry is None else PublishTicket(self, entry)

    def publish(
        self, key: PrefixKey, segments: Mapping[str, torch.Tensor], *, wait: bool = False
    ) -> PublishTicket | None:
        """Reserve, write every segment and commit, in one call.

        Segment specs are taken from the tensors (bytes, dtype, shape) in mapping order. With
        CUDA tensors the checkpoint becomes visible when the copies finish (``wait=True`` blocks
        until then); with CPU tensors it is visible on return.

        Returns:
            The committed ticket, or ``None`` (no room, or already cached).

        Raises:
            DeviceError: A tensor on a device other than CPU or the arena's CUDA device.
            SegmentError: A tensor the arena cannot copy (nested, quantized, sparse or another
                non-strided layout; see :meth:`HostArena.check`).
            Both before anything is reserved or evicted.
        """
        # Every tensor is checked before the reservation, which may evict checkpoints: a publish
        # that cannot copy its tensors must leave the cache as it was.
        self._check_key(key)
        for tensor in segments.values():
            self._arena.check(tensor, target=False)
        specs = [SegmentSpec.like(name, tensor) for name, tensor in segments.items()]
        ticket = self.reserve(key, specs)
        if ticket is None:
            return None
        try:
            ticket.write(segments)
            ticket.commit()
        except BaseException:
            ticket.abort()
            raise
        if wait:
            ticket.wait()
        return ticket

    def poll(self) -> int:
        """Make visible every committed checkpoint whose copies have finished; returns how many."""
        with self._lock:
            return self._poll_locked()

    def drain(self) -> int:
        """Wait for the copies of every committing checkpoint, then land their commits.

        For an idle moment (the last request of a burst has gone): nothing is left ``COMMITTING``
        and the occupancy gauges read what the arena holds. Blocks the calling thread until the
        copies in flight finish; the device's other streams go on.

        Returns:
            How many commits landed (published, or stale after an invalidation).
        """
        with self._lock:
            fences = [fence for ticket in self._committing for fence in ticket._fences]
        for fence in fences:
            fence.synchronize()
        return self.poll()

    def _poll_locked(self) -> int:
        if not self._committing:
            return 0
        finished = [t for t in self._committing if all(f.done() for f in t._fences)]
        for ticket in finished:
            self._committing.remove(ticket)
            ticket._finish()
        return len(finished)

    # ---- match and restore -----------------------------------------------------------------

    def match(self, query: PrefixKey, *, max_tokens: int | None = None) -> Match | None:
        """The longest published checkpoint whose key material is a prefix of ``query``.

        Args:
            query: The request's key; only its complete pages take part.
            max_tokens: Match at most this many tokens (e.g. to leave the logits tail).

        Returns:
            The match (touched in the LRU order) or ``None``. Nothing is pinned: use
            :meth:`acquire` or :meth:`pin` before restoring.
        """
        self._check_key(query)
        with self._lock:
            self._poll_locked()
            entry = self._index.longest_match(query, self._page_limit(max_tokens))
            return None if entry is None else _match_of(entry, self._cache_id)

    def acquire(self, query: PrefixKey, *, max_tokens: int | None = None) -> Lease | None:
        """:meth:`match` and pin the result in one step."""
        self._check_key(query)
        with self._lock:
            self._poll_locked()
            entry = self._index.longest_match(query, self._page_limit(max_tokens))
            if entry is None:
                return None
            pinned = self._index.pin(entry.entry_id)
            assert pinned is entry
            return Lease(self, entry)

    def pin(self, match: Match) -> Lease | None:
        """Pin a checkpoint found earlier; ``None`` if it was evicted or invalidated since.

        Raises:
            LeaseError: ``match`` is not a :class:`Match`, or was found by another cache (its entry
                id means nothing here).
        """
        if not isinstance(match, Match):
            raise LeaseError(f"pin takes a Match this cache returned; got {match!r}")
        if match.cache_id != self._cache_id:
            raise LeaseError(
                f"match of entry {match.entry_id!r} came from cache {match.cache_id!r}; this is "
                f"cache {self._cache_id!r}"
            )
        with self._lock:
            entry = self._index.pin(match.entry_id)
            return None if entry is None else Lease(self, entry)

    def restore(self, lease: Lease, into: Mapping[str, torch.Tensor]) -> CopyFence:
        """Copy the leased checkpoint's segments into caller tensors.

        Args:
            lease: An active lease on the checkpoint.
            into: Name -> contiguous tensor on CPU or the arena's CUDA device, one per segment to
                restore (a subset is fine); its bytes, dtype and shape must fit the spec.

        Returns:
            The copies' fence: done already for CPU targets; for CUDA targets call
            ``fence.wait()`` (stream order) or ``fence.synchronize()`` before reading them.

        Raises:
            LeaseError: The lease was released.
            SegmentError: Unknown name, a tensor that does not fit its spec, or a target that is
                not plain and contiguous (see :meth:`HostArena.check`).
            DeviceError: A target on a device other than CPU or the arena's CUDA device.
        """
        if not lease.active or lease._cache is not self:
            raise LeaseError(f"restore needs an active lease of this cache, got {lease.match!r}")
        entry = lease._entry
        items = []
        nbytes = 0
        for name, tensor in _checked(entry.layout, into, self._arena, target=True):
            view = byte_view(tensor, writable=True)
            nbytes += view.numel()
            for blocks, offset, first, count in entry.sources(name):
                items.append((blocks, offset, view[first : first + count]))
        fence = self._arena.read(items)
        with self._lock:
            self._index.counters.restores += 1
            self._index.counters.bytes_out += nbytes
        return fence

    # ---- invalidation and statistics -------------------------------------------------------

    def invalidate_all(self) -> int:
        """Drop every checkpoint (after a weight update or a flush); returns how many were visible.

        Pinned checkpoints stay readable by their leases and are freed on release; checkpoints
        being written are freed when they commit.
        """
        with self._lock:
            dropped = self._index.invalidate_all()
        logger.info("host prefix cache invalidated: %d checkpoints dropped", dropped)
        return dropped

    def stats(self) -> CacheStats:
        """A consistent snapshot of counters and occupancy."""
        with self._lock:
            self._poll_locked()
            c = self._index.counters
            census = self._index.census()
            return CacheStats(
                **dataclasses.asdict(c),
                entries=census.reserved + census.ready + census.retired,
                ready_entries=census.ready,
                reserved_entries=census.reserved,
                retired_entries=census.retired,
                pinned_entries=census.pinned,
                used_bytes=census.used_blocks * self._index.block_bytes,
                payload_bytes=census.payload_bytes,
                capacity_bytes=self._arena.capacity_bytes,
                block_bytes=self._index.block_bytes,
                max_entries=self._index.max_entries,
                pinned_memory=self._arena.pinned,
            )

    def lru_order(self) -> list[int]:
        """Ids of matchable checkpoints, least recently used (next to evict) first."""
        with self._lock:
            return self._index.lru_ids()

    # ---- internals -------------------------------------------------------------------------

    def _check_key(self, key: PrefixKey) -> None:
        if not isinstance(key, PrefixKey):
            raise InvalidKeyError(f"a key must be a PrefixKey; got {key!r}")
        if key.page_size != self._index.page_size:
            raise InvalidKeyError(
                f"key page size {key.page_size!r} differs from the cache's "
                f"{self._index.page_size!r}"
            )

    def _page_limit(self, max_tokens: int | None) -> int | None:
        if max_tokens is None:
            return None
        given: object = max_tokens  # callers' values, checked whatever their annotation says
        if isinstance(given, bool) or not isinstance(given, int) or given < 0:
            raise InvalidKeyError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        return max_tokens // self._index.page_size

    def __repr__(self) -> str:
        return (
            f"HostPrefixCache(capacity_bytes={self.capacity_bytes!r}, "
            f"block_bytes={self.block_bytes!r}, max_entries={self.max_entries!r}, "
            f"page_size={self.page_size!r}, pinned={self.pinned!r})"
        )
