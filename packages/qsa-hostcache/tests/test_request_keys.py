"""A serving engine's requests as keys, and what a prompt checkpoint holds besides its K/V."""

from __future__ import annotations

import enum
import hashlib
import logging

import pytest
import torch

from qsa_hostcache import (
    INDEX_SEGMENT,
    CacheNamespace,
    HostPrefixCache,
    InvalidKeyError,
    PrefixKey,
    PromptCheckpoints,
    PromptCounts,
    PromptKeys,
    SegmentError,
    SegmentSpec,
    StateSegments,
    compressed_slots,
    config_digest,
    segment_buffer,
)

NS = CacheNamespace("m@1", "bfloat16", 1, 0, "cfg")
PAGE = 4


class Reason(enum.Enum):
    EMBEDS = "input-embeds"


class Request:
    """An engine's request: an id, and the extras (or reason) its prompt has."""

    def __init__(self, rid: str, extras: dict[int, bytes] | Reason) -> None:
        self.rid = rid
        self.extras = extras


def test_a_request_without_salt_lora_or_extra_key_keeps_the_engines_namespace() -> None:
    assert NS.for_request() is NS


def test_a_requests_salt_is_the_canonical_json_of_its_three_parts() -> None:
    """The salt's bytes are pinned: checkpoint keys published before must still match."""
    salted = NS.for_request(cache_salt="a", lora_id="b")
    assert salted.salt == '{"cache_salt":"a","extra_key":null,"lora":"b"}'
    assert (salted.model, salted.config_digest) == (NS.model, NS.config_digest)
    variants = {
        NS.for_request(cache_salt=""),
        NS.for_request(cache_salt="t"),
        NS.for_request(lora_id="t"),
        NS.for_request(extra_key="t"),
        NS,
    }
    assert len(variants) == 5  # an empty salt is not an absent one; each part its own


def test_page_extras_are_decided_once_per_request_and_cut_to_the_keyed_pages() -> None:
    calls: list[str] = []

    def extras(req: Request) -> dict[int, bytes] | Reason:
        calls.append(req.rid)
        return req.extras

    keys: PromptKeys[Request] = PromptKeys(PAGE, extras, request_id=lambda r: r.rid)
    req = Request("r1", {0: b"img", 3: b"later"})
    short = keys.key(req, list(range(6)), NS)  # 2 pages: page 3's extra is past them
    assert keys.bypass(req) is None
    assert calls == ["r1"]
    assert dict(short.page_extras) == {0: b"img"}
    assert short.page_hashes() == (
        PrefixKey(NS, list(range(6)), page_size=PAGE, page_extras={0: b"img"}).page_hashes()
    )
    assert short.page_hashes() != PrefixKey(NS, list(range(6)), page_size=PAGE).page_hashes()


def test_a_request_that_cannot_be_keyed_is_told_and_logged_once_and_has_no_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    told: list[tuple[str, enum.Enum]] = []
    keys: PromptKeys[Request] = PromptKeys(
        PAGE,
        lambda r: r.extras,
        request_id=lambda r: r.rid,
        on_bypass=lambda r, reason: told.append((r.rid, reason)),
    )
    req = Request("r2", Reason.EMBEDS)
    with caplog.at_level(logging.INFO, logger="qsa_hostcache"):
        assert keys.bypass(req) is Reason.EMBEDS
        assert keys.bypass(req) is Reason.EMBEDS
    assert told == [("r2", Reason.EMBEDS)]
    assert [r.getMessage() for r in caplog.records] == [
        "prefix cache: 'r2' is not reused (input-embeds)"
    ]
    with pytest.raises(InvalidKeyError, match=r"'r2' is not keyed \(input-embeds\)"):
        keys.key(req, list(range(8)), NS)


def test_compressed_rows_are_the_first_slot_of_each_group_divided_by_the_ratio() -> None:
    slots = torch.tensor([40, 41, 42, 43, 8, 9, 10, 11], dtype=torch.int32)
    rows = compressed_slots(slots, 4)
    assert rows.dtype == torch.int64
    assert rows.tolist() == [10, 2]


def test_a_recurrent_state_round_trips_through_its_segments_in_its_own_structure() -> None:
    conv, temporal = torch.randn(2, 3), torch.randn(4, 5).t()  # one of them not contiguous
    state = {"conv": [conv], "temporal": temporal, "extra": None}
    layout = StateSegments(state)
    segments = layout.segments(state)
    assert layout.names == ("state.0", "state.1")
    assert all(t.is_contiguous() for t in segments.values())
    back = layout.rebuild({name: t.clone() for name, t in segments.items()})
    assert back["extra"] is None
    assert torch.equal(back["conv"][0], conv)
    assert torch.equal(back["temporal"], temporal)


def test_segments_restore_into_new_tensors_shaped_as_published() -> None:
    cache = HostPrefixCache(
        16 * 1024, max_entries=4, page_size=PAGE, block_bytes=1024, pin_memory=False
    )
    checkpoints: PromptCheckpoints[None] = PromptCheckpoints(cache)
    key = PrefixKey(NS, list(range(8)), page_size=PAGE)
    index = torch.arange(2 * 2 * 3, dtype=torch.float16).reshape(2, 2, 3)
    assert checkpoints.publish(key, lambda: {INDEX_SEGMENT: index}) is not None
    lease = cache.acquire(key, max_tokens=8)
    assert lease is not None
    with lease:
        restored = checkpoints.restore_new(lease, [INDEX_SEGMENT], "cpu")
    assert restored[INDEX_SEGMENT].dtype == torch.float16
    assert torch.equal(restored[INDEX_SEGMENT], index)


def test_a_segment_published_without_shape_has_no_buffer() -> None:
    with pytest.raises(SegmentError, match="'index' was published without a shape"):
        segment_buffer(SegmentSpec(INDEX_SEGMENT, 8, dtype="torch.int8"), "cpu")
    with pytest.raises(SegmentError, match="which torch does not name"):
        segment_buffer(SegmentSpec("s", 8, dtype="torch.nonsense", shape=(8,)), "cpu")


def test_prompt_counts_describe_their_own_counters() -> None:
    series = PromptCounts.series()
    assert [s.name for s in series] == [
        "loads",
        "loaded_tokens",
        "load_back_failures",
        "publish_errors",
        "deferred",
    ]
    assert all(s.counter and s.help for s in series)


def test_a_config_digest_is_the_sha256_of_canonical_json_whatever_the_key_order() -> None:
    """The digest's bytes are pinned: a namespace built before must still match."""
    expected = hashlib.sha256(b'{"a":[1,2],"b":"torch.bfloat16"}').hexdigest()
    assert config_digest({"b": torch.bfloat16, "a": [1, 2]}) == expected
    assert config_digest({"a": [1, 2], "b": "torch.bfloat16"}) == expected
