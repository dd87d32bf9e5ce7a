"""Where checkpoints are, and which one to drop: the cache's policy, with no torch and no bytes.

The index owns the entry table, the block allocator, the LRU order and the pins. It never touches
memory; the arena moves the bytes for the block ids the index hands out. A disk tier would add a
second allocator and a location per entry here, and a second byte mover beside the arena, without
changing the facade's API.

Entry life::

    reserve ──> RESERVED ──commit──> READY ──invalidate (pinned)──> RETIRED ──last unpin──> freed
                   │ abort / stale commit          │ evict (unpinned) / invalidate
                   └───────> freed                 └──────> freed

Only READY entries match; only READY entries with no pins are evicted; RESERVED and RETIRED
entries hold their blocks and count against ``max_entries``.

A checkpoint may extend another (its *base*: the longest READY checkpoint that is a prefix of it
and shares some ``token_rows`` segment): it stores only the rows its base lacks, and a restore
reads the rest from the base, and from the base's base. An entry that later checkpoints read from
(its *dependents*) is neither evicted nor freed while they live: eviction takes a checkpoint
after the ones that extend it, and an invalidated base retires until its last dependent is gone.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from qsa_hostcache._errors import CheckpointTooLarge, LeaseError, TicketStateError
from qsa_hostcache._keys import TOKEN_BYTES, PageHash, PageHasher, PrefixKey
from qsa_hostcache._layout import BlockAllocator, CheckpointLayout

logger = logging.getLogger(__name__)


class EntryState(enum.Enum):
    """Where an entry is in its life (see the module docstring)."""

    RESERVED = "reserved"
    READY = "ready"
    RETIRED = "retired"
    FREED = "freed"


Source = tuple[tuple[int, ...], int, int, int]
"""Where part of a segment is stored: ``(blocks, stream offset, first byte in the segment,
nbytes)``; the blocks are those of the checkpoint that stores it."""


@dataclass(slots=True, eq=False)
class IndexEntry:
    """One checkpoint: its full key material, its layout and the blocks that hold it.

    ``layout`` is the checkpoint as published (every segment whole); ``stored`` is what its own
    blocks hold: each segment less the ``shared`` rows (by segment name) read from ``base``.
    """

    entry_id: int
    namespace: bytes
    tokens: bytes
    extras: dict[int, bytes]
    num_pages: int
    page_size: int
    end_hash: int
    layout: CheckpointLayout
    blocks: tuple[int, ...]
    epoch: int
    stored: CheckpointLayout
    base: IndexEntry | None = None
    shared: dict[str, int] = field(default_factory=dict)
    state: EntryState = EntryState.RESERVED
    pins: int = 0
    dependents: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def shared_bytes(self) -> int:
        """Payload bytes this checkpoint reads from its base instead of storing them."""
        return self.layout.payload_bytes - self.stored.payload_bytes

    def chain(self) -> Iterator[IndexEntry]:
        """This entry, its base, the base's base... (the entries its restores read)."""
        entry: IndexEntry | None = self
        while entry is not None:
            yield entry
            entry = entry.base

    def sources(self, name: str) -> list[Source]:
        """Where segment ``name``'s bytes are, first rows first (its base's, then its own)."""
        spec = self.layout.segments[self.layout.index(name)]
        out: list[Source] = []
        entry: IndexEntry | None = self
        while entry is not None:
            i = entry.stored.index(name)
            first = entry.shared.get(name, 0) * spec.row_bytes
            nbytes = entry.stored.segments[i].nbytes
            out.append((entry.blocks, entry.stored.offsets[i], first, nbytes))
            entry = entry.base if first else None
        return out[::-1]

    def is_prefix_of(self, query: PrefixKey) -> bool:
        """Full key-material check: namespace, every token id and every page extra."""
        if query.namespace_material != self.namespace or query.page_size != self.page_size:
            return False
        if not query.token_bytes.startswith(self.tokens):
            return False
        q_extras = query._extras  # same package; no copy
        if not q_extras:
            return not self.extras
        n = self.num_pages
        return {p: e for p, e in q_extras.items() if p < n} == self.extras


@dataclass(slots=True)
class Counters:
    """Monotonic counters; the facade turns them into :class:`CacheStats`."""

    lookups: int = 0
    hits: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    publishes: int = 0
    bytes_in: int = 0
    shared_bytes: int = 0
    restores: int = 0
    bytes_out: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    refusals: int = 0
    too_large: int = 0
    duplicates: int = 0
    aborts: int = 0
    stale_publishes: int = 0
    invalidations: int = 0
    invalidated_entries: int = 0


