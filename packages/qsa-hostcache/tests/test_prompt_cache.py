"""One engine rank's prompt cache, called with the engine's requests (PromptCache).

The requests are small objects with an id, a salt and a bypass reason; the pools are plain CPU
tensors as in ``test_prompt_pools.py`` (index buffers by token slot, ``[T, Hkv, D]`` staged K/V).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Mapping

import pytest
import torch

from qsa_hostcache import (
    INDEX_SEGMENT,
    CacheNamespace,
    CacheStats,
    CopyFence,
    HostPrefixCache,
    MooncakeAddress,
    PromptCache,
    PromptCacheNumbers,
    PromptCounts,
    SharedCheckpoints,
    StoreUnavailableError,
    TokenSlots,
)

NS = CacheNamespace("m@1", "bfloat16", 1, 0, "cfg")
PAGE, RATIO, LAYERS, HKV, D = 4, 2, 2, 1, 8
SLOTS = 32


class Reason(enum.Enum):
    IMAGE = "image"


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    salt: str | None = None
    bypass: Reason | None = None


def _extras(request: Request) -> Mapping[int, bytes] | enum.Enum:
    return {} if request.bypass is None else request.bypass


def _cache(
    seen: list[PromptCacheNumbers] | None = None,
    bypassed: list[tuple[str, enum.Enum]] | None = None,
) -> PromptCache[Request]:
    arena = HostPrefixCache(
        32 * 1024, max_entries=8, page_size=PAGE, block_bytes=1024, pin_memory=False
    )
    index = [torch.arange(SLOTS // RATIO, dtype=torch.float32).view(-1, 1, 1) for _ in range(2)]
    return PromptCache(
        arena,
        index,
        RATIO,
        extras=_extras,
        namespace=lambda r: NS.for_request(cache_salt=r.salt),
        request_id=lambda r: r.rid,
        on_bypass=None if bypassed is None else lambda r, why: bypassed.append((r.rid, why)),
        on_numbers=None if seen is None else seen.append,
    )


def _kv(tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    k = [torch.full((tokens, HKV, D), 1.0 + i) for i in range(LAYERS)]
    v = [torch.full((tokens, HKV, D), -1.0 - i) for i in range(LAYERS)]
    return k, v


def _publish(cache: PromptCache[Request], request: Request, tokens: int) -> CopyFence | None:
    fence = cache.publish(
        request, list(range(tokens)), lambda: _kv(tokens), lambda: torch.arange(tokens)
    )
    if fence is not None:
        fence.synchronize()
    return fence


class Allocator:
    def __init__(self, free: list[int]) -> None:
        self.free_slots = free

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(taken, dtype=torch.int32)

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots = sorted(self.free_slots + slots.tolist())


def test_a_published_prompt_is_found_loaded_and_restored_for_the_next_request() -> None:
    """Publish at 8 tokens; a later request of the same prompt finds 8 tokens, takes 8 slots
    (held as its claim until the restore) and gets each layer's K/V back."""
    cache = _cache()
    assert _publish(cache, Request("a"), 8) is not None
    later = Request("b")
    assert cache.lookup(later, list(range(11))) == 8
    assert not cache.hit_is_shared  # no shared tier
    allocator = Allocator(list(range(16, 32)))
    slots = cache.load(later, list(range(8)), TokenSlots(allocator.alloc, allocator.free))
    assert slots is not None
    assert cache.claimed(later) is slots
    k, v = (
        [torch.zeros(8, HKV, D) for _ in range(LAYERS)],
        [torch.zeros(8, HKV, D) for _ in range(LAYERS)],
    )
    restored = cache.restore(
        later, lambda n: (k[:], v[:]), lambda layer, fence: fence.synchronize()
    )
    assert restored == 8
    assert [float(t[0, 0, 0]) for t in k] == [1.0, 2.0]
    assert cache.claimed(later) is None
    assert cache.numbers().prompts == PromptCounts(loads=1, loaded_tokens=8)


