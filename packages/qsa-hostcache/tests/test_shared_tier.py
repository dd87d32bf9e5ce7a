"""The shared tiers: Mooncake Store (a real ``mooncake_master`` process on a free localhost port
and real store clients over TCP, never a stand-in) and the disk tier (a real directory).

Every tier keeps the same contract (the ``tier`` fixture runs each test on both): checkpoints
written by one client are read back bit for bit by another (another process included); keys
match exactly, per namespace; a corrupt or truncated object is counted and never used. Then each
tier's own failures: a master that goes away turns every call into a counted miss, never an
exception; a full directory evicts its least recently used objects.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from qsa_hostcache import (
    CacheConfigError,
    CacheNamespace,
    DiskAddress,
    DiskTier,
    HostPrefixCache,
    MooncakeAddress,
    MooncakeTier,
    ObjectTier,
    PrefixKey,
    PromptCheckpoints,
    SharedCheckpoints,
    parse_store_address,
)
from qsa_hostcache._shared import _FRAME, decode, encode, object_name
from qsa_hostcache._tiers import part_name
from qsa_pytest.mooncake import MooncakeMaster, free_port
from qsa_pytest.processes import hang_guard_s, wait_until

PAGE = 4
# Generous: the machine running the tests may be shared and slow; readiness is polled.
READY_LIMIT_S = hang_guard_s()


#: Tests of Mooncake's own failures, which start masters of their own.
needs_mooncake = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="Mooncake's tests need qsa-hostcache[mooncake]",
)


def _tier(address: str) -> MooncakeTier:
    tier = MooncakeTier(MooncakeAddress.parse(address), retry_after_s=60.0)
    assert tier.wait_connected(READY_LIMIT_S), f"no store client joined {address} in time"
    return tier


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    pytest.importorskip("mooncake.store", reason="Mooncake's tests need qsa-hostcache[mooncake]")
    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log")
    yield m
    m.kill()


@pytest.fixture(scope="module", params=["mooncake", "disk"])
def address(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where each tier's store is: a Mooncake master, or a directory."""
    if request.param == "disk":
        return f"file://{tmp_path_factory.mktemp('disk-tier')}?max_mb=64"
    master: MooncakeMaster = request.getfixturevalue("master")
    return master.address()


@pytest.fixture(scope="module")
def tier(address: str) -> Iterator[ObjectTier]:
    t = _tier(address) if address.startswith("mooncake") else DiskTier(DiskAddress.parse(address))
    yield t
    t.close()


def _ns(salt: str | None = None) -> CacheNamespace:
    return CacheNamespace(
        model="org/m@r", dtype="bfloat16", tp_size=1, tp_rank=0, config_digest="c", salt=salt
    )


def _segments(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "k.0": torch.randn(tokens, 2, 8, generator=g).to(torch.bfloat16),
        "v.0": torch.randn(tokens, 2, 8, generator=g).to(torch.bfloat16),
        "state.0": torch.randint(-128, 127, (3, 5), dtype=torch.int8, generator=g),
    }


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


def _read(tier: ObjectTier, key: str) -> bytes | None:
    """The object's bytes, to compare with what was put."""
    value = tier.get(key)
    return None if value is None else bytes(value)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name, tensor in a.items():
        assert (tensor.dtype, tensor.shape) == (b[name].dtype, b[name].shape), name
        assert torch.equal(tensor.view(torch.uint8), b[name].view(torch.uint8)), name


def test_a_checkpoint_reads_back_bit_exact_as_the_longest_prefix_of_a_longer_query(
    tier: ObjectTier,
) -> None:
    shared = SharedCheckpoints(tier, scope="round-trip")
    tokens = _tokens(6 * PAGE + 1, seed=1)
    key = PrefixKey(_ns(), tokens, page_size=PAGE)
    segments = _segments(4 * PAGE, seed=2)
    assert shared.write(key.prefix(4), segments)
    assert not shared.write(key.prefix(4), segments)  # already there: not written again

    hit = shared.lookup(key)

    assert hit is not None
    assert hit.num_tokens == 4 * PAGE
    _equal(hit.segments, segments)
    stats = shared.stats()
    assert (stats.lookups, stats.hits, stats.hit_tokens, stats.writes) == (1, 1, 4 * PAGE, 1)
    assert stats.bytes_read > 0
    assert stats.errors == 0


