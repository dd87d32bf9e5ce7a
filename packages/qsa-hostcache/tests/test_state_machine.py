"""Random publish/match/pin/restore/evict/invalidate sequences against a plain model of the cache.

The model is a list in LRU order plus a block count; after every step the cache must agree with
it on what matches, what was evicted, what the arena holds, and every restored byte.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from qsa_hostcache import (
    CacheNamespace,
    CheckpointTooLarge,
    HostPrefixCache,
    Lease,
    PageHasher,
    PrefixKey,
    PublishTicket,
    SegmentSpec,
    TicketState,
)

PAGE = 2
BLOCK = 64
BLOCKS = 12
MAX_ENTRIES = 4
ALIGN = 8
NAMESPACES = (
    CacheNamespace("m", "bf16", 1, 0, "cfg"),
    CacheNamespace("m", "bf16", 1, 0, "cfg", salt="tenant-b"),
)

tokens_st = st.lists(st.integers(0, 2), min_size=PAGE, max_size=8 * PAGE).map(
    lambda t: tuple(t[: len(t) - len(t) % PAGE])
)
extras_st = st.dictionaries(st.integers(0, 7), st.sampled_from([b"", b"img-a", b"img-b"]))
sizes_st = st.lists(st.integers(0, 330), min_size=1, max_size=3)


@dataclass
class ModelEntry:
    ns: int
    tokens: tuple[int, ...]
    extras: dict[int, bytes]
    payload: dict[str, bytes]
    blocks: int
    pins: int = 0
    retired: bool = False
    epoch: int = 0

    @property
    def pages(self) -> int:
        return len(self.tokens) // PAGE


@dataclass
class Pending:
    ticket: PublishTicket
    entry: ModelEntry
    data: dict[str, torch.Tensor]
    written: set[str] = field(default_factory=set)


def _blocks_for(sizes: list[int]) -> int:
    pos = 0
    for n in sizes:
        pos = -(-pos // ALIGN) * ALIGN + n
    return -(-pos // BLOCK)


def _restrict(extras: dict[int, bytes], pages: int) -> dict[int, bytes]:
    return {p: e for p, e in extras.items() if p < pages}


class CacheMachine(RuleBasedStateMachine):
    hasher: PageHasher | None = None

    def __init__(self) -> None:
        super().__init__()
        kwargs: dict[str, Any] = {} if self.hasher is None else {"hasher": self.hasher}
        self.cache = HostPrefixCache(
            BLOCKS * BLOCK,
            max_entries=MAX_ENTRIES,
            page_size=PAGE,
            block_bytes=BLOCK,
            segment_align=ALIGN,
            pin_memory=False,
            **kwargs,
        )
        self.entries: dict[int, ModelEntry] = {}  # live: ready, retired, pending
        self.lru: list[int] = []  # ready ids, least recent first
        self.leases: list[Lease] = []
        self.pending: Pending | None = None
        self.seqs: list[tuple[int, ...]] = []
        self.epoch = 0
        self.evictions = 0
        self.refusals = 0
        self.hits = 0
        self.lookups = 0

    # ---- helpers -----------------------------------------------------------------------------

    def _key(self, ns: int, tokens: tuple[int, ...], extras: dict[int, bytes]) -> PrefixKey:
        limit = -(-len(tokens) // PAGE)
        return PrefixKey(
            NAMESPACES[ns],
            list(tokens),
            page_size=PAGE,
            page_extras={p: e for p, e in extras.items() if p < limit},
        )

    def _expected_match(
        self, ns: int, tokens: tuple[int, ...], extras: dict[int, bytes], max_pages: int
    ) -> int | None:
        best: tuple[int, int] | None = None
        for eid in self.lru:
            e = self.entries[eid]
            n = e.pages
            if e.ns != ns or n > max_pages or tokens[: n * PAGE] != e.tokens:
                continue
            if _restrict(extras, n) != e.extras:
                continue
            if best is None or n > best[0]:
                best = (n, eid)
        return None if best is None else best[1]

    def _plan(self, needed: int) -> list[int] | None:
        used = sum(e.blocks for e in self.entries.values())
        free = BLOCKS - used
        live = len(self.entries)
        if free >= needed and live < MAX_ENTRIES:
            return []
        victims = []
        for eid in self.lru:
            e = self.entries[eid]
            if e.pins:
                continue
            victims.append(eid)
            free += e.blocks
            live -= 1
            if free >= needed and live < MAX_ENTRIES:
                return victims
        return None

    def _reserve(
        self, ns: int, tokens: tuple[int, ...], extras: dict[int, bytes], sizes: list[int]
    ) -> tuple[PublishTicket | None, ModelEntry | None]:
        """Reserve through the cache and apply the expected effect to the model."""
        pages = len(tokens) // PAGE
        extras = _restrict(extras, pages)
        specs = [SegmentSpec(f"s{i}", n) for i, n in enumerate(sizes)]
        needed = _blocks_for(sizes)
        key = self._key(ns, tokens, extras)
        if needed > BLOCKS:
            with pytest.raises(CheckpointTooLarge):
                self.cache.reserve(key, specs)
            return None, None
        duplicate = next(
            (
                eid
                for eid, e in self.entries.items()
                if not e.retired
                and e.epoch == self.epoch
                and (e.ns, e.tokens, e.extras) == (ns, tokens, extras)
            ),
            None,
        )
        ticket = self.cache.reserve(key, specs)
        if duplicate is not None:
            assert ticket is None
            if duplicate in self.lru:
                self.lru.remove(duplicate)
                self.lru.append(duplicate)
            return None, None
        victims = self._plan(needed)
        if victims is None:
            assert ticket is None
            self.refusals += 1
            return None, None
        assert ticket is not None
        for eid in victims:
            self.lru.remove(eid)
            del self.entries[eid]
            self.evictions += 1
        entry = ModelEntry(ns, tokens, extras, {}, needed, epoch=self.epoch)
        self.entries[ticket.entry_id] = entry
        self.seqs.append(tokens)
        return ticket, entry

    @staticmethod
    def _data(sizes: list[int], seed: int) -> dict[str, torch.Tensor]:
        rng = random.Random(seed)
        return {
            f"s{i}": torch.tensor(list(rng.randbytes(n)), dtype=torch.uint8)
            for i, n in enumerate(sizes)
        }

    def _commit(self, ticket: PublishTicket, entry: ModelEntry) -> None:
        state = ticket.commit()
        if entry.epoch != self.epoch:
            assert state is TicketState.STALE
            del self.entries[ticket.entry_id]
        else:
            assert state is TicketState.PUBLISHED
            self.lru.append(ticket.entry_id)

    # ---- rules -------------------------------------------------------------------------------

    @rule(
        ns=st.integers(0, 1),
        tokens=tokens_st,
        extras=st.just({}) | extras_st,
        sizes=sizes_st,
        seed=st.integers(0, 2**16),
    )
    def publish(
        self,
        ns: int,
        tokens: tuple[int, ...],
        extras: dict[int, bytes],
        sizes: list[int],
        seed: int,
    ) -> None:
        ticket, entry = self._reserve(ns, tokens, extras, sizes)
        if ticket is None or entry is None:
            return
        data = self._data(sizes, seed)
        ticket.write(data)
        entry.payload = {n: bytes(t.tolist()) for n, t in data.items()}
        self._commit(ticket, entry)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), ns=st.integers(0, 1), extras=st.just({}) | extras_st)
    def publish_extension(self, data: st.DataObject, ns: int, extras: dict[int, bytes]) -> None:
        """Publish a longer or shorter prefix of a sequence seen before (so prefixes nest)."""
        base = data.draw(st.sampled_from(self.seqs))
        tail = data.draw(tokens_st)
        cut = data.draw(st.integers(1, (len(base) + len(tail)) // PAGE)) * PAGE
        tokens = (base + tail)[:cut]
        self.publish(ns, tokens, extras, data.draw(sizes_st), data.draw(st.integers(0, 99)))

    @precondition(lambda self: self.pending is None)
    @rule(
        ns=st.integers(0, 1),
        tokens=tokens_st,
        sizes=st.lists(st.integers(1, 120), min_size=2, max_size=3),
        seed=st.integers(0, 2**16),
    )
    def begin_publish(self, ns: int, tokens: tuple[int, ...], sizes: list[int], seed: int) -> None:
        """Reserve and write only the first segment: the checkpoint is half-written."""
        ticket, entry = self._reserve(ns, tokens, {}, sizes)
        if ticket is None or entry is None:
            return
        data = self._data(sizes, seed)
        ticket.write({"s0": data["s0"]})
        self.pending = Pending(ticket, entry, data, {"s0"})

    @precondition(lambda self: self.pending is not None)
    @rule()
    def half_written_never_matches(self) -> None:
        assert self.pending is not None
        e = self.pending.entry
        m = self.cache.match(self._key(e.ns, e.tokens, {}))
        assert m is None or m.entry_id != self.pending.ticket.entry_id
        self.lookups += 1
        self.hits += m is not None
        if m is not None:
            self.lru.remove(m.entry_id)
            self.lru.append(m.entry_id)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def finish_publish(self) -> None:
        assert self.pending is not None
        p, self.pending = self.pending, None
        rest = {n: t for n, t in p.data.items() if n not in p.written}
        p.ticket.write(rest)
        p.entry.payload = {n: bytes(t.tolist()) for n, t in p.data.items()}
        self._commit(p.ticket, p.entry)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def abort_publish(self) -> None:
        assert self.pending is not None
        p, self.pending = self.pending, None
        p.ticket.abort()
        assert p.ticket.state is TicketState.ABORTED
        del self.entries[p.ticket.entry_id]

    @rule(
        data=st.data(),
        max_tokens=st.none() | st.none() | st.integers(0, 20),
        pin=st.booleans(),
    )
    def match(
        self,
        data: st.DataObject,
        max_tokens: int | None,
        pin: bool,
    ) -> None:
        if self.lru and data.draw(st.integers(0, 3)) > 0:
            # Start from a cached checkpoint's key, extend it, and sometimes perturb it.
            e = self.entries[data.draw(st.sampled_from(self.lru))]
            ns, extras = e.ns, dict(e.extras)
            tokens = e.tokens + data.draw(tokens_st)
            change = data.draw(st.sampled_from(["none", "none", "token", "ns", "extra"]))
            if change == "token":  # a single changed token, often in the entry's last page
                at = data.draw(st.integers(max(0, len(e.tokens) - PAGE), len(tokens) - 1))
                tokens = (*tokens[:at], (tokens[at] + 1) % 3, *tokens[at + 1 :])
            elif change == "ns":  # same tokens, other namespace
                ns = 1 - ns
            elif change == "extra":  # same tokens, other image identity on one page
                page = data.draw(st.integers(0, len(tokens) // PAGE - 1))
                extras[page] = extras.get(page, b"") + b"'"
        else:
            ns = data.draw(st.integers(0, 1))
            extras = data.draw(st.just({}) | extras_st)
            tokens = data.draw(tokens_st)
        tail = data.draw(st.integers(0, PAGE - 1))
        tokens = tokens + (0,) * tail  # a partial last page never takes part
        key = self._key(ns, tokens, extras)
        max_pages = len(tokens) // PAGE if max_tokens is None else max_tokens // PAGE
        want = self._expected_match(ns, tokens, extras, max_pages)
        self.lookups += 1
        if pin:
            lease = self.cache.acquire(key, max_tokens=max_tokens)
            got = None if lease is None else lease.match.entry_id
            if lease is not None:
                self.leases.append(lease)
                self.entries[lease.match.entry_id].pins += 1
        else:
            m = self.cache.match(key, max_tokens=max_tokens)
            got = None if m is None else m.entry_id
        assert got == want
        if want is not None:
            self.hits += 1
            self.lru.remove(want)
            self.lru.append(want)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self.leases))
        entry = self.entries[lease.match.entry_id]
        into = {
            s.name: torch.full((s.nbytes,), 0xA5, dtype=torch.uint8) for s in lease.match.segments
        }
        fence = self.cache.restore(lease, into)
        assert fence.done()
        got = {n: bytes(t.tolist()) for n, t in into.items()}
        assert got == entry.payload

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self.leases))
        self.leases.remove(lease)
        lease.release()
        eid = lease.match.entry_id
        entry = self.entries[eid]
        entry.pins -= 1
        if entry.retired and entry.pins == 0:
            del self.entries[eid]

    @rule(roll=st.integers(0, 5))
    def invalidate_all(self, roll: int) -> None:
        if roll:  # keep invalidation rarer than the other steps
            return
        dropped = self.cache.invalidate_all()
        assert dropped == len(self.lru)
        self.epoch += 1
        for eid in self.lru:
            e = self.entries[eid]
            if e.pins:
                e.retired = True
            else:
                del self.entries[eid]
        self.lru = []

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        s = self.cache.stats()
        used_blocks = sum(e.blocks for e in self.entries.values())
        assert s.used_bytes == used_blocks * BLOCK
        assert s.used_bytes <= s.capacity_bytes == BLOCKS * BLOCK
        assert s.entries == len(self.entries) <= MAX_ENTRIES
        assert s.ready_entries == len(self.lru)
        assert s.retired_entries == sum(e.retired for e in self.entries.values())
        assert s.pinned_entries == sum(e.pins > 0 for e in self.entries.values())
        assert self.cache.lru_order() == self.lru
        assert (s.evictions, s.refusals) == (self.evictions, self.refusals)
        assert (s.lookups, s.hits) == (self.lookups, self.hits)
        assert not s.pinned_memory

    def teardown(self) -> None:
        for lease in self.leases:
            lease.release()
        if self.pending is not None:
            self.pending.ticket.abort()
        s = self.cache.stats()
        assert s.pinned_entries == 0
        assert s.retired_entries == 0
        assert s.reserved_entries == 0


def _constant_hash(data: bytes | memoryview, seed: int, /) -> int:
    """Every page of every key hashes alike: only the full key material can tell them apart."""
    return 7


def _length_hash(data: bytes | memoryview, seed: int, /) -> int:
    """Depends on the seed chain and the page length, not on the token values."""
    return (seed * 31 + len(data)) % 5


class ConstantHashMachine(CacheMachine):
    hasher = staticmethod(_constant_hash)


class LengthHashMachine(CacheMachine):
    hasher = staticmethod(_length_hash)


_SETTINGS = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestCacheAgainstModel = CacheMachine.TestCase
TestCacheAgainstModel.settings = _SETTINGS
TestCacheAgainstModelUnderConstantHash = ConstantHashMachine.TestCase
TestCacheAgainstModelUnderConstantHash.settings = _SETTINGS
TestCacheAgainstModelUnderWeakHash = LengthHashMachine.TestCase
TestCacheAgainstModelUnderWeakHash.settings = _SETTINGS