def test_a_request_that_cannot_be_keyed_misses_and_is_never_gathered() -> None:
    """Its lookup misses (the ranks still agree), its publish never reads the pools, and
    ``on_bypass`` hears of it once."""
    bypassed: list[tuple[str, enum.Enum]] = []
    cache = _cache(bypassed=bypassed)
    assert _publish(cache, Request("a"), 8) is not None
    image = Request("img", bypass=Reason.IMAGE)
    assert cache.lookup(image, list(range(11))) == 0

    def never() -> torch.Tensor:
        raise AssertionError("gathered a request that is not keyed")

    assert cache.publish(image, list(range(8)), lambda: _kv(8), never) is None
    assert bypassed == [("img", Reason.IMAGE)]


def test_a_requests_salt_keeps_its_checkpoints_from_other_requests() -> None:
    cache = _cache()
    assert _publish(cache, Request("a", salt="tenant-1"), 8) is not None
    assert cache.lookup(Request("b", salt="tenant-2"), list(range(11))) == 0
    assert cache.lookup(Request("c"), list(range(11))) == 0
    assert cache.lookup(Request("d", salt="tenant-1"), list(range(11))) == 8


def test_every_call_that_counts_reports_the_numbers() -> None:
    """``on_numbers`` gets a snapshot at construction and after each counting call; a flush
    drops every checkpoint and says how many were matchable."""
    seen: list[PromptCacheNumbers] = []
    cache = _cache(seen)
    assert seen == [PromptCacheNumbers(cache.cache.stats(), PromptCounts(), None)]
    _publish(cache, Request("a"), 8)
    cache.settle()
    assert seen[-1].cache.ready_entries == 1
    assert isinstance(seen[-1].cache, CacheStats)
    assert cache.invalidate() == 1
    assert seen[-1].cache.ready_entries == 0
    assert seen[-1] == cache.numbers()


def test_a_checkpoint_holds_the_index_rows_of_the_tokens_slots() -> None:
    cache = _cache()
    segments = cache.pools.gather(lambda: _kv(4), torch.tensor([4, 5, 6, 7]))
    assert segments[INDEX_SEGMENT][:, 0, 0, 0].tolist() == [2, 3]


def test_a_publish_reads_the_index_before_the_kv() -> None:
    """The index rows (a read that may be collective) come before the engine's K/V reader."""
    order: list[str] = []
    cache = _cache()
    inner = cache.pools.index

    class Recorded:
        device = torch.device("cpu")

        def read(self, rows: torch.Tensor) -> torch.Tensor:
            order.append("index")
            return inner.read(rows)

        def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
            inner.write(rows, values)

    cache.pools.index = Recorded()

    def kv() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        order.append("kv")
        return _kv(8)

    fence = cache.publish(Request("a"), list(range(8)), kv, lambda: torch.arange(8))
    assert fence is not None
    assert order == ["index", "kv"]


def test_a_shared_tier_without_its_client_is_refused_naming_the_store_and_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import qsa_hostcache._tiers as tiers

    def missing(address: MooncakeAddress) -> None:
        raise ImportError("No module named 'mooncake'")

    monkeypatch.setattr(tiers, "MooncakeTier", missing)  # as where Mooncake is not installed
    store = MooncakeAddress.parse("mooncake://127.0.0.1:50051")
    with pytest.raises(StoreUnavailableError) as refused:
        SharedCheckpoints.over_store(store)
    assert str(store) in str(refused.value)
    assert "qsa-hostcache[mooncake]" in str(refused.value)
    assert isinstance(refused.value, ImportError)