def test_a_checkpoint_read_back_holds_its_segments_in_the_buffer_the_tier_read(
    tier: ObjectTier,
) -> None:
    shared = SharedCheckpoints(tier, scope="in-place")
    key = PrefixKey(_ns(), _tokens(4 * PAGE, seed=11), page_size=PAGE)
    segments = _segments(4 * PAGE, seed=12)
    assert shared.write(key, segments)
    data = tier.get(object_name(key, shared.scope))
    assert data is not None

    found = decode(data, key)

    assert found is not None
    _equal(found.segments, segments)
    buffer = torch.frombuffer(data, dtype=torch.uint8)
    first, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for name, tensor in found.segments.items():  # views of the read bytes: nothing copied
        assert first <= tensor.data_ptr() < end, name


def test_an_object_whose_segments_sit_at_odd_offsets_still_reads_back_bit_exact() -> None:
    # Another writer's object: its header not padded, so the bf16 segments start at odd offsets.
    key = PrefixKey(_ns(), _tokens(4 * PAGE, seed=13), page_size=PAGE)
    segments = {"odd": torch.arange(3, dtype=torch.uint8), **_segments(4 * PAGE, seed=14)}
    padded = bytes(encode(key, segments))
    magic, header_len, body_len, _ = _FRAME.unpack_from(padded)
    header = padded[_FRAME.size : _FRAME.size + header_len].rstrip(b" ") + b" "
    body = padded[_FRAME.size + header_len :]
    digest = xxhash.xxh3_128(header + body).digest()
    odd = _FRAME.pack(magic, len(header), body_len, digest) + header + body
    assert (_FRAME.size + len(header) + 4 * PAGE * 8 + 3) % 2 == 1  # k.0 starts unaligned

    found = decode(odd, key)

    assert found is not None
    _equal(found.segments, segments)


def test_another_salt_or_one_changed_token_shares_nothing(tier: ObjectTier) -> None:
    shared = SharedCheckpoints(tier, scope="namespaces")
    tokens = _tokens(4 * PAGE, seed=3)
    shared.write(PrefixKey(_ns("a"), tokens, page_size=PAGE), _segments(4 * PAGE, seed=4))

    other_salt = PrefixKey(_ns("b"), tokens, page_size=PAGE)
    changed = PrefixKey(_ns("a"), [*tokens[:-1], tokens[-1] + 1], page_size=PAGE)
    other_scope = SharedCheckpoints(tier, scope="namespaces-2")

    assert shared.lookup(other_salt) is None
    assert shared.lookup(changed) is None
    assert other_scope.lookup(PrefixKey(_ns("a"), tokens, page_size=PAGE)) is None
    assert shared.lookup(PrefixKey(_ns("a"), tokens, page_size=PAGE)) is not None


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated"])
def test_a_damaged_object_is_counted_and_never_used(tier: ObjectTier, damage: str) -> None:
    shared = SharedCheckpoints(tier, scope=f"damaged-{damage}")
    key = PrefixKey(_ns(), _tokens(2 * PAGE, seed=5), page_size=PAGE)
    good = bytes(encode(key, _segments(2 * PAGE, seed=6)))
    bad = good[:-7] if damage == "truncated" else good[:-1] + bytes([good[-1] ^ 1])
    # The bad payload goes straight under the checkpoint's name, as a faulty writer would.
    assert tier.put(object_name(key, shared.scope), bad)

    assert shared.lookup(key) is None
    stats = shared.stats()
    assert (stats.corrupt, stats.hits) == (1, 0)


