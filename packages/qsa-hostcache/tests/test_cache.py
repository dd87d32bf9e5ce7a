"""Scenarios of the cache's life on CPU tensors: publish, match, pin, restore, evict, invalidate."""

from __future__ import annotations

import threading

import pytest
import torch

from qsa_hostcache import (
    ArenaAllocationError,
    CacheConfigError,
    CacheNamespace,
    CheckpointTooLarge,
    DeviceError,
    HostPrefixCache,
    InvalidKeyError,
    LeaseError,
    PrefixKey,
    SegmentError,
    SegmentSpec,
    TicketState,
    TicketStateError,
)

NS = CacheNamespace("m@1", "float8_e4m3fn", 2, 0, "cfg")
PAGE = 4
BLOCK = 1024


def make_cache(blocks: int = 8, max_entries: int = 16, **kw: object) -> HostPrefixCache:
    return HostPrefixCache(
        blocks * BLOCK,
        max_entries=max_entries,
        page_size=PAGE,
        block_bytes=BLOCK,
        pin_memory=False,
        **kw,  # type: ignore[arg-type]
    )


def key(pages: int, *, ns: CacheNamespace = NS, first: int = 0, **kw: object) -> PrefixKey:
    return PrefixKey(ns, list(range(first, first + pages * PAGE)), page_size=PAGE, **kw)  # type: ignore[arg-type]


def payload(nbytes: int, fill: int) -> dict[str, torch.Tensor]:
    return {"kv": torch.full((nbytes,), fill, dtype=torch.uint8)}


def test_lru_eviction_skips_pinned_entries() -> None:
    """Full arena: the least recently used unpinned checkpoint goes; a pinned one stays."""
    cache = make_cache(blocks=3)
    a = cache.publish(key(1, first=100), payload(BLOCK, 1))
    b = cache.publish(key(1, first=200), payload(BLOCK, 2))
    c = cache.publish(key(1, first=300), payload(BLOCK, 3))
    assert a
    assert b
    assert c
    lease = cache.acquire(key(1, first=100))  # touch and pin a -> LRU order b, c, a
    assert lease is not None
    assert cache.lru_order() == [b.entry_id, c.entry_id, a.entry_id]
    d = cache.publish(key(1, first=400), payload(BLOCK, 4))  # evicts b
    assert d is not None
    assert cache.match(key(1, first=200)) is None
    e = cache.publish(key(1, first=500), payload(BLOCK, 5))  # a is pinned: evicts c, not a
    assert e is not None
    assert cache.lru_order() == [a.entry_id, d.entry_id, e.entry_id]
    assert cache.stats().evictions == 2
    lease.release()


def test_no_room_is_a_miss_that_evicts_nothing() -> None:
    """Every entry pinned: a publish that needs room returns None and keeps every entry."""
    cache = make_cache(blocks=2)
    cache.publish(key(1, first=1), payload(BLOCK, 1))
    cache.publish(key(1, first=2), payload(BLOCK, 2))
    leases = [cache.acquire(key(1, first=f)) for f in (1, 2)]
    assert cache.publish(key(1, first=3), payload(BLOCK, 3)) is None
    s = cache.stats()
    assert (s.refusals, s.evictions, s.ready_entries) == (1, 0, 2)
    for lease in leases:
        assert lease is not None
        lease.release()


def test_checkpoint_larger_than_the_arena_names_both_sizes() -> None:
    """CheckpointTooLarge is a ValueError whose message states the checkpoint and arena bytes."""
    cache = make_cache(blocks=2)
    with pytest.raises(CheckpointTooLarge, match=r"2049.*2048") as info:
        cache.reserve(key(1), [SegmentSpec("kv", 2049)])
    assert isinstance(info.value, ValueError)
    assert cache.stats().too_large == 1


def test_max_entries_evicts_even_with_free_bytes() -> None:
    """With room for bytes but not for another entry, the LRU entry goes."""
    cache = make_cache(blocks=8, max_entries=2)
    first = cache.publish(key(1, first=1), payload(8, 1))
    cache.publish(key(1, first=2), payload(8, 2))
    cache.publish(key(1, first=3), payload(8, 3))
    assert first is not None
    assert cache.match(key(1, first=1)) is None
    assert cache.stats().entries == 2


