"""Torch definition of the distributed top-k candidate merge (the ``qsa_core.merge_topk`` order)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from qsa_kernels._errors import KernelInputError

__all__ = ("MergedTopK", "merge_candidates_reference")


class MergedTopK(NamedTuple):
    """Global top-k per row, best first.

    Attributes:
        scores: ``[rows, k]`` fp32, ``-0.0`` canonicalised to ``+0.0``; ``-inf`` in padding.
        ids: ``[rows, k]`` int32 global ids; ``-1`` in padding.
    """

    scores: torch.Tensor
    ids: torch.Tensor


def check_merge_inputs(
    scores: torch.Tensor, ids: torch.Tensor, topk: int, *, check_nan: bool
) -> None:
    """Raise :class:`KernelInputError` unless the candidates match the merge contract."""
    if scores.dim() != 3 or scores.dtype != torch.float32:
        msg = f"scores must be [ranks, rows, k] fp32, got {tuple(scores.shape)!r} {scores.dtype!r}"
        raise KernelInputError(msg)
    if ids.shape != scores.shape or ids.dtype != torch.int32 or ids.device != scores.device:
        msg = (
            f"ids must be int32 {tuple(scores.shape)!r} on {scores.device!s}, got "
            f"{tuple(ids.shape)!r} {ids.dtype!r} on {ids.device!s}"
        )
        raise KernelInputError(msg)
    total = scores.shape[0] * scores.shape[2]
    if not 1 <= topk <= total:
        msg = f"topk must be in [1, ranks * k = {total!r}], got {topk!r}"
        raise KernelInputError(msg)
    if check_nan:
        bad = torch.isnan(scores) & (ids >= 0)
        if bool(bad.any()):
            rank, row, pos = (int(v) for v in bad.nonzero()[0])
            msg = (
                f"NaN score at rank {rank!r} row {row!r} position {pos!r} (global id "
                f"{int(ids[rank, row, pos])!r}); NaN scores cannot be ordered"
            )
            raise KernelInputError(msg)


def merge_candidates_reference(
    scores: torch.Tensor, ids: torch.Tensor, *, topk: int | None = None
) -> MergedTopK:
    """Merge per-rank ``(score, global id)`` candidates into the global top-k.

    Order: score descending, ties to the smaller global id, ``-0.0 == +0.0``. Candidates with a
    negative id are padding and ignored. Ownership is assumed disjoint: an id present twice is
    kept twice (not deduplicated).

    Args:
        scores: ``[ranks, rows, k]`` fp32 candidate scores (all-gathered local top-k).
        ids: ``[ranks, rows, k]`` int32 global ids, ``-1`` for padding.
        topk: how many to keep, ``1 <= topk <= ranks * k``; default ``k``.

    Returns:
        :class:`MergedTopK` of ``[rows, topk]``, best first, padded with ``(-inf, -1)`` when a row
        has fewer valid candidates.

    Raises:
        KernelInputError: bad shapes or dtypes, ``topk`` out of range, or a NaN score on a valid
            candidate.
    """
    k_out = scores.shape[2] if topk is None else topk
    check_merge_inputs(scores, ids, k_out, check_nan=True)
    rows = scores.shape[1]
    out_s = torch.full((rows, k_out), -math.inf, dtype=torch.float32, device=scores.device)
    out_i = torch.full((rows, k_out), -1, dtype=torch.int32, device=scores.device)
    for r in range(rows):
        s = scores[:, r, :].reshape(-1)
        i = ids[:, r, :].reshape(-1).to(torch.int64)
        keep = i >= 0
        s = s[keep] + 0.0
        i = i[keep]
        order = sorted(range(s.numel()), key=lambda c: (-float(s[c]), int(i[c])))[:k_out]
        out_s[r, : len(order)] = s[order]
        out_i[r, : len(order)] = i[order].to(torch.int32)
    return MergedTopK(out_s, out_i)
