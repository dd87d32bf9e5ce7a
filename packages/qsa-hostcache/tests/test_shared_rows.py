"""Checkpoints that extend shorter ones: only the new rows are copied, restores read the chain.

A prompt's K/V and index run over its tokens (``token_rows``), so the checkpoint at 2,048 tokens
of a prompt whose checkpoint at 1,024 is cached stores only rows 1,024..2,047 and reads the rest
from the shorter one. These tests pin what that must never change: every restore returns exactly
the published bytes, eviction and invalidation never free rows a live checkpoint still reads,
and every block comes back once nothing holds it.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qsa_hostcache import (
    CacheNamespace,
    HostPrefixCache,
    PrefixKey,
    PromptCheckpoints,
    SegmentError,
    SegmentSpec,
    kv_segments,
    prompt_segment_spec,
    segment_buffer,
)

NS = CacheNamespace("m@1", "bfloat16", 1, 0, "cfg")
PAGE = 4
BLOCK = 256
ROW = (2, 4)  # [Hkv, D] of one K/V row
ROW_BYTES = 2 * 4 * 2  # bf16


def make_cache(blocks: int = 64, max_entries: int = 32) -> HostPrefixCache:
    return HostPrefixCache(
        blocks * BLOCK,
        max_entries=max_entries,
        page_size=PAGE,
        block_bytes=BLOCK,
        segment_align=16,
        pin_memory=False,
    )


def prompt(seed: int, pages: int = 16) -> list[int]:
    return random.Random(seed).choices(range(1000), k=pages * PAGE)


def kv_of(tokens: list[int]) -> torch.Tensor:
    """``[T, 2, 4]`` bf16 rows that depend on each token and its position only."""
    ids = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    return (ids[:, None, None] + pos[:, None, None] / 7 + torch.arange(8.0).view(1, *ROW) / 3).to(
        torch.bfloat16
    )


def segments(tokens: list[int]) -> dict[str, torch.Tensor]:
    """A prompt checkpoint's segments: one layer's K/V (token rows) and a state (whole)."""
    kv = kv_of(tokens)
    return {"k.0": kv, "v.0": -kv, "state.0": torch.full((3, 5), float(len(tokens)))}


def publish(cache: HostPrefixCache, tokens: list[int]) -> bool:
    seg = segments(tokens)
    specs = [prompt_segment_spec(name, t) for name, t in seg.items()]
    ticket = cache.reserve(PrefixKey(NS, tokens, page_size=PAGE), specs)
    if ticket is None:
        return False
    ticket.write(seg)
    ticket.commit()
    return True


def restore(cache: HostPrefixCache, tokens: list[int]) -> tuple[int, dict[str, torch.Tensor]]:
    """The longest cached prefix of ``tokens`` and its restored segments (0, {} on a miss)."""
    lease = cache.acquire(PrefixKey(NS, tokens, page_size=PAGE))
    if lease is None:
        return 0, {}
    with lease:
        into = {s.name: empty_like(s) for s in lease.match.segments}
        cache.restore(lease, into)
        return lease.match.num_tokens, into


def empty_like(spec: SegmentSpec) -> torch.Tensor:
    return segment_buffer(spec, "cpu")


def assert_restores_exactly(cache: HostPrefixCache, tokens: list[int]) -> int:
    """Restore the longest cached prefix of ``tokens``; every byte is the published one."""
    hit, got = restore(cache, tokens)
    assert hit > 0
    want = segments(tokens[:hit])
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (name, hit)
    return hit


def test_a_checkpoint_extending_a_cached_prefix_copies_only_its_new_rows() -> None:
    cache = make_cache()
    tokens = prompt(1)
    assert publish(cache, tokens[: 4 * PAGE])
    first = cache.stats()
    assert (first.bytes_in, first.shared_bytes) == (2 * 16 * ROW_BYTES + 15 * 4, 0)
    assert publish(cache, tokens[: 10 * PAGE])
    second = cache.stats()
    # Rows 16..39 of K and V and the whole state are copied; rows 0..15 are read from the first.
    assert second.bytes_in - first.bytes_in == 2 * 24 * ROW_BYTES + 15 * 4
    assert second.shared_bytes == 2 * 16 * ROW_BYTES
    assert second.payload_bytes == 2 * 40 * ROW_BYTES + 2 * 15 * 4
    assert assert_restores_exactly(cache, tokens) == 10 * PAGE
    assert assert_restores_exactly(cache, tokens[: 9 * PAGE]) == 4 * PAGE


def test_a_chain_of_checkpoints_restores_each_row_from_the_checkpoint_that_holds_it() -> None:
    cache = make_cache()
    tokens = prompt(2)
    for pages in (2, 5, 11, 16):
        assert publish(cache, tokens[: pages * PAGE])
    assert cache.stats().shared_bytes == 2 * ROW_BYTES * PAGE * (2 + 5 + 11)
    for pages in (2, 5, 11, 16):
        assert assert_restores_exactly(cache, tokens[: pages * PAGE]) == pages * PAGE


def test_a_checkpoint_of_another_prompt_shares_only_the_common_prefix_checkpoint() -> None:
    """Two prompts with a common system prefix each extend the prefix's checkpoint."""
    cache = make_cache()
    system = prompt(3, pages=6)
    a, b = system + prompt(4, pages=3), system + prompt(5, pages=3)
    assert publish(cache, system)
    assert publish(cache, a)
    assert publish(cache, b)
    assert cache.stats().shared_bytes == 2 * (2 * 6 * PAGE * ROW_BYTES)
    assert assert_restores_exactly(cache, a) == len(a)
    assert assert_restores_exactly(cache, b) == len(b)