def test_longest_published_prefix_wins_and_respects_max_tokens() -> None:
    """Checkpoints at 1, 2 and 4 pages: a 5-page query gets 4; max_tokens=11 gets 2 (8 tokens)."""
    cache = make_cache()
    full = key(5)
    for pages in (1, 2, 4):
        cache.publish(full.prefix(pages), payload(16, pages))
    m = cache.match(full)
    assert m is not None
    assert m.num_tokens == 16
    m = cache.match(full, max_tokens=11)
    assert m is not None
    assert (m.num_pages, m.num_tokens) == (2, 8)
    assert cache.match(full, max_tokens=3) is None


def test_same_tokens_in_another_namespace_miss() -> None:
    """A checkpoint under one salt never serves the same tokens under another."""
    cache = make_cache()
    cache.publish(key(2), payload(16, 1))
    other = CacheNamespace("m@1", "float8_e4m3fn", 2, 0, "cfg", salt="tenant-b")
    assert cache.match(key(2, ns=other)) is None
    assert cache.match(key(2)) is not None


def test_single_changed_token_in_last_page_falls_back_to_shorter_checkpoint() -> None:
    """With checkpoints at 2 and 3 pages, changing the last token of page 3 matches 2 pages."""
    cache = make_cache()
    full = key(3)
    cache.publish(full.prefix(2), payload(16, 2))
    cache.publish(full, payload(16, 3))
    tokens = list(range(3 * PAGE))
    tokens[-1] += 1
    m = cache.match(PrefixKey(NS, tokens, page_size=PAGE))
    assert m is not None
    assert m.num_pages == 2


def test_different_image_identity_on_a_page_misses_that_page() -> None:
    """Same placeholder tokens, different image key on page 1: only page 0's checkpoint matches."""
    cache = make_cache()
    img_a = key(2, page_extras={1: b"sha256:aaaa"})
    cache.publish(img_a.prefix(1), payload(16, 1))
    cache.publish(img_a, payload(16, 2))
    m = cache.match(key(2, page_extras={1: b"sha256:bbbb"}))
    assert m is not None
    assert m.num_pages == 1
    m = cache.match(key(2, page_extras={1: b"sha256:aaaa"}))
    assert m is not None
    assert m.num_pages == 2
    m = cache.match(key(2))
    assert m is not None
    assert m.num_pages == 1


def test_forced_hash_collisions_never_produce_a_false_hit() -> None:
    """Under a hash that maps everything to 0, only the entry with equal key material matches."""
    cache = make_cache(hasher=lambda data, seed: 0)
    for first in (0, 1000, 2000):
        cache.publish(key(2, first=first), payload(16, first % 251))
    cache.publish(key(2, first=5000, ns=CacheNamespace("x", "y", 1, 0, "z")), payload(16, 9))
    m = cache.match(key(3, first=1000))
    assert m is not None
    assert m.num_pages == 2
    with cache.pin(m) as lease:  # type: ignore[union-attr]
        out = torch.zeros(16, dtype=torch.uint8)
        cache.restore(lease, {"kv": out})
    assert out.eq(1000 % 251).all()
    assert cache.match(key(2, first=3000)) is None
    assert cache.match(key(2, first=5000)) is None


def test_restore_returns_exactly_the_published_bytes_for_mixed_dtypes() -> None:
    """Segments of bf16, fp8, int64 and a 0-d float32 come back bit-identical."""
    cache = make_cache(blocks=16)
    g = torch.Generator().manual_seed(0)
    segs = {
        "raw_kv": torch.randn(3, 5, 7, generator=g).to(torch.float8_e4m3fn),
        "index": torch.randn(11, 13, generator=g).to(torch.bfloat16),
        "rope": torch.randint(-(2**40), 2**40, (4,), generator=g),
        "gdn": torch.tensor(3.25),
    }
    ticket = cache.publish(key(3), segs)
    assert ticket is not None
    assert ticket.state is TicketState.PUBLISHED
    lease = cache.acquire(key(4))
    assert lease is not None
    out = {n: torch.empty_like(t) for n, t in segs.items()}
    assert cache.restore(lease, out).done()
    lease.release()
    for name, tensor in segs.items():
        assert out[name].reshape(-1).view(torch.uint8).equal(tensor.reshape(-1).view(torch.uint8))
    s = cache.stats()
    total = sum(t.numel() * t.element_size() for t in segs.values())
    assert (s.bytes_in, s.bytes_out, s.payload_bytes) == (total, total, total)


