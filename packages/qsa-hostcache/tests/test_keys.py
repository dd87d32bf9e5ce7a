"""Chained page keys: determinism, isolation, and the accepted token forms."""

from __future__ import annotations

import array
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

from qsa_hostcache import (
    HASH_SEED,
    CacheNamespace,
    InvalidKeyError,
    PrefixKey,
    page_keys,
    token_bytes,
)

NS = CacheNamespace("qwen3.8-flash-next@rev1", "float8_e4m3fn", 2, 0, "cfg-digest")


def test_chain_follows_the_documented_formula() -> None:
    """h[i] = xxh3(page bytes, h[i-1]) from a seed over the namespace material and page size."""
    tokens = list(range(10))
    key = PrefixKey(NS, tokens, page_size=4)
    seed = xxhash.xxh3_64_intdigest(NS.material() + (4).to_bytes(8, "little"), HASH_SEED)
    h0 = xxhash.xxh3_64_intdigest(array.array("q", tokens[:4]).tobytes(), seed)
    h1 = xxhash.xxh3_64_intdigest(array.array("q", tokens[4:8]).tobytes(), h0)
    assert page_keys(key) == (h0, h1)


def test_page_keys_identical_across_processes() -> None:
    """A fresh interpreter (other hash seed) computes the same chain."""
    code = (
        "from qsa_hostcache import CacheNamespace, PrefixKey, page_keys;"
        "ns = CacheNamespace('qwen3.8-flash-next@rev1', 'float8_e4m3fn', 2, 0, 'cfg-digest');"
        "print(page_keys(PrefixKey(ns, list(range(300)), page_extras={2: b'img'})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},  # another hash seed; same imports
    ).stdout.strip()
    here = page_keys(PrefixKey(NS, list(range(300)), page_extras={2: b"img"}))
    assert out == str(here)


def test_each_page_key_depends_on_every_earlier_page() -> None:
    """Changing one token changes the key of its page and of every later page, not earlier ones."""
    base = list(range(64 * 5))
    changed = list(base)
    changed[64 * 2 + 7] += 1
    a, b = page_keys(PrefixKey(NS, base)), page_keys(PrefixKey(NS, changed))
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


@pytest.mark.parametrize(
    "other",
    [
        CacheNamespace("qwen3.8-flash-next@rev2", "float8_e4m3fn", 2, 0, "cfg-digest"),
        CacheNamespace("qwen3.8-flash-next@rev1", "bfloat16", 2, 0, "cfg-digest"),
        CacheNamespace("qwen3.8-flash-next@rev1", "float8_e4m3fn", 2, 1, "cfg-digest"),
        CacheNamespace("qwen3.8-flash-next@rev1", "float8_e4m3fn", 4, 0, "cfg-digest"),
        CacheNamespace("qwen3.8-flash-next@rev1", "float8_e4m3fn", 2, 0, "other"),
        CacheNamespace("qwen3.8-flash-next@rev1", "float8_e4m3fn", 2, 0, "cfg-digest", ""),
        CacheNamespace("qwen3.8-flash-next@rev1", "float8_e4m3fn", 2, 0, "cfg-digest", "lora"),
    ],
    ids=["model", "dtype", "rank", "tp", "config", "empty-salt", "salt"],
)
def test_every_namespace_field_separates_chains(other: CacheNamespace) -> None:
    """Same tokens in a namespace that differs in one field share no page key."""
    tokens = list(range(128))
    assert other.material() != NS.material()
    assert set(page_keys(PrefixKey(NS, tokens))).isdisjoint(page_keys(PrefixKey(other, tokens)))


def test_namespace_fields_cannot_bleed_into_each_other() -> None:
    """Length prefixes keep ('ab', 'c') and ('a', 'bc') apart."""
    a = CacheNamespace("ab", "c", 1, 0, "x")
    b = CacheNamespace("a", "bc", 1, 0, "x")
    assert a.material() != b.material()


def test_extra_identity_changes_the_page_key_and_empty_differs_from_none() -> None:
    """An image key on page 1 changes pages >= 1; b'' is an identity, distinct from none."""
    tokens = [5] * 192
    plain = page_keys(PrefixKey(NS, tokens))
    img = page_keys(PrefixKey(NS, tokens, page_extras={1: b"sha256:aa"}))
    other = page_keys(PrefixKey(NS, tokens, page_extras=[None, b"sha256:bb", None]))
    empty = page_keys(PrefixKey(NS, tokens, page_extras={1: b""}))
    assert plain[0] == img[0] == other[0] == empty[0]
    assert len({plain[1], img[1], other[1], empty[1]}) == 4


def test_token_forms_encode_identically() -> None:
    """Lists, arrays, NumPy arrays and tensors of any int dtype give the same int64 bytes."""
    ids = [0, 1, 151_000, 2**40, 7]
    want = array.array("q", ids).tobytes()
    assert token_bytes(ids) == want
    assert token_bytes(array.array("q", ids)) == want
    assert token_bytes(np.array(ids, dtype=np.int64)) == want
    assert token_bytes(torch.tensor(ids, dtype=torch.int64)) == want
    small = [0, 1, 151_000, 7]
    assert token_bytes(np.array(small, dtype=np.int32)) == array.array("q", small).tobytes()
    assert token_bytes(torch.tensor(small, dtype=torch.int32)) == array.array("q", small).tobytes()
    assert token_bytes(torch.tensor(ids)[::2]) == array.array("q", ids[::2]).tobytes()


@pytest.mark.parametrize(
    "bad",
    [b"\x00" * 8, "abc", torch.zeros(2, 2, dtype=torch.int64), torch.zeros(3), [1.5], [2**63]],
    ids=["bytes", "str", "2d", "float-tensor", "float", "overflow"],
)
def test_malformed_tokens_are_rejected(bad: object) -> None:
    """Anything but 1-D integer ids in the int64 range raises InvalidKeyError."""
    with pytest.raises(InvalidKeyError):
        token_bytes(bad)


