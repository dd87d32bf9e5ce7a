"""Every public call succeeds or refuses with this package's error, naming the value it refused,
and a refused call leaves the cache as it was: its checkpoints, statistics and LRU order.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ---- tensors the arena cannot copy as they are -------------------------------------------------


def _nested(n: int, layout: torch.layout) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.ones(n), torch.ones(n + 1)], layout=layout)


#: Builders of tensors of ``n`` elements (about) that are not plain dense host tensors.
UNUSUAL: Mapping[str, Callable[[int], torch.Tensor]] = {
    "conjugate view": lambda n: torch.randn(n, dtype=torch.complex64).conj(),
    "negative view": lambda n: torch.randn(n, dtype=torch.complex64).conj().imag,
    "nested": lambda n: _nested(n, torch.strided),
    "nested jagged": lambda n: _nested(n, torch.jagged),
    "qint8": lambda n: torch.quantize_per_tensor(torch.randn(n), 0.1, 0, torch.qint8),
    "quint8": lambda n: torch.quantize_per_tensor(torch.randn(n), 0.1, 3, torch.quint8),
    "qint32": lambda n: torch.quantize_per_tensor(torch.randn(n), 0.1, 0, torch.qint32),
    "per-channel qint8": lambda n: torch.quantize_per_channel(
        torch.randn(2, n), torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), 0, torch.qint8
    ),
    "sparse coo": lambda n: torch.ones(n).to_sparse(),
    "sparse csr": lambda n: torch.eye(n).to_sparse_csr(),
    "meta": lambda n: torch.empty(n, device="meta"),
    "strided": lambda n: torch.arange(2 * n, dtype=torch.float32)[::2],
    "expanded": lambda n: torch.ones(1, dtype=torch.float64).expand(n),
    "transposed": lambda n: torch.arange(2 * n, dtype=torch.int16).reshape(2, n).t(),
    "requires grad": lambda n: torch.ones(n, requires_grad=True),
    "bool": lambda n: torch.ones(n, dtype=torch.bool),
    "float8": lambda n: torch.ones(n).to(torch.float8_e4m3fn),
    "empty": lambda n: torch.ones(0, n),
}


def _build(kind: str, n: int) -> torch.Tensor:
    """An ``UNUSUAL`` tensor; torch's warnings on building them (the strided nested layout is a
    prototype, quantized dtypes are deprecated) are not under test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return UNUSUAL[kind](n)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """What a checkpoint of ``tensor`` must hold: its values, materialised, same dtype and shape."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh ``[nbytes]`` uint8 copy of a plain tensor's bytes (any strides it had)."""
    fresh = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())
    return fresh.reshape(-1).view(torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _bytes(a).equal(_bytes(b))


def _full_cache() -> tuple[HostPrefixCache, PrefixKey]:
    """One block holding one checkpoint: any new reservation would have to evict it."""
    cache = HostPrefixCache(
        BLOCK, max_entries=4, page_size=PAGE, block_bytes=BLOCK, pin_memory=False
    )
    key = PrefixKey(NS, list(range(2 * PAGE)), page_size=PAGE)
    assert cache.publish(key, {"kv": torch.full((BLOCK,), 7, dtype=torch.uint8)})
    return cache, key


UNUSUAL_KINDS = st.sampled_from(sorted(UNUSUAL))
SMALL_N = st.integers(min_value=1, max_value=16)


@settings(deadline=None, max_examples=80)
@given(kind=UNUSUAL_KINDS, n=SMALL_N)
def test_publish_copies_an_unusual_tensor_faithfully_or_refuses_before_evicting(
    kind: str, n: int
) -> None:
    """Nested and quantized tensors (a quantized one crashed the process) and conjugate views
    (refused only after the reservation had evicted a checkpoint): publish refuses with the
    package's error before it reserves, or stores the tensor's materialised values."""
    tensor = _build(kind, n)
    cache, kept = _full_cache()
    before = _stats_and_order(cache)
    key = PrefixKey(NS, list(range(500, 500 + PAGE)), page_size=PAGE)
    refused = refusal(lambda: cache.publish(key, {"t": tensor}), {}, HostCacheError)
    if refused is not None:
        assert _stats_and_order(cache) == before, f"{kind}: {refused}"
        assert cache.match(kept) is not None
        return
    lease = cache.acquire(key)
    assert lease is not None
    out = torch.empty_like(_plain(tensor))
    cache.restore(lease, {"t": out}).synchronize()
    lease.release()
    assert _same_bytes(out, _plain(tensor)), kind


@settings(deadline=None, max_examples=60)
@given(kind=UNUSUAL_KINDS, n=SMALL_N)
def test_a_ticket_write_of_an_unusual_tensor_copies_nothing_when_refused(kind: str, n: int) -> None:
    """A refused write leaves its ticket reserved with nothing written: the right tensor still
    goes in afterwards and the checkpoint holds exactly it."""
    tensor = _build(kind, n)
    cache = HostPrefixCache(
        4 * BLOCK, max_entries=4, page_size=PAGE, block_bytes=BLOCK, pin_memory=False
    )
    key = PrefixKey(NS, list(range(PAGE)), page_size=PAGE)
    good = torch.arange(64, dtype=torch.uint8)
    ticket = cache.reserve(key, [SegmentSpec("t", 64)])
    assert ticket is not None
    refused = refusal(lambda: ticket.write({"t": tensor}), {}, HostCacheError)
    if refused is None:
        return  # a tensor of exactly 64 bytes may be written
    ticket.write({"t": good})
    ticket.commit()
    lease = cache.acquire(key)
    assert lease is not None
    out = torch.empty(64, dtype=torch.uint8)
    cache.restore(lease, {"t": out}).synchronize()
    lease.release()
    assert out.equal(good), f"{kind}: {refused}"


@settings(deadline=None, max_examples=80)
@given(kind=UNUSUAL_KINDS, n=SMALL_N)
def test_restore_into_an_unusual_target_refuses_or_writes_the_published_values(
    kind: str, n: int
) -> None:
    """A target is written through as it is: views whose bytes are not their values, and
    layouts with no plain bytes, are refused before any copy."""
    target = _build(kind, n)
    cache = HostPrefixCache(
        4 * BLOCK, max_entries=4, page_size=PAGE, block_bytes=BLOCK, pin_memory=False
    )
    key = PrefixKey(NS, list(range(PAGE)), page_size=PAGE)
    try:
        source = torch.randn(_plain(target).shape).to(_plain(target).dtype)
    except RuntimeError:  # nested or quantized: no plain form; publish a byte stand-in
        source = torch.arange(8, dtype=torch.uint8)
    assert cache.publish(key, {"t": source})
    lease = cache.acquire(key)
    assert lease is not None
    with lease:
        refused = refusal(lambda: cache.restore(lease, {"t": target}), {}, HostCacheError)
    if refused is None:
        assert _same_bytes(target, source), kind
    assert cache.stats().restores == (0 if refused is not None else 1)
