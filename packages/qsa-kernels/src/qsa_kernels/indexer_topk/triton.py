"""Triton kernels for QSA decode indexer scoring and exact block top-k.

The scoring kernel reads each row's complete compressed keys once through the page table (one
program per ``BLOCK_N`` blocks, a ``[BLOCK_N, 128] x [128, 16]`` tensor-core product against the 4
zero-padded query heads). :func:`indexer_scores` stores fp32 scores; :func:`indexer_topk` instead
stores the packed 64-bit order key of each block (:mod:`._select`), distinct integers whose top
``k`` is one exact set. Rows of at least ``_select.RADIX_MIN_WIDTH`` blocks select it with the
radix select (:mod:`._radix`), whose histogram pass runs inside the scoring kernel; narrower rows
with ``torch.topk`` and a small kernel that sorts the ids ascending.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qsa_kernels import _topk_radix as _radix
from qsa_kernels import _topk_select as _select
from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCKS_PER_PAGE, INDEX_HEAD_DIM
from qsa_kernels._topk_select import interpreting, pack_key, topk_from_keys
from qsa_kernels.indexer_topk._validate import check_indexer_inputs
from qsa_kernels.indexer_topk.reference import visible_blocks

__all__ = ("indexer_scores", "indexer_topk")

_BLOCK_N = 128
_SCORE_WARPS = 4


@triton.jit  # type: ignore[untyped-decorator]
def _indexer_score_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    q_ptr,  # [B, 4, 128] bf16 / fp8 e4m3
    k_ptr,  # [pages, 16, 128] bf16 / fp8 e4m3
    pt_ptr,  # [B, P] int32 / int64 page ids
    n_ptr,  # [B] int32 complete blocks per row
    out_ptr,  # [B, out_width] fp32 scores, or int64 packed keys when WRITE_KEYS
    ws_ptr,  # [B, ...] int32 zeroed radix workspace (_radix.new_workspace) when WRITE_HIST
    out_width,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_ptb,
    stride_ob,
    stride_w,
    topk,
    SCALE: tl.constexpr,  # constexpr: sqrt(128) folds into the division
    HEADS: tl.constexpr,  # constexpr: 4 index heads
    HEADS_PAD: tl.constexpr,  # constexpr: tl.dot needs >= 16 columns; padded heads are zero
    D: tl.constexpr,  # constexpr: index head dim 128
    PAGE: tl.constexpr,  # constexpr: 16 blocks per page
    BLOCK_N: tl.constexpr,  # constexpr: blocks per program
    DOT_FP32: tl.constexpr,  # constexpr: fp32 operands (exact for bf16/fp8) in the interpreter
    WRITE_KEYS: tl.constexpr,  # constexpr: store packed order keys instead of scores
    WRITE_HIST: tl.constexpr,  # constexpr: with WRITE_KEYS, also run pass 1 of the radix select
    HIST_SH: tl.constexpr,  # constexpr: radix digit shift
    HIST_NB: tl.constexpr,  # constexpr: radix histogram bins
    HIST_COPIES: tl.constexpr,  # constexpr: radix histogram copies per row
):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    n = tl.load(n_ptr + b)
    j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = j < n
    if tile * BLOCK_N < n:
        page = tl.load(pt_ptr + b * stride_ptb + j // PAGE, mask=m, other=0).to(tl.int64)
        rows = page * stride_kp + (j % PAGE).to(tl.int64) * stride_ks
        d = tl.arange(0, D)
        keys = tl.load(k_ptr + rows[:, None] + d[None, :], mask=m[:, None], other=0.0)
        h = tl.arange(0, HEADS_PAD)
        qv = tl.load(
            q_ptr + b * stride_qb + h[:, None] * stride_qh + d[None, :],
            mask=h[:, None] < HEADS,
            other=0.0,
        )
        if DOT_FP32:
            dots = tl.dot(keys.to(tl.float32), tl.trans(qv.to(tl.float32)), input_precision="ieee")
        else:
            dots = tl.dot(keys.to(tl.bfloat16), tl.trans(qv.to(tl.bfloat16)))
        total = tl.sum(tl.maximum(dots, 0.0), 1)
        score = tl.math.div_rn(total, SCALE)
    else:
        score = tl.zeros([BLOCK_N], dtype=tl.float32)
    if WRITE_KEYS:
        key = pack_key(score, j, m)
        tl.store(out_ptr + b * stride_ob + j, key, mask=j < out_width)
        if WRITE_HIST:  # pass 1 of the radix select counts the same keys (none past n)
            ws_row = ws_ptr + b * stride_w
            _radix.hist_add(ws_row, tile, key, m, HIST_SH, HIST_NB, HIST_COPIES)
            _radix.hist_done(ws_row, tl.num_programs(1), topk, HIST_NB, HIST_COPIES)
    else:
        tl.store(out_ptr + b * stride_ob + j, tl.where(m, score, float("-inf")), mask=j < out_width)


def _launch_scores(  # noqa: PLR0917
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    n_blocks: torch.Tensor,
    out: torch.Tensor,
    ws: torch.Tensor | None = None,
    topk: int = 0,
) -> None:
    batch, out_width = out.shape
    if batch == 0 or out_width == 0:
        return
    q = q.contiguous()
    if k_cache.stride(2) != 1:
        k_cache = k_cache.contiguous()
    grid = (batch, triton.cdiv(out_width, _BLOCK_N))
    _indexer_score_kernel[grid](
        q,
        k_cache,
        page_table,
        n_blocks,
        out,
        out if ws is None else ws,
        out_width,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        0 if ws is None else ws.stride(0),
        topk,
        SCALE=math.sqrt(INDEX_HEAD_DIM),
        HEADS=4,
        HEADS_PAD=16,
        D=INDEX_HEAD_DIM,
        PAGE=BLOCKS_PER_PAGE,
        BLOCK_N=_BLOCK_N,
        DOT_FP32=interpreting(),
        WRITE_KEYS=out.dtype == torch.int64,
        WRITE_HIST=ws is not None,
        HIST_SH=_radix.SHIFT,
        HIST_NB=_radix.BINS,
        HIST_COPIES=_radix.COPIES,
        num_warps=_SCORE_WARPS,
    )


def _check_out(
    out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device
) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != dev or out.stride(-1) != 1:
        msg = (
            f"out must be {shape!r} {dtype!r} on {dev!s} with unit last stride, got "
            f"{tuple(out.shape)!r} {out.dtype!r} on {out.device!s} strides {out.stride()!r}"
        )
        raise KernelInputError(msg)


def indexer_scores(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer block scores; same contract as :func:`indexer_scores_reference`.

    The per-head dot products are fp32 tensor-core accumulations, so a score may differ from the
    reference's by fp32 rounding (exactly equal when every dot product is exact in fp32).

    Args:
        q: ``[B, 4, 128]`` bf16 or float8_e4m3fn.
        k_cache: ``[pages, 16, 128]`` bf16 or float8_e4m3fn, unit stride on the last dim.
        page_table: ``[B, P]`` int32/int64 compressed page ids, unit stride on the last dim.
        seq_lens: ``[B]`` int32/int64 tokens (query position + 1).
        out: optional ``[B, P * 16]`` fp32 destination; every element is written.

    Returns:
        ``[B, P * 16]`` fp32 scores, ``-inf`` at blocks ``j >= min(seq_len // 4, P * 16)``.
    """
    check_indexer_inputs(q, k_cache, page_table, seq_lens)
    batch, pages = page_table.shape
    shape = (batch, pages * BLOCKS_PER_PAGE)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    _check_out(out, shape, torch.float32, q.device)
    n_blocks = visible_blocks(seq_lens, pages)
    _launch_scores(q, k_cache, page_table.contiguous(), n_blocks, out)
    return out