def test_restore_checks_targets() -> None:
    """Wrong size, dtype, shape, unknown name, non-contiguous target or released lease raise."""
    cache = make_cache()
    cache.publish(key(1), {"a": torch.zeros(4, 6)})
    lease = cache.acquire(key(1))
    assert lease is not None
    with pytest.raises(SegmentError, match="96 bytes"):
        cache.restore(lease, {"a": torch.zeros(5, 6)})
    with pytest.raises(SegmentError, match="dtype"):
        cache.restore(lease, {"a": torch.zeros(4, 6, dtype=torch.int32)})
    with pytest.raises(SegmentError, match="shape"):
        cache.restore(lease, {"a": torch.zeros(6, 4)})
    with pytest.raises(SegmentError, match=r"'b'.*\['a'\]"):
        cache.restore(lease, {"b": torch.zeros(4, 6)})
    with pytest.raises(SegmentError, match="contiguous"):
        cache.restore(lease, {"a": torch.zeros(6, 4).t()})
    lease.release()
    with pytest.raises(LeaseError):
        cache.restore(lease, {"a": torch.zeros(4, 6)})
    with pytest.raises(LeaseError):
        lease.release()


def test_half_written_checkpoint_never_matches_and_abort_frees_space() -> None:
    """Reserved and partly written: no match, its bytes held; abort gives them back."""
    cache = make_cache(blocks=4)
    ticket = cache.reserve(key(2), [SegmentSpec("a", 2000), SegmentSpec("b", 10)])
    assert ticket is not None
    ticket.write({"a": torch.ones(2000, dtype=torch.uint8)})
    assert cache.match(key(2)) is None
    with pytest.raises(TicketStateError, match=r"\['b'\]"):
        ticket.commit()
    assert cache.stats().used_bytes == 3 * BLOCK
    ticket.abort()
    s = cache.stats()
    assert (s.used_bytes, s.entries, s.aborts) == (0, 0, 1)
    assert cache.match(key(2)) is None


def test_ticket_misuse_raises() -> None:
    """Writing a segment twice, an unknown segment, committing twice or aborting a published one."""
    cache = make_cache()
    ticket = cache.reserve(key(1), [SegmentSpec("a", 4)])
    assert ticket is not None
    with pytest.raises(SegmentError):
        ticket.write({"zz": torch.zeros(4, dtype=torch.uint8)})
    ticket.write({"a": torch.zeros(4, dtype=torch.uint8)})
    with pytest.raises(SegmentError, match="already written"):
        ticket.write({"a": torch.zeros(4, dtype=torch.uint8)})
    assert ticket.commit() is TicketState.PUBLISHED
    with pytest.raises(TicketStateError):
        ticket.commit()
    with pytest.raises(TicketStateError):
        ticket.write({"b": torch.zeros(4, dtype=torch.uint8)})
    with pytest.raises(TicketStateError):
        ticket.abort()


def test_publish_key_must_be_whole_pages_of_the_cache_page_size() -> None:
    """A trailing partial page, zero pages, or another page size raise InvalidKeyError."""
    cache = make_cache()
    with pytest.raises(InvalidKeyError, match="prefix"):
        cache.reserve(PrefixKey(NS, list(range(6)), page_size=PAGE), [SegmentSpec("a", 1)])
    with pytest.raises(InvalidKeyError):
        cache.reserve(PrefixKey(NS, [], page_size=PAGE), [SegmentSpec("a", 1)])
    with pytest.raises(InvalidKeyError, match="page size 8"):
        cache.match(PrefixKey(NS, list(range(16)), page_size=8))


def test_duplicate_publish_is_skipped_and_touches_the_entry() -> None:
    """Publishing the same key material again returns None and moves it to most recent."""
    cache = make_cache()
    a = cache.publish(key(1, first=1), payload(8, 1))
    b = cache.publish(key(1, first=2), payload(8, 2))
    assert a
    assert b
    assert cache.publish(key(1, first=1), payload(8, 7)) is None
    assert cache.lru_order() == [b.entry_id, a.entry_id]
    assert cache.stats().duplicates == 1


