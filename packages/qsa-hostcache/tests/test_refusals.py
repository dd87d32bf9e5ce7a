"""Every public call succeeds or refuses with this package's error, naming the value it refused,
and a refused call leaves the cache as it was: its checkpoints, statistics and LRU order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings

from qsa_hostcache import (
    CacheNamespace,
    HostCacheError,
    HostPrefixCache,
    PrefixKey,
    SegmentSpec,
)
from qsa_pytest.refusals import Case, any_value, check_refusal, each_argument, refusal

NS_ARGS: Mapping[str, Any] = {
    "model": "m@1",
    "dtype": "float8_e4m3fn",
    "tp_size": 2,
    "tp_rank": 0,
    "config_digest": "cfg",
}
NS = CacheNamespace(**NS_ARGS)
PAGE, BLOCK = 4, 1024

#: ``(name, call taking keyword arguments, valid keyword arguments)``.
CASES: tuple[Case, ...] = (
    # Built and encoded: a namespace that builds must also give its key material.
    (
        "CacheNamespace",
        lambda **kw: CacheNamespace(**kw).material(),
        {**NS_ARGS, "salt": "adapter-1"},
    ),
    (
        "PrefixKey",
        lambda **kw: PrefixKey(NS, kw["tokens"], page_size=kw["page_size"]),
        {"tokens": [1, 2, 3, 4], "page_size": PAGE},
    ),
    (
        "PrefixKey tokens",
        lambda **kw: PrefixKey(NS, [1, 2, kw["token"], 4], page_size=PAGE),
        {"token": 3},
    ),
    (
        "HostPrefixCache",
        lambda **kw: HostPrefixCache(pin_memory=False, **kw),
        {"budget_bytes": 8 * BLOCK, "max_entries": 4, "page_size": PAGE, "block_bytes": BLOCK},
    ),
)


@each_argument(CASES)
@settings(deadline=None, max_examples=60)
@given(value=any_value())
def test_a_call_succeeds_or_refuses_with_the_package_error_naming_the_value(
    call: Callable[..., object], valid: Mapping[str, Any], arg: str, value: object
) -> None:
    check_refusal(call, valid, arg, value, HostCacheError)


def _cache_with_two_checkpoints() -> HostPrefixCache:
    cache = HostPrefixCache(
        8 * BLOCK, max_entries=4, page_size=PAGE, block_bytes=BLOCK, pin_memory=False
    )
    for first in (0, 100):
        key = PrefixKey(NS, list(range(first, first + 2 * PAGE)), page_size=PAGE)
        assert cache.publish(key, {"kv": torch.full((BLOCK,), first % 251, dtype=torch.uint8)})
    return cache


def _observable(cache: HostPrefixCache) -> tuple[object, ...]:
    """What a caller can see of the cache: statistics, LRU order and each checkpoint's bytes."""
    restored = []
    for first in (0, 100):
        query = PrefixKey(NS, list(range(first, first + 2 * PAGE)), page_size=PAGE)
        lease = cache.acquire(query)
        assert lease is not None
        into = {"kv": torch.empty(BLOCK, dtype=torch.uint8)}
        cache.restore(lease, into).wait()
        lease.release()
        restored.append(into["kv"].tolist())
    return cache.stats(), tuple(cache.lru_order()), tuple(map(tuple, restored))


def _stats_and_order(cache: HostPrefixCache) -> tuple[object, ...]:
    """Statistics and the LRU order; ``too_large``, whose job is to count refusals, left out."""
    stats = dataclasses.replace(cache.stats(), too_large=0)
    return stats, tuple(cache.lru_order())


def _calls(value: object) -> dict[str, Callable[[HostPrefixCache], object]]:
    """Calls on the cache with ``value`` in one argument's place."""
    good = PrefixKey(NS, list(range(200, 200 + PAGE)), page_size=PAGE)
    return {
        "match max_tokens": lambda c: c.match(good, max_tokens=value),  # type: ignore[arg-type]
        "publish segments": lambda c: c.publish(good, {"kv": value}),  # type: ignore[dict-item]
        "publish key": lambda c: c.publish(value, {"kv": torch.zeros(4, dtype=torch.uint8)}),  # type: ignore[arg-type]
        "reserve segments": lambda c: c.reserve(good, [SegmentSpec("kv", value)]),  # type: ignore[arg-type]
        "pin": lambda c: c.pin(value),  # type: ignore[arg-type]
    }


@pytest.mark.parametrize("call_name", list(_calls(None)))
@settings(deadline=None, max_examples=40)
@given(value=any_value())
def test_a_refused_cache_call_changes_no_checkpoint_statistic_or_order(
    call_name: str, value: object
) -> None:
    cache = _cache_with_two_checkpoints()
    contents = _observable(cache)
    before = _stats_and_order(cache)
    refused = refusal(_calls(value)[call_name], {"c": cache}, HostCacheError)
    if refused is None:
        return  # accepted: a valid call may change the cache
    assert _stats_and_order(cache) == before, str(refused)
    assert _observable(cache)[2] == contents[2]