def test_partial_page_is_kept_but_not_hashed() -> None:
    """130 tokens at page 64 are 2 pages; the tail is outside every page key."""
    key = PrefixKey(NS, list(range(130)))
    assert (key.num_tokens, key.num_pages) == (130, 2)
    assert page_keys(key) == page_keys(PrefixKey(NS, list(range(128))))


def test_prefix_shares_the_chain() -> None:
    """key.prefix(n) has the first n page keys of key and n pages of tokens."""
    key = PrefixKey(NS, list(range(64 * 6 + 3)), page_extras={5: b"x"})
    full = page_keys(key)
    short = key.prefix(3)
    assert short.num_tokens == 192
    assert page_keys(short) == full[:3]
    assert short.page_extras == {}
    with pytest.raises(InvalidKeyError, match=r"\[0, 6\]"):
        key.prefix(7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"page_extras": {3: b"x"}}, r"\[0, 2\)"),
        ({"page_extras": {-1: b"x"}}, r"\[0, 2\)"),
        ({"page_extras": {0: "text"}}, "must be bytes"),
        ({"page_extras": b"xx"}, "mapping or a sequence"),
        ({"page_size": 0}, "page_size"),
    ],
)
def test_malformed_key_arguments_are_rejected(kwargs: dict[str, object], match: str) -> None:
    """Extras outside the pages, non-bytes extras and a zero page size raise InvalidKeyError."""
    with pytest.raises(InvalidKeyError, match=match):
        PrefixKey(NS, list(range(100)), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("", "bf16", 1, 0, "c"), "model"),
        (("m", "", 1, 0, "c"), "dtype"),
        (("m", "bf16", 0, 0, "c"), "tp_size"),
        (("m", "bf16", 2, 2, "c"), r"\[0, 2\)"),
        (("m", "bf16", 2**33, 0, "c"), r"tp_size must lie in \[1, 2\*\*32\), got 8589934592"),
        (("m", "bf16", 2.0, 0, "c"), "tp_size must be an int, got 2.0"),
        (("m", "bf16", 2, True, "c"), "tp_rank must be an int, got True"),
    ],
)
def test_malformed_namespace_is_rejected(args: tuple[object, ...], match: str) -> None:
    """Empty identity strings, a zero TP size or an out-of-range rank raise InvalidKeyError."""
    with pytest.raises(InvalidKeyError, match=match):
        CacheNamespace(*args)  # type: ignore[arg-type]


def test_big_endian_and_explicit_order_buffers_encode_like_native_ones() -> None:
    """Any 1-D integer buffer is accepted, whatever its byte order (issue: '>i8' raised)."""
    ids = [0, 1, 151_000, 2**40, 7]
    want = array.array("q", ids).tobytes()
    assert token_bytes(np.array(ids, dtype=">i8")) == want
    assert token_bytes(np.array(ids, dtype="<i8")) == want
    small = [0, 1, 151_000, 7]
    assert token_bytes(np.array(small, dtype=">u4")) == array.array("q", small).tobytes()
    assert token_bytes(np.array(ids, dtype=">i8")[::2]) == array.array("q", ids[::2]).tobytes()


def test_uint64_ids_beyond_int64_are_refused_not_wrapped() -> None:
    """A uint64 id >= 2**63 used to become a negative int64 id silently."""
    fine = torch.tensor([0, 5, 2**40], dtype=torch.uint64)
    assert token_bytes(fine) == array.array("q", [0, 5, 2**40]).tobytes()
    wrapping = torch.tensor([3, 2**63 + 1], dtype=torch.uint64)
    with pytest.raises(InvalidKeyError, match=r"token id 9223372036854775809 at index 1"):
        token_bytes(wrapping)
    with pytest.raises(InvalidKeyError, match="int64 range"):
        token_bytes(np.array([2**63], dtype=np.uint64))


def test_a_key_shared_by_threads_keeps_the_chain_of_a_private_key() -> None:
    """Threads that extend one key's memoized chain at once each get the true chain."""
    import threading

    tokens = list(range(64 * 400))
    want = page_keys(PrefixKey(NS, tokens, page_size=64))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as often as the interpreter can
    try:
        for _ in range(20):
            shared = PrefixKey(NS, tokens, page_size=64)
            results: list[tuple[int, ...]] = []
            start = threading.Barrier(8)

            def match(
                pages: int,
                key: PrefixKey = shared,
                start: threading.Barrier = start,
                results: list[tuple[int, ...]] = results,
            ) -> None:
                start.wait()
                results.append(tuple(key.page_hashes(num_pages=pages)[:pages]))

            threads = [threading.Thread(target=match, args=(50 * (i + 1),)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for got in results:
                assert got == want[: len(got)]
            assert page_keys(shared) == want
    finally:
        sys.setswitchinterval(switch)


@pytest.mark.parametrize("field", ["model", "dtype", "config_digest", "salt"])
@pytest.mark.parametrize("value", ["\ud800", 7, b"m"], ids=["lone-surrogate", "int", "bytes"])
def test_a_namespace_field_that_cannot_be_encoded_is_refused_when_built(
    field: str, value: object
) -> None:
    """Refused at construction, naming the field: built, every later key of it would raise."""
    args = {"model": "m", "dtype": "bf16", "tp_size": 1, "tp_rank": 0, "config_digest": "c"}
    with pytest.raises(InvalidKeyError, match=rf"^{field} must be"):
        CacheNamespace(**{**args, field: value})  # type: ignore[arg-type]