def test_invalidate_all_keeps_pinned_bytes_until_release() -> None:
    """After invalidation nothing matches, a leased checkpoint still restores, then is freed."""
    cache = make_cache()
    cache.publish(key(1), payload(100, 42))
    cache.publish(key(1, first=9), payload(100, 43))
    lease = cache.acquire(key(1))
    assert lease is not None
    assert cache.invalidate_all() == 2
    assert cache.match(key(1)) is None
    assert cache.pin(lease.match) is None
    out = torch.zeros(100, dtype=torch.uint8)
    cache.restore(lease, {"kv": out})
    assert out.eq(42).all()
    assert cache.stats().retired_entries == 1
    lease.release()
    s = cache.stats()
    assert (s.entries, s.used_bytes) == (0, 0)


def test_publish_racing_an_invalidation_goes_stale() -> None:
    """A reservation made before invalidate_all is dropped at commit, never published."""
    cache = make_cache()
    ticket = cache.reserve(key(1), [SegmentSpec("a", 8)])
    assert ticket is not None
    ticket.write({"a": torch.ones(8, dtype=torch.uint8)})
    cache.invalidate_all()
    assert ticket.commit() is TicketState.STALE
    assert cache.match(key(1)) is None
    s = cache.stats()
    assert (s.entries, s.stale_publishes, s.publishes) == (0, 1, 0)
    # a fresh publish of the same key is not a duplicate of the stale one
    assert cache.publish(key(1), payload(8, 1)) is not None


def test_pin_after_eviction_returns_none() -> None:
    """A match taken before its entry was evicted cannot be pinned."""
    cache = make_cache(blocks=1)
    cache.publish(key(1, first=1), payload(BLOCK, 1))
    m = cache.match(key(1, first=1))
    assert m is not None
    cache.publish(key(1, first=2), payload(BLOCK, 2))
    assert cache.pin(m) is None


def test_stats_render_as_prometheus_text() -> None:
    """Counters end in _total, labels are escaped, every sample has HELP and TYPE lines."""
    cache = make_cache()
    cache.publish(key(1), payload(8, 1))
    cache.match(key(2))
    cache.match(key(1, first=50))
    text = cache.stats().to_prometheus(labels={"tp_rank": "0", "model": 'a"b'})
    assert 'qsa_hostcache_lookups_total{model="a\\"b",tp_rank="0"} 2\n' in text
    assert 'qsa_hostcache_hits_total{model="a\\"b",tp_rank="0"} 1\n' in text
    assert "# TYPE qsa_hostcache_capacity_bytes gauge" in text
    assert 'qsa_hostcache_pinned_memory{model="a\\"b",tp_rank="0"} 0' in text
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(text.splitlines()) == 3 * len(samples)
    s = cache.stats()
    assert (s.hits, s.misses, s.hit_tokens, s.hit_rate) == (1, 1, 4, 0.5)


