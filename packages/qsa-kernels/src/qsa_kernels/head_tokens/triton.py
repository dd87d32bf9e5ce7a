"""Triton per-head token ops: one program per (row, KV head), one launch per layer.

:func:`head_blocks` keeps the first of each run of a head's block ids (a neighbour compare
through ``tl.gather``), compacted by a prefix sum, after sorting them in registers unless they
already ascend (double sparsity's lists do: a dense row's ramp, a sparse row's heavy tokens as
``label_topk`` orders them); :func:`head_tokens` maps
every position through the layer's block table. Each replaces about a dozen small torch
operations (the references), which dominate a captured decode step's time at batch 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._checks import list_tile
from qsa_kernels._geometry import BLOCK_TOKENS, RECORD_ROWS, TAIL_TOKENS
from qsa_kernels.head_tokens._validate import check_head_blocks_args, check_head_tokens_args

__all__ = ("head_blocks", "head_tokens")

_SENTINEL = tl.constexpr(2**31 - 1)


@triton.jit  # type: ignore[untyped-decorator]
def _head_blocks_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    pos_ptr,  # [B, Hkv, W] int32 positions, -1 padded
    closed_ptr,  # [B] int32 complete blocks per row
    out_ptr,  # [B, Hkv, K] int32 distinct block ids, ascending, -1 padded
    count_ptr,  # [B, Hkv] int32 distinct blocks before the cut to K
    HKV,
    W,
    K,
    BLOCK_W: tl.constexpr,  # next_pow2(W): one register tile holds a head's whole list
    TOKENS: tl.constexpr,  # tokens per block
):
    g = tl.program_id(0)  # b * Hkv + h
    b = g // HKV
    offs = tl.arange(0, BLOCK_W)
    pos = tl.load(pos_ptr + g.to(tl.int64) * W + offs, mask=offs < W, other=-1)
    closed = tl.load(closed_ptr + b) * TOKENS
    in_hot = (pos >= 0) & (pos < closed)
    ids = tl.where(in_hot, pos // TOKENS, _SENTINEL)
    before = tl.maximum(offs - 1, 0)
    previous = tl.gather(ids, before, 0)
    if tl.sum((ids < previous).to(tl.int32), axis=0) > 0:  # not ascending: sort first
        ids = tl.sort(ids)
        previous = tl.gather(ids, before, 0)
    keep = (ids != _SENTINEL) & ((offs == 0) | (ids != previous))
    rank = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    count = tl.sum(keep.to(tl.int32), axis=0)
    base = out_ptr + g.to(tl.int64) * K
    tl.store(base + rank, ids, mask=keep & (rank < K))
    tl.store(base + offs, tl.full((BLOCK_W,), -1, tl.int32), mask=(offs >= count) & (offs < K))
    tl.store(count_ptr + g, count)


@triton.jit  # type: ignore[untyped-decorator]
def _head_tokens_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    pos_ptr,  # [B, Hkv, W] int32 positions, -1 padded
    rows_ptr,  # [B] int32 request row per batch entry
    closed_ptr,  # [B] int32 complete blocks per row
    table_ptr,  # [Hkv, R, NB] int32 hot slot per resident block of the layer
    hot_ptr,  # [B, Hkv, W] int32 out: key row in the hot cache, -1 outside complete blocks
    tail_ptr,  # [B, Hkv, TAIL] int32 out: key row in the tail per open-block offset, -1 unchosen
    HKV,
    W,
    R,
    NB,
    S,
    BLOCK_W: tl.constexpr,
    TOKENS: tl.constexpr,  # tokens per block
    RECORD: tl.constexpr,  # rows of D per record: its keys, then its values
    TAIL: tl.constexpr,  # open-block tokens a head may choose
):
    g = tl.program_id(0)
    b = g // HKV
    h = g % HKV
    offs = tl.arange(0, BLOCK_W)
    wmask = offs < W
    pos = tl.load(pos_ptr + g.to(tl.int64) * W + offs, mask=wmask, other=-1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    closed = tl.load(closed_ptr + b) * TOKENS
    in_hot = (pos >= 0) & (pos < closed)
    block = tl.where(in_hot, pos // TOKENS, 0).to(tl.int64)
    slot = tl.load(table_ptr + (h * R + row) * NB + block, mask=in_hot, other=0).to(tl.int64)
    token = (row * S + slot) * RECORD + (pos % TOKENS).to(tl.int64)
    tl.store(hot_ptr + g.to(tl.int64) * W + offs, tl.where(in_hot, token, -1), mask=wmask)
    for o in tl.static_range(TAIL):
        chosen = tl.max((pos == closed + o).to(tl.int32), axis=0)
        tail = tl.where(chosen > 0, row * RECORD + o, -1)
        tl.store(tail_ptr + g * TAIL + o, tail)


def head_blocks(
    positions: torch.Tensor, closed_blocks: torch.Tensor, *, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct complete blocks that hold each KV head's chosen tokens (one launch).

    Same contract as :func:`qsa_kernels.head_tokens.head_blocks_reference`; no host
    synchronisation, CUDA-graph capturable.

    Args:
        positions: ``[B, Hkv, W]`` int32 logical token positions, ``-1`` padded anywhere.
        closed_blocks: ``[B]`` int32 complete blocks of each row.
        slots: a hot cache's slots ``S``: the lists are cut to ``K = min(W, S)``.

    Returns:
        ``(blocks [B, Hkv, K] int32, counts [B, Hkv] int32)``.

    Raises:
        KernelInputError: a bad shape, dtype, device or layout, or ``slots < 1``.
    """
    check_head_blocks_args(positions, closed_blocks, slots)
    batch, hkv, width = positions.shape
    keep = min(width, slots)
    blocks = torch.empty((batch, hkv, keep), dtype=torch.int32, device=positions.device)
    counts = torch.empty((batch, hkv), dtype=torch.int32, device=positions.device)
    if batch * hkv and width:
        tile, warps = list_tile(width)
        _head_blocks_kernel[(batch * hkv,)](
            positions, closed_blocks, blocks, counts, hkv, width, keep,
            BLOCK_W=tile, TOKENS=BLOCK_TOKENS, num_warps=warps,
        )  # fmt: skip
    else:
        counts.zero_()
    return blocks, counts


def head_tokens(
    positions: torch.Tensor,
    row_ids: torch.Tensor,
    closed_blocks: torch.Tensor,
    block_slot: torch.Tensor,
    *,
    slots: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chosen token's key row in one layer's hot cache and tail (one launch).

    Same contract, arguments and returns as
    :func:`qsa_kernels.head_tokens.head_tokens_reference` (``hot [B, Hkv, W]``, ``tail [B, Hkv,
    3]`` int32); no host synchronisation, CUDA-graph capturable.

    Raises:
        KernelInputError: a bad shape, dtype, device or layout, or ``slots < 1``.
    """
    check_head_tokens_args(positions, row_ids, closed_blocks, block_slot, slots)
    batch, hkv, width = positions.shape
    hot = torch.empty_like(positions)
    tail = torch.empty((batch, hkv, TAIL_TOKENS), dtype=torch.int32, device=positions.device)
    if batch * hkv:
        _, rows, blocks = block_slot.shape
        tile, warps = list_tile(width)
        _head_tokens_kernel[(batch * hkv,)](
            positions, row_ids, closed_blocks, block_slot, hot, tail, hkv, width, rows, blocks,
            slots, BLOCK_W=tile, TOKENS=BLOCK_TOKENS, RECORD=RECORD_ROWS,
            TAIL=TAIL_TOKENS,
            num_warps=warps,
        )  # fmt: skip
    return hot, tail