def test_in_host_memory_sizes_its_arena_and_checkpoints_the_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new pageable arena (CPU device) of the budget, entries and page size; the sample's
    state structure is checkpointed with the prompt and given back to ``put_state``."""
    index = [torch.arange(SLOTS // RATIO, dtype=torch.float32).view(-1, 1, 1) for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="qsa_hostcache._prompt_cache"):
        cache: PromptCache[Request] = PromptCache.in_host_memory(
            1 << 22,
            index,
            RATIO,
            max_entries=3,
            page_size=PAGE,
            device="cpu",
            state_sample={"conv": torch.zeros(3)},
            extras=_extras,
            namespace=lambda r: NS,
            request_id=lambda r: r.rid,
        )
    arena = cache.cache
    assert (arena.max_entries, arena.page_size, arena.pinned) == (3, PAGE, False)
    assert 0 < arena.capacity_bytes <= 1 << 22
    assert "3 checkpoints at most, pages of 4 tokens; admission always" in caplog.text
    fence = cache.publish(
        Request("a"),
        list(range(8)),
        lambda: _kv(8),
        lambda: torch.arange(8),
        lambda: {"conv": torch.full((3,), 7.0)},
    )
    assert fence is not None
    fence.synchronize()
    later = Request("b")
    assert cache.lookup(later, list(range(11))) == 8
    allocator = Allocator(list(range(16, 32)))
    assert (
        cache.load(later, list(range(8)), TokenSlots(allocator.alloc, allocator.free)) is not None
    )
    states: list[dict[str, torch.Tensor]] = []
    k, v = _kv(8)
    cache.restore(
        later, lambda n: (k, v), lambda layer, f: f.synchronize(), put_state=states.append
    )
    assert [s["conv"].tolist() for s in states] == [[7.0, 7.0, 7.0]]


def test_numbers_parts_follow_their_series() -> None:
    """One series tuple per part, the shared tier's labelled by its tier; none without one."""
    numbers = _cache().numbers()
    parts, series = numbers.parts(), PromptCacheNumbers.series("disk")
    assert parts == (numbers.cache, numbers.prompts, None)
    assert [s.name for s in series[0]] == [f.name for f in dataclasses.fields(CacheStats)]
    assert [s.name for s in series[1]] == [f.name for f in dataclasses.fields(PromptCounts)]
    assert series[2]
    assert all(s.label == ("tier", "disk") for s in series[2])
    assert PromptCacheNumbers.series(None)[2] == ()


@pytest.mark.parametrize(
    ("written", "prompt", "finished", "published"),
    [
        (8, 10, False, True),  # whole pages of a live prompt
        (6, 10, False, False),  # not a whole number of pages
        (12, 10, False, False),  # past the prompt (decoded tokens)
        (8, 10, True, False),  # the request has ended
    ],
)
def test_written_tokens_are_published_only_where_publishes_allows(
    written: int, prompt: int, finished: bool, published: bool
) -> None:
    """With ``prompt_tokens``, a refused length reads nothing and publishes nothing."""
    cache = _cache()
    read: list[int] = []

    def kv() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        read.append(written)
        return _kv(written)

    fence = cache.publish(
        Request("a"),
        list(range(written)),
        kv,
        lambda: torch.arange(written),
        prompt_tokens=prompt,
        finished=finished,
    )
    assert (fence is not None, read == [written]) == (published, published)
    if fence is not None:
        fence.synchronize()
    assert cache.lookup(Request("b"), list(range(written + 1))) == (written if published else 0)


def test_a_length_offered_twice_is_gathered_once_until_the_request_ends() -> None:
    """An overlapped engine offers a prompt's end as the prompt leaves its staging area and
    again with the prefill's result; the second offer reads nothing (the staged K/V may be gone
    by then). A longer length is a new offer, and a request that ended offers afresh."""
    cache = _cache()
    gathered: list[int] = []

    def offer(request: Request, tokens: int) -> CopyFence | None:
        def kv() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            gathered.append(tokens)
            return _kv(tokens)

        fence = cache.publish(request, list(range(tokens)), kv, lambda: torch.arange(tokens))
        if fence is not None:
            fence.synchronize()
        return fence

    a = Request("a")
    assert offer(a, 8) is not None
    assert offer(a, 8) is None
    assert offer(a, 4) is None
    assert offer(a, 12) is not None
    assert gathered == [8, 12]
    cache.forget(a)
    assert offer(Request("a"), 16) is not None
    assert gathered == [8, 12, 16]