def test_budget_below_one_block_is_rejected() -> None:
    """A budget smaller than one block raises ValueError naming both numbers."""
    with pytest.raises(ValueError, match=r"100.*1024"):
        HostPrefixCache(100, block_bytes=1024, pin_memory=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budget_bytes": 4.5e6}, r"budget_bytes=4500000.0 is not allowed; it must be an int >= 1"),
        ({"budget_bytes": True}, r"budget_bytes=True is not allowed"),
        ({"budget_bytes": 1 << 20, "block_bytes": 0}, r"block_bytes=0 is not allowed"),
        ({"budget_bytes": 1 << 20, "max_entries": 2.0}, r"max_entries=2.0 is not allowed"),
    ],
)
def test_sizes_that_are_not_positive_ints_are_refused_by_name(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(CacheConfigError, match=match):
        HostPrefixCache(pin_memory=False, **kwargs)  # type: ignore[arg-type]


def test_a_budget_the_host_cannot_allocate_raises_the_package_error_with_its_size() -> None:
    """4 EiB: torch's allocator refuses; the cache says how much it asked for, as a MemoryError."""
    with pytest.raises(
        ArenaAllocationError, match=r"4611686018427387904 bytes \(4294967296.0 GiB\)"
    ):
        HostPrefixCache(1 << 62, pin_memory=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_without_cuda_the_arena_is_pageable_and_pinning_is_refused() -> None:
    """No CUDA: the default arena is unpinned and says so; pin_memory=True raises DeviceError."""
    cache = HostPrefixCache(1 << 20)
    assert cache.pinned is False
    assert cache.stats().pinned_memory is False
    with pytest.raises(DeviceError, match="CUDA"):
        HostPrefixCache(1 << 20, pin_memory=True)


def test_copy_worker_and_scheduler_threads_agree() -> None:
    """A worker publishes while the main thread matches and restores: every hit is whole."""
    cache = make_cache(blocks=64, max_entries=8)
    nbytes = 3 * BLOCK + 17
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for i in range(300):
                pages = 1 + i % 5
                cache.publish(
                    key(pages, first=(i % 7) * 1000), payload(nbytes, (i % 7) * 10 + pages)
                )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            stop.set()

    thread = threading.Thread(target=worker)
    thread.start()
    hits = 0
    while not stop.is_set() or hits == 0:
        for f in range(7):
            lease = cache.acquire(key(6, first=f * 1000))
            if lease is None:
                continue
            with lease:
                out = torch.zeros(nbytes, dtype=torch.uint8)
                cache.restore(lease, {"kv": out})
            assert out.eq(f * 10 + lease.match.num_pages).all()
            hits += 1
        if stop.is_set() and hits == 0:
            break
    thread.join()
    assert errors == []
    assert hits > 0
    s = cache.stats()
    assert s.used_bytes <= s.capacity_bytes
    assert s.reserved_entries == 0


def test_drain_has_nothing_to_wait_for_when_every_source_was_on_the_host() -> None:
    """Host sources copy synchronously: commit publishes at once and drain lands nothing."""
    cache = make_cache()
    ticket = cache.publish(key(2), {"kv": torch.ones(BLOCK, dtype=torch.uint8)})
    assert ticket is not None
    assert ticket.state is TicketState.PUBLISHED
    assert cache.drain() == 0
    assert (cache.stats().reserved_entries, cache.stats().ready_entries) == (0, 1)


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (torch.zeros(BLOCK, dtype=torch.uint8).to_sparse(), SegmentError, "must be dense"),
        (torch.zeros(BLOCK, dtype=torch.uint8, device="meta"), DeviceError, "tensor on"),
    ],
    ids=["sparse", "meta-device"],
)
def test_a_publish_it_cannot_copy_evicts_nothing_and_changes_no_statistic(
    bad: torch.Tensor, error: type[Exception], message: str
) -> None:
    """The arena is full: reserving would evict the one checkpoint, so the check comes first."""
    cache = make_cache(blocks=1)
    assert cache.publish(key(1, first=10), payload(BLOCK, 7)) is not None
    before = cache.stats()
    with pytest.raises(error, match=message):
        cache.publish(key(1, first=20), {"kv": bad})
    assert cache.stats() == before
    match = cache.match(key(1, first=10))
    assert match is not None
    lease = cache.pin(match)
    assert lease is not None
    out = torch.empty(BLOCK, dtype=torch.uint8)
    cache.restore(lease, {"kv": out}).synchronize()
    assert bool((out == 7).all())
    lease.release()


def test_pin_refuses_a_match_found_by_another_cache() -> None:
    ours, theirs = make_cache(), make_cache()
    assert ours.publish(key(1, first=1), payload(BLOCK, 1)) is not None
    assert theirs.publish(key(1, first=2), payload(BLOCK, 2)) is not None
    foreign = theirs.match(key(1, first=2))
    assert foreign is not None
    with pytest.raises(LeaseError, match=r"came from cache \d+; this is cache \d+"):
        ours.pin(foreign)
    assert ours.stats().pinned_entries == 0


@pytest.mark.parametrize("bad", [4.5, True, -1, "8"])
def test_match_refuses_a_token_limit_that_is_not_an_int(bad: object) -> None:
    cache = make_cache()
    assert cache.publish(key(2, first=1), payload(BLOCK, 1)) is not None
    with pytest.raises(
        InvalidKeyError, match=f"max_tokens must be an int >= 0 or None, got {bad!r}"
    ):
        cache.match(key(2, first=1), max_tokens=bad)  # type: ignore[arg-type]
    assert cache.match(key(2, first=1), max_tokens=8) is not None
