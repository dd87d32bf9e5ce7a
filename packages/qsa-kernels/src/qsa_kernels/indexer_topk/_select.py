"""Exact row-wise top-k over fp32 scores by radix select, shared by the indexer and label scoring.

The order is score descending with ties to the smaller index, i.e. the largest ``k`` of the unique
keys ``(score, -index)``. The kernel maps each score to an order-preserving unsigned 32-bit key
(``-0.0`` canonicalised to ``+0.0``), finds the exact ``k``-th largest key with three histogram
passes of 11, 11 and 10 bits, then makes one pass in index order that keeps every key above the
threshold and the first ``need`` keys equal to it. Walking in index order is what makes ties go to
the smaller index, and it emits the selection in ascending index order.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_NUM_BINS = 2048


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The interpreter emulates bf16 ``tl.dot`` operands incorrectly, so kernels take fp32 operands
    there (exact for bf16 and fp8 values) and bf16 tensor-core operands on a GPU.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _ordered_key(x):  # type: ignore[no-untyped-def]
    """Float32 -> int64 in [0, 2**32), monotone in the float value; -0.0 maps like +0.0."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.int32, bitcast=True)
    return tl.where(u >= 0, u.to(tl.int64) + 2147483648, (~u).to(tl.int64))


@triton.jit  # type: ignore[untyped-decorator]
def _radix_pass(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    base,
    n,
    prefix,
    need,
    SHIFT: tl.constexpr,  # constexpr: the digit position is fixed per pass, so shifts fold
    DBITS: tl.constexpr,  # constexpr: digit width sets the histogram size
    NB: tl.constexpr,  # constexpr: histogram bins, 2**11 (masked keys land in bin NB)
    CHUNK: tl.constexpr,  # constexpr: scores loaded per loop step
):
    bins = tl.arange(0, 2 * NB)
    hist = tl.zeros([2 * NB], dtype=tl.int32)
    for start in range(0, n, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        m = offs < n
        key = _ordered_key(tl.load(base + offs, mask=m, other=0.0))
        match = m & ((key >> (SHIFT + DBITS)) == prefix)
        digit = tl.where(match, (key >> SHIFT) & ((1 << DBITS) - 1), NB).to(tl.int32)
        hist += tl.histogram(digit, 2 * NB)
    hist = tl.where(bins < NB, hist, 0)
    at_or_above = tl.cumsum(hist, 0, reverse=True)
    b = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    above = tl.sum(tl.where(bins == b, at_or_above - hist, 0), 0)
    return (prefix << DBITS) | b.to(tl.int64), need - above


@triton.jit  # type: ignore[untyped-decorator]
def _row_topk_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    scores_ptr,  # [rows, width] fp32
    lengths_ptr,  # [rows] int32: candidates of the row are columns [0, n)
    out_ptr,  # [rows, K] int32
    width,
    stride_s,
    stride_o,
    K: tl.constexpr,  # constexpr: k is a launch-time constant (512, 2048, heavy_token_num)
    NB: tl.constexpr,  # constexpr: histogram bins per radix pass
    CHUNK: tl.constexpr,  # constexpr: columns per loop step
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(lengths_ptr + row).to(tl.int32), width)
    n = tl.maximum(n, 0)
    base = scores_ptr + row * stride_s
    obase = out_ptr + row * stride_o
    if n <= K:
        for start in range(0, K, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            tl.store(obase + offs, tl.where(offs < n, offs, -1), mask=offs < K)
    else:
        prefix = tl.zeros([], dtype=tl.int64)
        need = tl.full([], K, dtype=tl.int32)
        prefix, need = _radix_pass(base, n, prefix, need, 21, 11, NB, CHUNK)
        prefix, need = _radix_pass(base, n, prefix, need, 10, 11, NB, CHUNK)
        prefix, need = _radix_pass(base, n, prefix, need, 0, 10, NB, CHUNK)
        taken = tl.zeros([], dtype=tl.int32)
        eq_seen = tl.zeros([], dtype=tl.int32)
        for start in range(0, n, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            m = offs < n
            key = _ordered_key(tl.load(base + offs, mask=m, other=0.0))
            gt = (m & (key > prefix)).to(tl.int32)
            eq = (m & (key == prefix)).to(tl.int32)
            eq_rank = eq_seen + tl.cumsum(eq, 0) - eq
            sel = gt | (eq & (eq_rank < need).to(tl.int32))
            pos = taken + tl.cumsum(sel, 0) - sel
            tl.store(obase + pos, offs, mask=sel != 0)
            taken += tl.sum(sel, 0)
            eq_seen += tl.sum(eq, 0)


def row_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Write the top ``k`` column indices of each row of ``scores`` into ``out``.

    Args:
        scores: ``[rows, width]`` fp32, unit stride along ``width``. NaN order is unspecified.
        lengths: ``[rows]`` int32 or int64, candidates per row (columns ``[0, n)``; clamped to
            ``[0, width]``).
        k: columns to keep per row, ``>= 1``.
        out: ``[rows, k]`` int32, unit stride along ``k``; receives the indices in ascending order,
            ``-1`` padded when ``n < k``. Every element is written.
    """
    rows = scores.shape[0]
    if rows == 0:
        return
    _row_topk_kernel[(rows,)](
        scores,
        lengths,
        out,
        scores.shape[1],
        scores.stride(0),
        out.stride(0),
        K=k,
        NB=_NUM_BINS,
        CHUNK=1024,
        num_warps=8,
    )


def row_topk_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Torch definition of :func:`row_topk`: ``[rows, k]`` int32, ascending, ``-1`` padded."""
    rows, width = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    for r in range(rows):
        n = max(0, min(int(lengths[r]), width))
        if n <= k:
            out[r, :n] = torch.arange(n, dtype=torch.int32, device=scores.device)
            continue
        s = scores[r, :n].float()
        s = torch.where(s == 0, torch.zeros_like(s), s)
        bits = s.view(torch.int32).to(torch.int64)
        ordered = torch.where(bits >= 0, bits + 2**31, (~bits) & 0xFFFFFFFF)
        idx = torch.arange(n, dtype=torch.int64, device=scores.device)
        key = ordered * 2**31 + (2**31 - 1 - idx)
        top = torch.topk(key, k).indices
        out[r] = torch.sort(top).values.to(torch.int32)
    return out