def test_segments_of_another_row_shape_or_dtype_are_stored_whole() -> None:
    cache = make_cache()
    tokens = prompt(6)
    short = tokens[: 4 * PAGE]
    base = {"k.0": kv_of(short).float(), "v.0": -kv_of(short)}
    specs = [prompt_segment_spec(n, t) for n, t in base.items()]
    ticket = cache.reserve(PrefixKey(NS, short, page_size=PAGE), specs)
    assert ticket is not None
    ticket.write(base)
    ticket.commit()
    assert publish(cache, tokens[: 8 * PAGE])
    # Only v.0 had the same dtype: k.0 (float32 before, bf16 now) was copied whole.
    assert cache.stats().shared_bytes == 16 * ROW_BYTES
    assert assert_restores_exactly(cache, tokens[: 8 * PAGE]) == 8 * PAGE


def test_segments_without_token_rows_are_never_shared() -> None:
    cache = make_cache()
    tokens = prompt(7)
    for pages in (4, 8):
        seg = segments(tokens[: pages * PAGE])
        assert cache.publish(PrefixKey(NS, tokens[: pages * PAGE], page_size=PAGE), seg)
    assert cache.stats().shared_bytes == 0


def test_eviction_takes_a_checkpoint_only_after_those_that_extend_it() -> None:
    """The base is the least recently used, but the checkpoint extending it goes first."""
    cache = make_cache(blocks=6)
    tokens = prompt(8)
    assert publish(cache, tokens[: 4 * PAGE])  # 2 x 512 B of rows + state: 3 blocks
    assert publish(cache, tokens[: 8 * PAGE])  # the next 16 rows + state: 3 blocks, arena full
    assert publish(cache, prompt(9)[: 4 * PAGE])  # needs 3 blocks
    # The longer checkpoint went although the base was less recently used: it is read by it.
    assert cache.stats().evictions == 1
    assert restore(cache, tokens)[0] == 4 * PAGE
    assert_restores_exactly(cache, tokens)


def test_a_base_is_never_evicted_while_a_checkpoint_extending_it_is_being_written() -> None:
    cache = make_cache(blocks=6)
    tokens = prompt(10)
    assert publish(cache, tokens[: 4 * PAGE])
    seg = segments(tokens[: 8 * PAGE])
    specs = [prompt_segment_spec(n, t) for n, t in seg.items()]
    ticket = cache.reserve(PrefixKey(NS, tokens[: 8 * PAGE], page_size=PAGE), specs)
    assert ticket is not None
    # The arena is full and the only READY checkpoint is the base of the one being written.
    assert not publish(cache, prompt(11)[: 4 * PAGE])
    assert cache.stats().refusals == 1
    ticket.write(seg)
    ticket.commit()
    assert_restores_exactly(cache, tokens)


def test_an_aborted_extension_gives_its_base_back_to_eviction() -> None:
    cache = make_cache(blocks=6)
    tokens = prompt(12)
    assert publish(cache, tokens[: 4 * PAGE])
    seg = segments(tokens[: 8 * PAGE])
    specs = [prompt_segment_spec(n, t) for n, t in seg.items()]
    ticket = cache.reserve(PrefixKey(NS, tokens[: 8 * PAGE], page_size=PAGE), specs)
    assert ticket is not None
    ticket.abort()
    assert publish(cache, prompt(13)[: 4 * PAGE])
    assert publish(cache, prompt(14)[: 4 * PAGE])
    assert cache.stats().evictions == 1
    assert restore(cache, tokens)[0] == 0


