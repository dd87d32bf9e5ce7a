"""Exact distributed top-k order: merge of per-rank lists equals the single-rank top-k."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_core import MergeError, TopKCandidate, candidate_sort_key, merge_topk, topk_reference


def test_ties_go_to_the_smallest_id() -> None:
    """Equal scores are ordered by ascending global id."""
    merged = merge_topk([[(1.0, 9), (2.0, 4)], [(1.0, 3), (1.0, 5)]], 3)
    assert merged == [TopKCandidate(2.0, 4), TopKCandidate(1.0, 3), TopKCandidate(1.0, 5)]


def test_negative_zero_equals_positive_zero() -> None:
    """-0.0 and +0.0 tie (order by id) and come back as +0.0."""
    merged = merge_topk([[(-0.0, 1)], [(0.0, 2)], [(-0.0, 0)]], 3)
    assert [c.global_id for c in merged] == [0, 1, 2]
    assert all(math.copysign(1.0, c.score) == 1.0 for c in merged)


def test_infinities_are_ordered_values() -> None:
    """+inf first, -inf last."""
    merged = merge_topk([[(-math.inf, 0), (1.0, 1)], [(math.inf, 2)]], 3)
    assert [c.global_id for c in merged] == [2, 1, 0]


def test_nan_is_rejected_with_rank_and_position() -> None:
    """A NaN score names its rank, position and id."""
    with pytest.raises(MergeError, match="rank 1 candidate 0: score is NaN for global id 7"):
        merge_topk([[(1.0, 0)], [(math.nan, 7)]], 1)


def test_duplicate_ids_are_rejected() -> None:
    """An id offered by two ranks breaks disjoint ownership."""
    with pytest.raises(MergeError, match="global id 4 appears twice"):
        merge_topk([[(1.0, 4)], [(0.5, 4)]], 2)


def test_a_duplicate_id_with_another_score_between_its_copies_is_rejected() -> None:
    """The two copies of id 4 do not sort next to each other (0.7 lies between them)."""
    with pytest.raises(MergeError, match=r"global id 4 appears twice \(scores 1.0 and 0.5\)"):
        merge_topk([[(1.0, 4), (0.7, 5)], [(0.5, 4)]], 3)
    with pytest.raises(MergeError, match=r"global id 4 appears twice \(scores 1.0 and 0.5\)"):
        topk_reference([1.0, 0.7, 0.5], [4, 5, 4], k=1)


@pytest.mark.parametrize("k", [-1, True])
def test_bad_k_is_rejected(k: int) -> None:
    """Negative or boolean k is rejected."""
    with pytest.raises(MergeError, match="k="):
        merge_topk([[(1.0, 0)]], k)


def test_fewer_candidates_than_k_returns_all() -> None:
    """k larger than the candidate count returns every candidate, ordered."""
    assert merge_topk([[(0.1, 2)], []], 5) == [TopKCandidate(0.1, 2)]
    assert topk_reference([], k=3) == []


def test_reference_rejects_length_mismatch() -> None:
    """Scores and ids must pair up."""
    with pytest.raises(MergeError, match="scores has 2 entries but ids has 1"):
        topk_reference([1.0, 2.0], [0], 1)


# Few distinct values so ties (and signed zeros) are frequent.
_scores = st.sampled_from([-0.0, 0.0, 1.0, -1.0, 2.5, math.inf, -math.inf, 1e-30])


@settings(max_examples=400, deadline=None)
@given(
    scores=st.lists(_scores, min_size=0, max_size=60),
    world=st.integers(1, 8),
    k=st.integers(0, 70),
    page=st.integers(1, 5),
    data=st.data(),
)
def test_merge_of_local_topk_equals_global_topk(
    scores: list[float], world: int, k: int, page: int, data: st.DataObject
) -> None:
    """Each rank's local top-k over its page-interleaved blocks merges to the global top-k."""
    ids = data.draw(st.permutations(range(3 * len(scores) + 1)))[: len(scores)]
    per_rank: list[list[tuple[float, int]]] = [[] for _ in range(world)]
    for s, i in zip(scores, ids, strict=True):
        per_rank[(i // page) % world].append((s, i))
    local = [topk_reference([s for s, _ in r], [i for _, i in r], k) for r in per_rank]
    assert merge_topk(local, k) == topk_reference(scores, ids, k)


@settings(max_examples=300, deadline=None)
@given(
    a=st.floats(width=32, allow_nan=False),
    b=st.floats(width=32, allow_nan=False),
    ia=st.integers(0, 2**32 - 1),
    ib=st.integers(0, 2**32 - 1),
)
def test_sort_key_order_is_the_merge_order(a: float, b: float, ia: int, ib: int) -> None:
    """For fp32 scores the packed int64 key orders candidates exactly as the merge does."""
    if ia == ib:
        ib = (ib + 1) % 2**32
    ka, kb = candidate_sort_key(a, ia), candidate_sort_key(b, ib)
    assert -(2**63) <= ka < 2**63
    first = merge_topk([[(a, ia), (b, ib)]], 1)[0].global_id
    assert first == (ia if ka > kb else ib)


def test_sort_key_matches_the_bit_formula() -> None:
    """The key of 1.0 with id 5 is the documented packing."""
    (bits,) = struct.unpack("<I", struct.pack("<f", 1.0))
    assert candidate_sort_key(1.0, 5) == ((bits | 0x80000000) - 2**31 << 32) + 0xFFFFFFFF - 5
    assert candidate_sort_key(-0.0, 5) == candidate_sort_key(0.0, 5)
