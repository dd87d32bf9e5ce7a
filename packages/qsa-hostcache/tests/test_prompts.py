"""A serving engine's prompts on the cache: lookups, loads, restores and publishes agreed by ranks.

The other ranks of a tensor-parallel group are stood for by the ``agree`` callable a rank gets
(the minimum of its own view and theirs); the real all-reduce over gloo ranks is
``test_every_rank_gets_the_smallest_view``. CPU tensors throughout: the copies are done on
return, and the fences are the arena's own.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from qsa_hostcache import (
    Admission,
    CacheNamespace,
    Claim,
    CopyFence,
    HostPrefixCache,
    Lease,
    PrefixKey,
    PromptCheckpoints,
    agree_min,
    kv_segments,
)

NS = CacheNamespace("m@1", "bfloat16", 1, 0, "cfg")
PAGE, LAYERS, HEADS, D = 4, 2, 1, 8


def _cache(blocks: int = 16) -> HostPrefixCache:
    return HostPrefixCache(
        blocks * 1024, max_entries=8, page_size=PAGE, block_bytes=1024, pin_memory=False
    )


def _key(tokens: int, first: int = 0) -> PrefixKey:
    return PrefixKey(NS, list(range(first, first + tokens)), page_size=PAGE)


def _segments(tokens: int, fill: float) -> dict[str, torch.Tensor]:
    """Each layer's K/V (``[T, Hkv, D]``) and a one-row state, filled with ``fill + layer``."""
    k = [torch.full((tokens, HEADS, D), fill + i) for i in range(LAYERS)]
    v = [torch.full((tokens, HEADS, D), -(fill + i)) for i in range(LAYERS)]
    return {**kv_segments(k, v), "state.0": torch.full((3,), fill)}


class Others:
    """What the other ranks say: each decision is the minimum of this rank's view and theirs."""

    def __init__(self) -> None:
        self.view = 1 << 62  # no opinion: this rank decides

    def __call__(self, value: int) -> int:
        return min(value, self.view)


def _published(checkpoints: PromptCheckpoints[int], tokens: int, fill: float) -> None:
    fence = checkpoints.publish(_key(tokens), lambda: _segments(tokens, fill))
    assert fence is not None
    fence.synchronize()


# ---- lookup and publish --------------------------------------------------------------------------


def test_a_published_prompt_is_found_by_a_longer_one() -> None:
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(_cache())
    _published(checkpoints, 8, 1.0)
    assert checkpoints.lookup(_key(12)) == 8
    assert checkpoints.lookup(_key(12, first=50)) == 0
    assert checkpoints.lookup(None) == 0  # a prompt that is not keyed


def test_a_hit_is_the_shortest_any_rank_holds() -> None:
    others = Others()
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(_cache(), agree=others)
    _published(checkpoints, 8, 1.0)
    others.view = 4  # another rank evicted its 8-token checkpoint and kept a 4-token one
    assert checkpoints.lookup(_key(12)) == 4


def test_a_publish_no_rank_can_make_is_made_by_none() -> None:
    others = Others()
    cache = _cache()
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(cache, agree=others)
    others.view = 0  # another rank has no room
    assert checkpoints.publish(_key(8), lambda: _segments(8, 1.0)) is None
    assert cache.stats().reserved_entries == 0
    assert cache.stats().aborts == 1
    assert checkpoints.lookup(_key(8)) == 0


def test_a_failed_gather_is_counted_and_the_ranks_still_agree() -> None:
    votes: list[int] = []

    def agree(value: int) -> int:
        votes.append(value)
        return value

    def gather() -> dict[str, torch.Tensor]:
        raise RuntimeError("the staging area was handed off")

    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(_cache(), agree=agree)
    assert checkpoints.publish(_key(8), gather) is None
    assert votes == [0]
    assert checkpoints.counts.publish_errors == 1


def test_admission_second_checkpoints_a_prefix_the_second_time_a_request_reaches_it() -> None:
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(_cache(), admission=Admission.SECOND)
    gathered: list[int] = []

    def offer(tokens: int, first: int = 0) -> CopyFence | None:
        def gather() -> dict[str, torch.Tensor]:
            gathered.append(tokens)
            return _segments(tokens, 1.0)

        return checkpoints.publish(_key(tokens, first), gather)

    assert offer(8) is None  # first sighting: nothing gathered, nothing copied
    assert offer(8, first=100) is None  # another prompt of the same length is another prefix
    assert checkpoints.lookup(_key(8)) == 0
    fence = offer(8)  # the second request that reaches it
    assert fence is not None
    fence.synchronize()

    assert checkpoints.lookup(_key(12)) == 8  # the third loads it
    assert gathered == [8]
    assert checkpoints.counts.deferred == 2
    assert checkpoints.cache.stats().publishes == 1


def test_admission_always_checkpoints_the_first_sighting() -> None:
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(_cache())
    _published(checkpoints, 8, 1.0)
    assert checkpoints.lookup(_key(8)) == 8
    assert checkpoints.counts.deferred == 0