def test_an_invalidated_base_lives_until_the_pinned_checkpoint_extending_it_is_released() -> None:
    cache = make_cache(blocks=6)
    tokens = prompt(15)
    assert publish(cache, tokens[: 4 * PAGE])
    assert publish(cache, tokens[: 8 * PAGE])
    lease = cache.acquire(PrefixKey(NS, tokens, page_size=PAGE))
    assert lease is not None
    assert cache.invalidate_all() == 2
    stats = cache.stats()
    assert (stats.ready_entries, stats.retired_entries) == (0, 2)
    # The arena is full of retired blocks: nothing can be published or evicted now.
    assert not publish(cache, prompt(16)[: 4 * PAGE])
    into = {s.name: empty_like(s) for s in lease.match.segments}
    cache.restore(lease, into)
    for name, tensor in segments(tokens[: 8 * PAGE]).items():
        assert torch.equal(into[name], tensor)
    lease.release()
    stats = cache.stats()
    assert (stats.entries, stats.used_bytes) == (0, 0)


def test_token_rows_need_a_shape_whose_rows_divide_the_bytes() -> None:
    with pytest.raises(SegmentError, match="token_rows needs a shape"):
        SegmentSpec("k.0", 64, token_rows=True)
    with pytest.raises(SegmentError, match=r"shape \(3, 4\)"):
        SegmentSpec("k.0", 64, shape=(3, 4), token_rows=True)


def test_prompt_checkpoints_share_the_kv_and_index_rows_of_a_shorter_prompt() -> None:
    """``PromptCheckpoints.publish`` marks the K/V and index as token rows; the state is whole."""
    cache = make_cache()
    checkpoints: PromptCheckpoints[None] = PromptCheckpoints(cache, weights=lambda: 0)
    tokens = prompt(17)
    for pages in (4, 8):
        kv = kv_of(tokens[: pages * PAGE])
        gathered = {
            **kv_segments([kv], [-kv]),
            "index": kv[::4, :1].contiguous(),
            "state.0": torch.zeros(7),
        }
        key = PrefixKey(NS, tokens[: pages * PAGE], page_size=PAGE)
        assert checkpoints.publish(key, lambda g=gathered: g) is not None  # type: ignore[misc]
    stats = cache.stats()
    index_rows = 4 * PAGE // 4
    assert stats.shared_bytes == 2 * 4 * PAGE * ROW_BYTES + index_rows * ROW_BYTES // 2


@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["publish", "pin", "unpin", "invalidate"]), st.integers(0, 2)),
        min_size=1,
        max_size=30,
    ),
    pages=st.lists(st.integers(1, 12), min_size=30, max_size=30),
)
def test_any_sequence_restores_exact_rows_and_frees_every_block(
    steps: list[tuple[str, int]], pages: list[int]
) -> None:
    """Publishes of prefixes of three prompts (two share a system prefix), pins, invalidations
    and evictions in a small arena: every hit restores exactly; once idle, nothing is held."""
    cache = make_cache(blocks=10, max_entries=6)
    system = prompt(20, pages=4)
    prompts = [system + prompt(21, pages=8), system + prompt(22, pages=8), prompt(23, pages=12)]
    leases = []
    for (op, which), n in zip(steps, pages, strict=False):
        tokens = prompts[which]
        if op == "publish":
            publish(cache, tokens[: n * PAGE])
        elif op == "pin" and (lease := cache.acquire(PrefixKey(NS, tokens, page_size=PAGE))):
            leases.append((lease, tokens))
        elif op == "unpin" and leases:
            leases.pop(0)[0].release()
        elif op == "invalidate":
            cache.invalidate_all()
        for lease, pinned in leases:  # pinned checkpoints stay readable, invalidated or not
            into = {s.name: empty_like(s) for s in lease.match.segments}
            cache.restore(lease, into)
            for name, tensor in segments(pinned[: lease.match.num_tokens]).items():
                assert torch.equal(into[name], tensor), (name, lease.match)
        for tokens in prompts:
            hit, got = restore(cache, tokens)
            for name, tensor in segments(tokens[:hit]).items() if hit else ():
                assert torch.equal(got[name], tensor), (name, hit)
        stats = cache.stats()
        assert stats.used_bytes <= 10 * BLOCK
    for lease, _ in leases:
        lease.release()
    cache.invalidate_all()
    stats = cache.stats()
    assert (stats.entries, stats.used_bytes, stats.payload_bytes) == (0, 0, 0)
