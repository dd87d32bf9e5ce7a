"""A prompt's checkpoint composed from an engine's pools and restored into them (PromptPools).

The pools are plain CPU tensors: per-layer index buffers addressed by token slot, staged K/V
of ``[T, Hkv, D]`` a layer, a recurrent state of two tensors; the allocator is a list of slots.
"""

from __future__ import annotations

import pytest
import torch

from qsa_hostcache import (
    INDEX_SEGMENT,
    BufferIndex,
    CacheNamespace,
    CopyFence,
    HostPrefixCache,
    IndexAccess,
    PrefixKey,
    PromptCheckpoints,
    PromptPools,
    StateSegments,
    TokenSlots,
    admits_host_hit,
    host_hit,
    kv_segments,
)

NS = CacheNamespace("m@1", "bfloat16", 1, 0, "cfg")
PAGE, RATIO, LAYERS, HKV, D, HI, DI = 4, 2, 2, 1, 8, 1, 4
SLOTS = 32


class Allocator:
    """Free token slots, handed out in order."""

    def __init__(self, free: list[int]) -> None:
        self.free_slots = free

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(taken, dtype=torch.int32)

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots = sorted(self.free_slots + slots.tolist())


def _index() -> list[torch.Tensor]:
    """Each layer's ``[SLOTS / RATIO, HI, DI]`` index rows, row ``r`` of layer ``l`` = 100 l + r."""
    rows = torch.arange(SLOTS // RATIO, dtype=torch.float32)
    return [(100 * layer + rows).view(-1, 1, 1).expand(-1, HI, DI).clone() for layer in range(2)]


def _kv(tokens: int, fill: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    k = [torch.full((tokens, HKV, D), fill + i) for i in range(LAYERS)]
    v = [torch.full((tokens, HKV, D), -(fill + i)) for i in range(LAYERS)]
    return k, v


def _pools(index: list[torch.Tensor] | IndexAccess, state: object = None) -> PromptPools:
    cache = HostPrefixCache(
        32 * 1024, max_entries=8, page_size=PAGE, block_bytes=1024, pin_memory=False
    )
    checkpoints: PromptCheckpoints[torch.Tensor] = PromptCheckpoints(cache)
    layout = None if state is None else StateSegments(state)
    return PromptPools(checkpoints, index, RATIO, state=layout)


def _key(tokens: int) -> PrefixKey:
    return PrefixKey(NS, list(range(tokens)), page_size=PAGE)


def test_a_checkpoint_holds_kv_the_index_rows_of_its_slots_by_layer_and_the_state() -> None:
    state = {"conv": torch.ones(3), "temporal": torch.zeros(2, 2)}
    pools = _pools(_index(), state)
    slots = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23], dtype=torch.int32)
    segments = pools.gather(lambda: _kv(8, 1.0), slots, lambda: state)
    assert list(segments) == ["k.0", "k.1", "v.0", "v.1", INDEX_SEGMENT, "state.0", "state.1"]
    index = segments[INDEX_SEGMENT]
    assert index.shape == (8 // RATIO, LAYERS, HI, DI)  # [T / ratio, L, Hi, Di]
    assert index[:, 0, 0, 0].tolist() == [4, 5, 10, 11]  # slot // ratio of each group's first
    assert index[:, 1, 0, 0].tolist() == [104, 105, 110, 111]


def test_a_model_without_a_recurrent_state_never_reads_one() -> None:
    def state() -> object:
        raise AssertionError("read a state the model does not keep")

    segments = _pools(_index()).gather(lambda: _kv(4, 1.0), torch.arange(4), state)
    assert "state.0" not in segments


def test_a_loaded_checkpoint_takes_slots_and_fills_their_index_rows_from_every_layer() -> None:
    source = _pools(_index())
    fence = source.checkpoints.publish(
        _key(8), lambda: source.gather(lambda: _kv(8, 1.0), torch.arange(8, 16))
    )
    assert fence is not None
    fence.synchronize()
    blank = [torch.zeros_like(buf) for buf in _index()]
    pools = PromptPools(source.checkpoints, blank, RATIO)
    allocator = Allocator([24, 25, 26, 27, 28, 29, 30, 31])
    slots = pools.load("req-1", _key(8), TokenSlots(allocator.alloc, allocator.free))
    assert slots is not None
    assert slots.tolist() == [24, 25, 26, 27, 28, 29, 30, 31]
    assert pools.checkpoints.claimed("req-1") is slots
    assert blank[0][12:16, 0, 0].tolist() == [4, 5, 6, 7]  # rows of slots 8..15 in slots 24..31
    assert blank[1][12:16, 0, 0].tolist() == [104, 105, 106, 107]
    assert allocator.free_slots == []


def test_a_load_without_free_slots_holds_nothing() -> None:
    pools = _pools(_index())
    fence = pools.checkpoints.publish(
        _key(8), lambda: pools.gather(lambda: _kv(8, 1.0), torch.arange(8))
    )
    assert fence is not None
    fence.synchronize()
    allocator = Allocator([1, 2])
    assert pools.load("req-1", _key(8), TokenSlots(allocator.alloc, allocator.free)) is None
    assert pools.checkpoints.cache.stats().pinned_entries == 0
    assert pools.checkpoints.counts.load_back_failures == 1


def test_slots_taken_for_an_index_that_cannot_be_restored_are_given_back() -> None:
    pools = _pools(_index())
    fence = pools.checkpoints.publish(_key(8), lambda: _kv_only(8))
    assert fence is not None
    fence.synchronize()
    allocator = Allocator(list(range(8)))
    assert pools.load("req-1", _key(8), TokenSlots(allocator.alloc, allocator.free)) is None
    assert allocator.free_slots == list(range(8))  # the checkpoint has no index segment


def _kv_only(tokens: int) -> dict[str, torch.Tensor]:
    return kv_segments(*_kv(tokens, 1.0))


def test_a_restore_puts_the_state_back_before_the_kv_of_each_layer() -> None:
    state = {"conv": torch.full((3,), 7.0), "temporal": torch.full((2, 2), 3.0)}
    pools = _pools(_index(), state)
    fence = pools.checkpoints.publish(
        _key(8), lambda: pools.gather(lambda: _kv(8, 1.0), torch.arange(8), lambda: state)
    )
    assert fence is not None
    fence.synchronize()
    allocator = Allocator(list(range(16, 24)))
    assert pools.load("req-1", _key(8), TokenSlots(allocator.alloc, allocator.free)) is not None
    k, v = _kv(8, 0.0)
    order: list[str] = []
    restored: list[object] = []

    def stage(tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        order.append(f"stage {tokens}")
        return k, v

    def filled(layer: int, fence: CopyFence) -> None:
        del fence
        order.append(f"layer {layer}")

    def put_state(value: object) -> None:
        order.append("state")
        restored.append(value)

    assert pools.restore("req-1", stage, filled, put_state=put_state) == 8
    assert order == ["state", "stage 8", "layer 0", "layer 1"]
    back = restored[0]
    assert isinstance(back, dict)
    assert torch.equal(back["conv"], state["conv"])
    assert [float(t[0, 0, 0]) for t in k] == [1.0, 2.0]
    assert pools.checkpoints.cache.stats().pinned_entries == 0
    assert pools.restore("req-1", stage, filled) is None  # restored once


class RecordedIndex:
    """An :class:`IndexAccess` over whole buffers that records each call (and the K/V read)."""

    def __init__(self, buffers: list[torch.Tensor], calls: list[str]) -> None:
        self.inner, self.calls = BufferIndex(tuple(buffers)), calls

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls.append(f"read {rows.tolist()}")
        return self.inner.read(rows) + 1000  # marks the rows as the access's

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.calls.append(f"write {rows.tolist()}")
        self.inner.write(rows, values)


def test_the_default_index_access_indexes_the_buffers_it_was_given() -> None:
    index = _index()
    pools = _pools(index)
    assert isinstance(pools.index, BufferIndex)
    assert pools.index.buffers == tuple(index)
    assert not isinstance(index, IndexAccess)  # a list of buffers is wrapped, not taken as one


def test_an_injected_index_access_is_read_first_by_a_gather_and_written_by_a_load() -> None:
    """The gather reads the index through the access before it reads the K/V (a collective
    read is made before anything rank-local); the load writes through it into the new rows."""
    calls: list[str] = []
    source = _pools(RecordedIndex(_index(), calls))

    def kv() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        calls.append("kv")
        return _kv(8, 1.0)

    fence = source.checkpoints.publish(_key(8), lambda: source.gather(kv, torch.arange(8, 16)))
    assert fence is not None
    fence.synchronize()
    assert calls == ["read [4, 5, 6, 7]", "kv"]
    blank = [torch.zeros_like(buf) for buf in _index()]
    pools = PromptPools(source.checkpoints, RecordedIndex(blank, calls), RATIO)
    allocator = Allocator(list(range(24, 32)))
    assert pools.load("req-1", _key(8), TokenSlots(allocator.alloc, allocator.free)) is not None
    assert calls[-1] == "write [12, 13, 14, 15]"
    assert blank[0][12:16, 0, 0].tolist() == [1004, 1005, 1006, 1007]  # what the access read
    assert blank[1][12:16, 0, 0].tolist() == [1104, 1105, 1106, 1107]


@pytest.mark.parametrize(
    ("up_to", "prompt", "finished", "publishes"),
    [
        (8, 10, False, True),
        (4, 4, False, True),
        (2, 10, False, False),  # less than a page
        (6, 10, False, False),  # not a whole number of pages
        (12, 10, False, False),  # beyond the prompt: generated tokens
        (8, 10, True, False),  # a finished request
    ],
)
def test_a_live_prompt_publishes_at_whole_pages_only(
    up_to: int, prompt: int, finished: bool, publishes: bool
) -> None:
    pools = _pools(_index())
    assert pools.publishes(up_to, prompt_tokens=prompt, finished=finished) is publishes


def test_a_lookup_asks_for_a_key_only_for_a_page_or_more() -> None:
    pools = _pools(_index())
    fence = pools.checkpoints.publish(
        _key(8), lambda: pools.gather(lambda: _kv(8, 1.0), torch.arange(8))
    )
    assert fence is not None
    fence.synchronize()

    def no_key() -> PrefixKey:
        raise AssertionError("keyed a prompt shorter than a page")

    assert pools.lookup(3, no_key) == 0
    assert pools.lookup(12, lambda: _key(12)) == 8
    assert pools.lookup(12, None) == 0  # not keyed


def test_a_host_hit_counts_only_tokens_beyond_the_device_prefix() -> None:
    assert host_hit(8, 4) == 4
    assert host_hit(8, 8) == 0
    assert host_hit(4, 8) == 0


def test_a_pending_host_hit_takes_the_loading_path_only_where_the_device_cache_is_off() -> None:
    assert admits_host_hit(4, device_cache_disabled=True)
    assert not admits_host_hit(0, device_cache_disabled=True)
    assert not admits_host_hit(4, device_cache_disabled=False)