def test_a_checkpoint_larger_than_the_arena_is_skipped_not_an_error() -> None:
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(_cache(blocks=1))
    assert checkpoints.publish(_key(64), lambda: _segments(64, 1.0)) is None
    assert checkpoints.counts.publish_errors == 0


# ---- load, restore, forget -----------------------------------------------------------------------


def test_a_loaded_checkpoint_restores_each_layer_by_its_own_copies() -> None:
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(_cache())
    _published(checkpoints, 8, 1.0)
    claimed: list[Lease] = []

    def claim(lease: Lease) -> Claim[int]:
        claimed.append(lease)
        return Claim(77, lambda: None)

    assert checkpoints.load("req-1", _key(8), claim) == 77
    assert checkpoints.claimed("req-1") == 77
    assert (checkpoints.counts.loads, checkpoints.counts.loaded_tokens) == (1, 8)
    lease = checkpoints.take("req-1")
    assert lease is claimed[0]
    assert checkpoints.claimed("req-1") is None
    k = [torch.zeros(8, HEADS, D) for _ in range(LAYERS)]
    v = [torch.zeros(8, HEADS, D) for _ in range(LAYERS)]
    fenced: list[tuple[int, CopyFence]] = []
    with lease:
        state = torch.zeros(3)
        checkpoints.restore(lease, {"state.0": state})
        checkpoints.restore_kv(lease, k, v, lambda layer, fence: fenced.append((layer, fence)))
    assert [layer for layer, _ in fenced] == list(range(LAYERS))
    assert [float(t[0, 0, 0]) for t in k] == [1.0, 2.0]
    assert [float(t[0, 0, 0]) for t in v] == [-1.0, -2.0]
    assert float(state[0]) == 1.0


def test_a_load_any_rank_cannot_claim_gives_everything_back_on_every_rank() -> None:
    others = Others()
    cache = _cache()
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(cache, agree=others)
    _published(checkpoints, 8, 1.0)
    given_back: list[int] = []
    others.view = 0  # another rank has no slots
    value = checkpoints.load("req-1", _key(8), lambda _: Claim(5, lambda: given_back.append(5)))
    assert value is None
    assert given_back == [5]
    assert cache.stats().pinned_entries == 0
    assert checkpoints.counts.load_back_failures == 1
    assert checkpoints.take("req-1") is None


def test_a_claim_that_cannot_take_slots_loads_nothing() -> None:
    cache = _cache()
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(cache)
    _published(checkpoints, 8, 1.0)
    assert checkpoints.load("req-1", _key(8), lambda _: None) is None
    assert cache.stats().pinned_entries == 0


def test_a_checkpoint_shorter_than_the_agreed_length_is_not_loaded() -> None:
    cache = _cache()
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(cache)
    _published(checkpoints, 4, 1.0)
    claims: list[Lease] = []

    def claim(lease: Lease) -> Claim[int]:
        claims.append(lease)
        return Claim(1, lambda: None)

    assert checkpoints.load("req-1", _key(8), claim) is None
    assert claims == []
    assert cache.stats().pinned_entries == 0


def test_a_request_that_goes_before_its_restore_unpins_its_checkpoint() -> None:
    cache = _cache()
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(cache)
    _published(checkpoints, 8, 1.0)
    checkpoints.load("req-1", _key(8), lambda _: Claim(1, lambda: None))
    assert cache.stats().pinned_entries == 1
    checkpoints.forget("req-1")
    assert cache.stats().pinned_entries == 0
    checkpoints.forget("req-1")  # once is enough; a second forget changes nothing


# ---- weights -------------------------------------------------------------------------------------


def test_new_weights_drop_every_checkpoint_and_every_pending_load() -> None:
    version = ["v1"]
    cache = _cache()
    checkpoints: PromptCheckpoints[int] = PromptCheckpoints(cache, weights=lambda: version[0])
    _published(checkpoints, 8, 1.0)
    checkpoints.load("req-1", _key(8), lambda _: Claim(1, lambda: None))
    version[0] = "v2"
    assert checkpoints.lookup(_key(8)) == 0
    assert cache.stats().pinned_entries == 0
    assert checkpoints.take("req-1") is None
    _published(checkpoints, 8, 2.0)  # the new weights' checkpoints are kept
    assert checkpoints.lookup(_key(8)) == 8


# ---- the agreement over real ranks ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank(rank: int, world: int, port: int, views: list[int], out: torch.Tensor) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        out[rank] = agree_min(group)(views[rank])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "views",
    [
        [2048, 1024],  # rank 1 evicted the longer checkpoint: both load 1,024 tokens
        [1, 0],  # rank 1 has no room for a publish: nobody publishes
        [3072, 3072, 0, 3072],  # one rank of four missed: all miss
    ],
)
def test_every_rank_gets_the_smallest_view(views: list[int]) -> None:
    out = torch.full((len(views),), -1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
    spawn(_rank, args=(len(views), _free_port(), views, out), nprocs=len(views), join=True)  # type: ignore[no-untyped-call]
    assert out.tolist() == [min(views)] * len(views)


def test_one_rank_decides_alone() -> None:
    assert agree_min(None)(1536) == 1536
