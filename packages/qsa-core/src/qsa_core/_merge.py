"""The exact order of a distributed top-k: score descending, ties to the smallest global id.

Each rank of a shard group scores only the blocks it owns and keeps a local top-k under the same
order; :func:`merge_topk` combines those candidate lists into the global top-k. Because ownership
is disjoint and the order is total, the merge equals :func:`topk_reference` over all scores.

Order rule: ``a`` precedes ``b`` when ``a.score > b.score``, or the scores are equal and
``a.global_id < b.global_id``. ``-0.0`` equals ``+0.0`` (returned scores are canonicalised to
``+0.0``); ``±inf`` are ordinary values; NaN is rejected.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple, SupportsIndex

from qsa_core._checks import is_int
from qsa_core._errors import MergeError

__all__ = ("TopKCandidate", "candidate_sort_key", "merge_topk", "topk_reference")


class TopKCandidate(NamedTuple):
    """One candidate: a score (fp32 in kernels, a float here) and its global block id (>= 0)."""

    score: float
    global_id: int


def _checked(score: object, global_id: object, where: str) -> TopKCandidate:
    if not isinstance(score, (int, float)) or isinstance(score, bool):
        msg = f"{where}: score={score!r} is not a real number"
        raise MergeError(msg)
    value = float(score)
    if math.isnan(value):
        msg = f"{where}: score is NaN for global id {global_id!r}; NaN scores cannot be ordered"
        raise MergeError(msg)
    if not isinstance(global_id, SupportsIndex) or isinstance(global_id, bool):
        msg = f"{where}: global id {global_id!r} is not an integer"
        raise MergeError(msg)
    gid = operator.index(global_id)
    if gid < 0:
        msg = f"{where}: global id {gid!r} is negative; ids must be >= 0"
        raise MergeError(msg)
    # Adding +0.0 maps -0.0 to +0.0 and leaves every other value unchanged.
    return TopKCandidate(value + 0.0, gid)


def _check_k(k: int) -> None:
    if not is_int(k) or k < 0:
        msg = f"k={k!r} is not allowed; it must be an integer >= 0"
        raise MergeError(msg)


def _order(candidates: Iterable[TopKCandidate], k: int) -> list[TopKCandidate]:
    seen: dict[int, float] = {}
    for candidate in candidates:  # checked before sorting: a repeat may carry another score
        if candidate.global_id in seen:
            first = seen[candidate.global_id]
            msg = (
                f"global id {candidate.global_id!r} appears twice (scores {first!r} and "
                f"{candidate.score!r}); ownership must be disjoint"
            )
            raise MergeError(msg)
        seen[candidate.global_id] = candidate.score
    ranked = sorted(
        (TopKCandidate(score, gid) for gid, score in seen.items()),
        key=lambda c: (-c.score, c.global_id),
    )
    return ranked[:k]


def topk_reference(
    scores: Sequence[float], ids: Sequence[int] | None = None, k: int = 0
) -> list[TopKCandidate]:
    """Single-rank top-k under the merge order.

    Args:
        scores: ``[N]`` scores.
        ids: ``[N]`` distinct global ids (default: ``0..N-1``).
        k: how many to keep; fewer come back when ``N < k``.

    Returns:
        Up to ``k`` candidates, best first.

    Raises:
        MergeError: NaN score, negative or duplicate id, length mismatch, or ``k < 0``.
    """
    _check_k(k)
    id_seq: Sequence[int] = range(len(scores)) if ids is None else ids
    if len(id_seq) != len(scores):
        msg = f"scores has {len(scores)!r} entries but ids has {len(id_seq)!r}"
        raise MergeError(msg)
    return _order(
        (_checked(s, i, f"entry {n}") for n, (s, i) in enumerate(zip(scores, id_seq, strict=True))),
        k,
    )


def merge_topk(
    per_rank_candidates: Sequence[Iterable[TopKCandidate | tuple[float, int]]], k: int
) -> list[TopKCandidate]:
    """Merge per-rank candidate lists ``(score, global id)`` into the global top-k.

    Args:
        per_rank_candidates: ``[W][k_r]`` candidates per rank, in any order; padding is not
            allowed (drop it before merging).
        k: how many to keep.

    Returns:
        Up to ``k`` candidates, best first: score descending, ties to the smallest id.

    Raises:
        MergeError: NaN score (naming rank and position), negative or duplicate id, ``k < 0``.
    """
    _check_k(k)
    flat = [
        _checked(score, gid, f"rank {rank} candidate {position}")
        for rank, candidates in enumerate(per_rank_candidates)
        for position, (score, gid) in enumerate(candidates)
    ]
    return _order(flat, k)


def candidate_sort_key(score: float, global_id: int) -> int:
    """The signed 64-bit key whose descending order is the merge order, for fp32 scores.

    ``((ordered_bits(score) - 2**31) << 32) + (0xFFFFFFFF - global_id)``, where ``ordered_bits``
    maps the fp32 bit pattern to an unsigned integer that increases with the value (``-0.0`` is
    first canonicalised to ``+0.0``). This is the packing a GPU merge sorts; ``global_id`` must
    fit in 32 unsigned bits and ``score`` is rounded to fp32.

    Raises:
        MergeError: NaN score or an id outside ``[0, 2**32)``.
    """
    cand = _checked(score, global_id, "candidate")
    if cand.global_id > 0xFFFFFFFF:
        msg = f"global id {cand.global_id!r} does not fit in 32 bits"
        raise MergeError(msg)
    try:
        (bits,) = struct.unpack("<I", struct.pack("<f", cand.score))
    except OverflowError as exc:
        msg = f"score={score!r} is outside the fp32 range"
        raise MergeError(msg) from exc
    if bits == 0x80000000:  # -0.0 after fp32 rounding of a tiny negative value
        bits = 0
    ordered = bits ^ 0xFFFFFFFF if bits & 0x80000000 else bits | 0x80000000
    key: int = ((ordered - 2**31) << 32) + (0xFFFFFFFF - cand.global_id)
    return key