def test_a_second_process_with_an_empty_arena_restores_what_the_first_published(
    tier: ObjectTier, address: str, tmp_path: Path
) -> None:
    # Process one: publish in its arena; the checkpoint is written through to the store.
    tokens = _tokens(3 * PAGE + 2, seed=7)
    key = PrefixKey(_ns("s"), tokens, page_size=PAGE)
    segments = _segments(3 * PAGE, seed=8)
    prompts: PromptCheckpoints[None] = PromptCheckpoints(
        HostPrefixCache(1 << 20, page_size=PAGE, block_bytes=4096),
        shared=SharedCheckpoints(tier),
    )
    assert prompts.publish(key.prefix(3), lambda: segments) is not None
    assert prompts.flush_shared(READY_LIMIT_S), "write-through still running"
    torch.save({"tokens": tokens, "segments": segments}, tmp_path / "expected.pt")

    # Process two: another client, its arena empty, finds it in the store and restores it.
    reader = parse_store_address(address)
    if isinstance(reader, MooncakeAddress):  # a client lending no memory: the objects are A's
        reader = dataclasses.replace(reader, segment_mb=0)
    script = textwrap.dedent(
        f"""
        import json, sys, torch
        from qsa_hostcache import (CacheNamespace, HostPrefixCache, PromptCheckpoints,
            PrefixKey, SharedCheckpoints, open_tier, parse_store_address)
        want = torch.load({str(tmp_path / "expected.pt")!r})
        tier = open_tier(parse_store_address({str(reader)!r}))
        assert getattr(tier, "wait_connected", lambda s: True)({READY_LIMIT_S!r})
        prompts = PromptCheckpoints(HostPrefixCache(1 << 20, page_size={PAGE}, block_bytes=4096),
            shared=SharedCheckpoints(tier))
        ns = CacheNamespace(model="org/m@r", dtype="bfloat16", tp_size=1, tp_rank=0,
            config_digest="c", salt="s")
        key = PrefixKey(ns, want["tokens"], page_size={PAGE})
        found = prompts.lookup(key)
        lease = prompts.cache.acquire(key.prefix(found // {PAGE}))
        got = prompts.restore_new(lease, list(want["segments"]), "cpu")
        lease.release()
        same = all(torch.equal(got[n].view(torch.uint8), t.view(torch.uint8))
            for n, t in want["segments"].items())
        print(json.dumps({{"found": found, "tier": prompts.last_tier, "same": same}}))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=READY_LIMIT_S * 2,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"found": 3 * PAGE, "tier": tier.name, "same": True}


def test_the_arena_answers_first_and_the_store_only_for_longer_prefixes(
    tier: ObjectTier,
) -> None:
    shared = SharedCheckpoints(tier, scope="ram-first")
    prompts: PromptCheckpoints[None] = PromptCheckpoints(
        HostPrefixCache(1 << 20, page_size=PAGE, block_bytes=4096), shared=shared
    )
    prompts.shared = None  # the first publish stays in the arena only
    key = PrefixKey(_ns(), _tokens(5 * PAGE, seed=9), page_size=PAGE)
    prompts.publish(key.prefix(2), lambda: _segments(2 * PAGE, seed=10))
    shared.write(key.prefix(4), _segments(4 * PAGE, seed=11))
    prompts.shared = shared

    assert prompts.lookup(key.prefix(2)) == 2 * PAGE
    assert prompts.last_tier == "ram"
    assert shared.stats().lookups == 0  # the arena held all its whole pages
    assert prompts.lookup(key) == 4 * PAGE
    assert prompts.last_tier == tier.name
    assert prompts.lookup(key) == 4 * PAGE  # copied into the arena by the lookup before
    assert prompts.last_tier == "ram"


@needs_mooncake
def test_a_master_gone_mid_run_turns_every_call_into_a_counted_miss(tmp_path: Path) -> None:
    own = MooncakeMaster(tmp_path / "master.log")
    try:
        watched = _tier(own.address())
        # A tier that never looks at the master's port again: its calls reach the dead store.
        unwatched = MooncakeTier(MooncakeAddress.parse(own.address()), watch_s=3600.0)
        assert unwatched.wait_connected(READY_LIMIT_S)
        key = PrefixKey(_ns(), _tokens(2 * PAGE, seed=12), page_size=PAGE)
        assert SharedCheckpoints(watched, scope="killed").write(key, _segments(2 * PAGE, seed=13))
        own.kill()

        # The watched tier sees the port close and answers misses without calling the store.
        wait_until("the tier to see its master gone", lambda: not watched.master_answers)
        shared = SharedCheckpoints(watched, scope="killed")
        assert shared.lookup(key) is None
        assert not shared.write(key.prefix(1), _segments(PAGE, seed=14))
        assert (shared.stats().errors, shared.stats().unavailable) == (0, 2)

        # The unwatched one calls the store: its error is a miss, no exception, and the tier
        # then answers at once for its retry period.
        blind = SharedCheckpoints(unwatched, scope="killed")
        assert blind.lookup(key) is None
        assert blind.lookup(key) is None
        assert blind.stats().errors >= 1
        assert blind.stats().unavailable >= 1
        watched.close()
        unwatched.close()
    finally:
        own.kill()


@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("redis://127.0.0.1:1", "mooncake://HOST:PORT"),
        ("127.0.0.1:50051", "mooncake://HOST:PORT"),
        ("mooncake://127.0.0.1", "mooncake://HOST:PORT"),
        ("mooncake://:50051", "mooncake://HOST:PORT"),
        ("mooncake://h:50051/path", "mooncake://HOST:PORT"),
        ("mooncake://h:50051?segment_mb=-1", "mooncake://HOST:PORT"),
        ("mooncake://h:50051?segments=4", "mooncake://HOST:PORT"),
        ("file://relative/dir", "file:///ABSOLUTE/DIR"),
        ("file:///tmp/t?max_mb=0", "file:///ABSOLUTE/DIR"),
        ("file:///tmp/t?max_gb=4", "file:///ABSOLUTE/DIR"),
    ],
)
def test_a_bad_store_address_is_refused_naming_the_value_and_the_form(text: str, form: str) -> None:
    with pytest.raises(CacheConfigError, match=re.escape(form)) as info:
        parse_store_address(text)
    assert repr(text) in str(info.value)


def test_a_store_address_reads_back_as_the_address_it_prints(tmp_path: Path) -> None:
    for address in (
        MooncakeAddress("h", 50051, 0),
        DiskAddress(tmp_path / "with space", 4096),
    ):
        assert parse_store_address(str(address)) == address
    assert parse_store_address("file:///var/qsa") == DiskAddress(Path("/var/qsa"))


@needs_mooncake
def test_a_tier_started_before_its_master_misses_then_joins_once_the_master_answers(
    tmp_path: Path,
) -> None:
    port = free_port()
    tier = MooncakeTier(
        MooncakeAddress.parse(f"mooncake://127.0.0.1:{port}?segment_mb=64"), retry_after_s=0.2
    )
    shared = SharedCheckpoints(tier, scope="late-master")
    key = PrefixKey(_ns(), _tokens(2 * PAGE, seed=15), page_size=PAGE)
    try:
        assert shared.lookup(key) is None  # no master: a counted miss, at once
        assert not shared.write(key, _segments(2 * PAGE, seed=16))
        assert shared.stats().unavailable >= 2
        master = MooncakeMaster(tmp_path / "master.log", port=port)
        try:
            wait_until("the tier to join the master started after it", lambda: tier.connected)
            assert shared.write(key, _segments(2 * PAGE, seed=16))
            assert shared.lookup(key) is not None
        finally:
            master.kill()
    finally:
        tier.close()


def test_an_object_larger_than_the_clients_buffer_is_stored_in_parts_and_read_back_whole(
    master: MooncakeMaster,
) -> None:
    # 40 MiB: five parts of 8 MiB, more than the client's whole transfer buffer once was (16 MiB).
    tier = _tier(master.address(segment_mb=128))
    try:
        value = os.urandom(40 << 20)
        assert tier.put("big", value)
        assert _read(tier, "big") == value
        parts = tier.contains([part_name("big", index) for index in range(1, 6)])
        assert parts == [True, True, True, True, False]
        health = tier.health()
        assert (health.puts, health.gets, health.errors) == (1, 1, 0)
        assert (health.bytes_written, health.bytes_read) == (len(value), len(value))
    finally:
        tier.close()


def test_an_object_missing_a_part_is_a_counted_miss_and_the_tier_answers_on(
    master: MooncakeMaster,
) -> None:
    tier = MooncakeTier(
        MooncakeAddress.parse(master.address(segment_mb=32)),
        retry_after_s=60.0,
        local_buffer_mb=4,
        part_mb=1,
    )
    assert tier.wait_connected(READY_LIMIT_S)
    try:
        whole, damaged = os.urandom((5 << 20) + 3), os.urandom(3 << 20)
        assert tier.put("whole", whole)
        assert tier.put("damaged", damaged)
        # The store evicts one key at a time: the second part goes, as eviction would take it.
        assert tier._store.remove(part_name("damaged", 2)) == 0  # the store's own client

        assert tier.get("damaged") is None
        assert tier.health().errors == 1
        assert _read(tier, "whole") == whole  # not answered as down: the store itself is fine
        assert tier.health().unavailable == 0
    finally:
        tier.close()


@pytest.mark.parametrize(("part_mb", "buffer_mb"), [(0, 64), (33, 64), (16, 16)])
def test_a_part_that_two_do_not_fit_the_buffer_is_refused_naming_both(
    part_mb: int, buffer_mb: int
) -> None:
    with pytest.raises(
        CacheConfigError, match=rf"part_mb {part_mb} with local_buffer_mb {buffer_mb}"
    ):
        MooncakeTier(
            MooncakeAddress.parse("mooncake://127.0.0.1:1"),
            local_buffer_mb=buffer_mb,
            part_mb=part_mb,
        )


# ---- the disk tier's own ----------------------------------------------------------------------


def test_a_full_directory_evicts_its_least_recently_read_objects_first(tmp_path: Path) -> None:
    tier = DiskTier(DiskAddress(tmp_path, max_mb=1))
    size = 300 << 10  # four fit in 1 MiB, the fourth goes over 90% of it
    values = {name: os.urandom(size) for name in ("a", "b", "c")}
    for age, (name, value) in zip((30, 20, 10), values.items(), strict=True):
        assert tier.put(name, value)
        old = time.time() - age  # written in that order, whatever the file system's clock step
        os.utime(tier._path(name), (old, old))
    assert _read(tier, "a") == values["a"]  # read: now the most recently used

    assert tier.put("d", os.urandom(size))

    assert tier.contains(["a", "b", "c", "d"]) == [True, False, True, True]
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*/*.qsa"))
    assert on_disk <= (1 << 20) * 9 // 10


def test_a_key_is_written_once_and_a_restarted_tier_reads_it_back(tmp_path: Path) -> None:
    first = DiskTier(DiskAddress(tmp_path))
    assert first.put("k", b"one")
    assert not first.put("k", b"two")  # the object under a key never changes

    again = DiskTier(DiskAddress(tmp_path))  # a restarted process over the same directory

    assert _read(again, "k") == b"one"
    assert again.contains(["k", "absent"]) == [True, False]
    assert list(tmp_path.glob("*/.*")) == []  # no temporary file left behind


def test_a_directory_that_cannot_be_written_is_refused_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CacheConfigError, match=r"a-file/tier'? is not usable"):
        DiskTier(DiskAddress(blocker / "tier"))


def test_a_failing_disk_is_a_counted_miss_never_an_exception(tmp_path: Path) -> None:
    tier = DiskTier(DiskAddress(tmp_path), retry_after_s=60.0)
    assert tier.put("k", b"v")
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    tier._root = blocked  # every path below it now fails with NotADirectoryError

    assert not tier.put("other", b"v")
    assert tier.get("k") is None  # answered at once: the tier is down for its retry period
    health = tier.health()
    assert (health.errors, health.unavailable, health.puts) == (1, 1, 1)