def indexer_topk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int = 512,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top ``topk`` complete blocks per decode row; contract of :func:`indexer_topk_reference`.

    Every visible block is scored (a row with ``n <= topk`` keeps all of them whatever the
    scores). The selection is exact over the kernel's scores: score descending, ties to the
    smaller block id, ``-0.0 == +0.0``. It equals the reference's set whenever the scores agree
    bit for bit (always when the per-head dot products are exact in fp32); otherwise the sets can
    differ only among blocks whose scores are within fp32 rounding of the ``k``-th score.

    Args:
        q: ``[B, 4, 128]`` bf16 or float8_e4m3fn.
        k_cache: ``[pages, 16, 128]`` bf16 or float8_e4m3fn.
        page_table: ``[B, P]`` int32/int64.
        seq_lens: ``[B]`` int32/int64 tokens (query position + 1).
        topk: blocks per row, ``>= 1`` (QSA: 512 or 2048).
        out: optional ``[B, topk]`` int32 destination; every element is written.

    Returns:
        ``[B, topk]`` int32 block ids, ascending, ``-1`` after the ``min(n, topk)`` valid ones.
    """
    check_indexer_inputs(q, k_cache, page_table, seq_lens)
    if topk < 1:
        msg = f"topk must be >= 1, got {topk!r}"
        raise KernelInputError(msg)
    batch = page_table.shape[0]
    if out is None:
        out = torch.empty((batch, topk), dtype=torch.int32, device=q.device)
    _check_out(out, (batch, topk), torch.int32, q.device)
    if _select.uses_radix(page_table.shape[1] * BLOCKS_PER_PAGE):
        ws = _radix.new_workspace(batch, q.device)
        _radix.select(_keys(q, k_cache, page_table, seq_lens, ws, topk), ws, topk, out)
    else:
        topk_from_keys(_keys(q, k_cache, page_table, seq_lens), topk, out)
    return out


def indexer_keys(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    radix: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Packed order keys of every block: the scoring half of :func:`indexer_topk`.

    Args:
        q: ``[B, 4, 128]`` bf16 or float8_e4m3fn.
        k_cache: ``[pages, 16, 128]`` bf16 or float8_e4m3fn.
        page_table: ``[B, P]`` int32/int64.
        seq_lens: ``[B]`` int32/int64 tokens (query position + 1).
        radix: optional ``(workspace, topk)``: a zeroed ``[B, ...]`` int32 workspace
            (:func:`._radix.new_workspace`) that the kernel also fills with pass 1 of the radix
            select for ``topk`` (the histogram of the keys and the threshold bin).

    Returns:
        ``[B, P * 16]`` int64: block ``j < n`` holds
        ``(ordered(score) << 32) | (0xFFFFFFFF - j)``, every other column ``INT64_MIN``.
    """
    check_indexer_inputs(q, k_cache, page_table, seq_lens)
    if radix is None:
        return _keys(q, k_cache, page_table, seq_lens)
    return _keys(q, k_cache, page_table, seq_lens, *radix)


def _keys(  # noqa: PLR0917
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    ws: torch.Tensor | None = None,
    topk: int = 0,
) -> torch.Tensor:
    batch, pages = page_table.shape
    width = pages * BLOCKS_PER_PAGE
    n_blocks = visible_blocks(seq_lens, pages)
    keys = torch.empty((batch, width), dtype=torch.int64, device=q.device)
    _launch_scores(q, k_cache, page_table.contiguous(), n_blocks, keys, ws, topk)
    return keys