@dataclass(slots=True)
class _Census:
    reserved: int = 0
    ready: int = 0
    retired: int = 0
    pinned: int = 0
    used_blocks: int = 0
    payload_bytes: int = 0


class PrefixIndex:
    """Entry table, LRU order, pins and block accounting of one cache. Not thread-safe.

    Args:
        num_blocks: Blocks in the arena.
        block_bytes: Bytes per block.
        max_entries: Most entries alive at once (RESERVED + READY + RETIRED).
        page_size: Tokens per page of every key.
        hasher: The page hasher used for every chain.
        segment_align: Byte alignment of each segment in what an entry stores.
    """

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        max_entries: int,
        page_size: int,
        hasher: PageHasher,
        *,
        segment_align: int,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries!r}")
        self.block_bytes = block_bytes
        self.segment_align = segment_align
        self.max_entries = max_entries
        self.page_size = page_size
        self.hasher = hasher
        self.epoch = 0
        self.counters = Counters()
        self._alloc = BlockAllocator(num_blocks)
        self._entries: dict[int, IndexEntry] = {}
        self._lru: OrderedDict[int, IndexEntry] = OrderedDict()  # READY, least recent first
        self._ends: dict[int, list[IndexEntry]] = {}  # end hash -> RESERVED and READY entries
        self._ready_pages: dict[int, int] = {}  # num_pages -> count of READY entries
        self._next_id = 0

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._alloc.num_blocks

    @property
    def free_blocks(self) -> int:
        return self._alloc.free_blocks

    def get(self, entry_id: int) -> IndexEntry | None:
        return self._entries.get(entry_id)

    def lru_ids(self) -> list[int]:
        """READY entry ids, least recently used first."""
        return list(self._lru)

    def census(self) -> _Census:
        c = _Census()
        for e in self._entries.values():
            if e.state is EntryState.RESERVED:
                c.reserved += 1
            elif e.state is EntryState.READY:
                c.ready += 1
            else:
                c.retired += 1
            c.pinned += e.pins > 0
            c.used_blocks += len(e.blocks)
            c.payload_bytes += e.stored.payload_bytes
        return c

    # ---- publish ---------------------------------------------------------------------------

    def reserve(self, key: PrefixKey, layout: CheckpointLayout) -> IndexEntry | None:
        """Hold blocks and an entry slot for a checkpoint of ``key`` (all its complete pages).

        The checkpoint extends the longest READY one that is a prefix of it, where they share
        ``token_rows`` segments, and holds blocks only for what that one lacks. Evicts
        least-recently-used unpinned READY entries (never one a live checkpoint extends) only
        when that makes room; when it cannot, evicts nothing and returns ``None`` (a refusal).
        A checkpoint whose key material is already READY or RESERVED returns ``None`` too (a
        duplicate; a READY one is touched).

        Raises:
            CheckpointTooLarge: The checkpoint needs more blocks than the arena has.
        """
        num_pages = key.num_pages
        hashes = key.page_hashes(self.hasher, num_pages)
        end_hash = hashes[num_pages - 1]
        base, shared = self._base_for(key, layout, hashes)
        stored = (
            CheckpointLayout.plan(
                tuple(spec.tail(shared.get(spec.name, 0)) for spec in layout.segments),
                self.segment_align,
            )
            if shared
            else layout
        )
        needed = -(-stored.total_bytes // self.block_bytes)
        if needed > self._alloc.num_blocks:
            self.counters.too_large += 1
            raise CheckpointTooLarge(
                stored.total_bytes, self._alloc.num_blocks * self.block_bytes, self.block_bytes
            )
        for other in self._ends.get(end_hash, ()):
            if (
                other.epoch == self.epoch
                and other.num_pages == num_pages
                and other.is_prefix_of(key)
            ):
                self.counters.duplicates += 1
                if other.state is EntryState.READY:
                    self._lru.move_to_end(other.entry_id)
                return None
        if base is not None:  # held from here: the eviction below must not take it
            base.dependents += 1
        victims = self._plan_eviction(needed)
        if victims is None:
            if base is not None:
                base.dependents -= 1
            self.counters.refusals += 1
            return None
        for victim in victims:
            self.counters.evictions += 1
            self.counters.evicted_bytes += victim.stored.payload_bytes
            logger.debug(
                "evict entry %d (%d tokens, %d bytes)",
                victim.entry_id,
                victim.num_tokens,
                victim.stored.payload_bytes,
            )
            self._drop_ready(victim)
            self._free(victim)
        blocks = self._alloc.allocate(needed)
        if blocks is None:  # pragma: no cover - _plan_eviction guarantees room
            raise RuntimeError("block allocator disagrees with the eviction plan")
        entry = IndexEntry(
            entry_id=self._next_id,
            namespace=key.namespace_material,
            tokens=key.token_bytes[: num_pages * self.page_size * TOKEN_BYTES],
            extras={p: e for p, e in key._extras.items() if p < num_pages},
            num_pages=num_pages,
            page_size=self.page_size,
            end_hash=end_hash,
            layout=layout,
            blocks=blocks,
            epoch=self.epoch,
            stored=stored,
            base=base,
            shared=shared,
        )
        self._next_id += 1
        self._entries[entry.entry_id] = entry
        self._ends.setdefault(end_hash, []).append(entry)
        return entry

    def _base_for(
        self, key: PrefixKey, layout: CheckpointLayout, hashes: Sequence[PageHash]
    ) -> tuple[IndexEntry | None, dict[str, int]]:
        """The checkpoint ``key``'s extends and the rows of each segment it holds, if any."""
        base = self._longest(key, key.num_pages - 1, hashes)
        if base is None:
            return None, {}
        shared = {}
        for spec in layout.segments:
            if spec.token_rows and _has(base.layout, spec.name):
                other = base.layout.segments[base.layout.index(spec.name)]
                rows = spec.shared_rows(key.num_pages * self.page_size, other, base.num_tokens)
                if rows:
                    shared[spec.name] = rows
        return (base, shared) if shared else (None, {})

    def _plan_eviction(self, needed: int) -> list[IndexEntry] | None:
        """The least recently used unpinned READY entries whose eviction makes room, or None.

        An entry that a live checkpoint extends is a candidate only once every one extending it
        is a victim, so victims come in an order they can be freed in.
        """
        free = self._alloc.free_blocks
        live = len(self._entries)
        if free >= needed and live < self.max_entries:
            return []
        victims: list[IndexEntry] = []
        taken: set[int] = set()
        dependents = {e.entry_id: e.dependents for e in self._lru.values() if e.dependents}
        while True:
            entry = next(
                (
                    e
                    for e in self._lru.values()
                    if not e.pins and e.entry_id not in taken and not dependents.get(e.entry_id)
                ),
                None,
            )
            if entry is None:
                return None
            victims.append(entry)
            taken.add(entry.entry_id)
            if entry.base is not None and entry.base.entry_id in dependents:
                dependents[entry.base.entry_id] -= 1
            free += len(entry.blocks)
            live -= 1
            if free >= needed and live < self.max_entries:
                return victims

    def commit(self, entry: IndexEntry) -> bool:
        """Make a RESERVED entry matchable. Returns False (and frees it) if invalidated since.

        Raises:
            TicketStateError: The entry is not RESERVED.
        """
        _require_reserved(entry, "commits")
        if entry.epoch != self.epoch:
            self.counters.stale_publishes += 1
            self._unlink_end(entry)
            self._free(entry)
            return False
        entry.state = EntryState.READY
        self._lru[entry.entry_id] = entry
        self._ready_pages[entry.num_pages] = self._ready_pages.get(entry.num_pages, 0) + 1
        self.counters.publishes += 1
        self.counters.bytes_in += entry.stored.payload_bytes
        self.counters.shared_bytes += entry.shared_bytes
        return True

    def abort(self, entry: IndexEntry) -> None:
        """Free a RESERVED entry's blocks and slot.

        Raises:
            TicketStateError: The entry is not RESERVED.
        """
        _require_reserved(entry, "aborts")
        self.counters.aborts += 1
        self._unlink_end(entry)
        self._free(entry)

    # ---- match -----------------------------------------------------------------------------

    def longest_match(self, query: PrefixKey, max_pages: int | None = None) -> IndexEntry | None:
        """The READY entry with the most pages whose key material is a prefix of ``query``.

        One pass hashes the query's pages (stopping at the longest READY entry); candidates are
        the entries whose end hash equals the query's chain at their own page count (found by
        testing each entry or by a set intersection, whichever is smaller); the longest candidate
        whose full key material matches wins. Counts a lookup, and a hit touches the LRU order
        (the checkpoints it extends first: a restore reads them too).
        """
        c = self.counters
        c.lookups += 1
        c.lookup_tokens += query.num_tokens
        pages = query.num_pages if max_pages is None else min(query.num_pages, max_pages)
        best = self._longest(query, pages)
        if best is not None:
            c.hits += 1
            c.hit_tokens += best.num_tokens
            for entry in reversed(list(best.chain())):
                self._lru.move_to_end(entry.entry_id)
        return best

    def _longest(
        self, query: PrefixKey, pages: int, hashes: Sequence[PageHash] | None = None
    ) -> IndexEntry | None:
        """The READY entry of at most ``pages`` pages that matches ``query`` longest; no counts.

        ``hashes``: the query's page hashes, at least ``pages`` of them, if already computed.
        """
        pages = min(pages, max(self._ready_pages)) if self._ready_pages else 0
        best: IndexEntry | None = None
        if pages > 0 and query.page_size == self.page_size:
            if hashes is None:
                hashes = query.page_hashes(self.hasher, pages)
            ends = self._ends
            # Test each entry's end against the query's chain when there are few end hashes;
            # otherwise intersect the query's chain with the end hashes.
            buckets: Iterable[tuple[int, list[IndexEntry]]] = (
                ends.items()
                if len(ends) < pages
                else ((h, ends[h]) for h in ends.keys() & set(hashes[:pages]))
            )
            candidates = [
                e
                for h, bucket in buckets
                for e in bucket
                if e.num_pages <= pages
                and hashes[e.num_pages - 1] == h
                and e.state is EntryState.READY
            ]
            candidates.sort(key=lambda e: e.num_pages, reverse=True)
            for entry in candidates:
                if entry.is_prefix_of(query):
                    best = entry
                    break
        return best

    # ---- pins ------------------------------------------------------------------------------

    def pin(self, entry_id: int) -> IndexEntry | None:
        """Pin a READY entry against eviction; ``None`` if it is no longer READY."""
        entry = self._entries.get(entry_id)
        if entry is None or entry.state is not EntryState.READY:
            return None
        entry.pins += 1
        return entry

    def unpin(self, entry: IndexEntry) -> None:
        """Drop one pin; a RETIRED entry is freed with its last pin (and no dependents).

        Raises:
            LeaseError: The entry has no pins.
        """
        if entry.pins <= 0:
            raise LeaseError(f"entry {entry.entry_id!r} has no pins to release")
        entry.pins -= 1
        self._free_if_retired(entry)

    # ---- invalidation ----------------------------------------------------------------------

    def invalidate_all(self) -> int:
        """Make every current entry unmatchable; returns how many READY entries it dropped.

        Unpinned READY entries are freed now; pinned ones, and ones a live checkpoint extends,
        retire until their last unpin and last dependent; RESERVED entries are freed when they
        try to commit.
        """
        self.epoch += 1
        self.counters.invalidations += 1
        dropped = 0
        for entry in list(self._lru.values()):
            dropped += 1
            self._drop_ready(entry)
            entry.state = EntryState.RETIRED
            self._free_if_retired(entry)
        self.counters.invalidated_entries += dropped
        return dropped

    # ---- internals -------------------------------------------------------------------------

    def _drop_ready(self, entry: IndexEntry) -> None:
        del self._lru[entry.entry_id]
        count = self._ready_pages[entry.num_pages] - 1
        if count:
            self._ready_pages[entry.num_pages] = count
        else:
            del self._ready_pages[entry.num_pages]
        self._unlink_end(entry)

    def _unlink_end(self, entry: IndexEntry) -> None:
        bucket = self._ends[entry.end_hash]
        bucket.remove(entry)
        if not bucket:
            del self._ends[entry.end_hash]

    def _free(self, entry: IndexEntry) -> None:
        """Free ``entry``'s blocks; its base loses a dependent (and goes too if retired)."""
        self._alloc.free(entry.blocks)
        entry.state = EntryState.FREED
        del self._entries[entry.entry_id]
        base = entry.base
        if base is not None:
            entry.base = None
            base.dependents -= 1
            self._free_if_retired(base)

    def _free_if_retired(self, entry: IndexEntry) -> None:
        if entry.state is EntryState.RETIRED and not entry.pins and not entry.dependents:
            self._free(entry)


def _has(layout: CheckpointLayout, name: str) -> bool:
    return any(spec.name == name for spec in layout.segments)


def _require_reserved(entry: IndexEntry, action: str) -> None:
    if entry.state is not EntryState.RESERVED:
        raise TicketStateError(
            f"entry {entry.entry_id!r} is {entry.state.value!r}; only 'reserved' {action}"
        )
