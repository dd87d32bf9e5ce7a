"""Triton kernel for block-to-token expansion (one program per row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._errors import KernelInputError
from qsa_kernels.expand.reference import check_expand_inputs

__all__ = ("expand_blocks",)


@triton.jit  # type: ignore[untyped-decorator]
def _expand_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    blk_ptr,  # [M, BK] int32 / int64 block ids, negative = padding
    len_ptr,  # [M] int32 / int64 tokens visible to the query
    out_ptr,  # [M, WIDTH] int32 token positions
    bk,
    stride_b,
    stride_o,
    TOKEN_TOPK: tl.constexpr,  # constexpr: token budget is fixed per model
    WIDTH: tl.constexpr,  # constexpr: TOKEN_TOPK + RATIO - 1
    RATIO: tl.constexpr,  # constexpr: tokens per block (4)
    RATIO_P2: tl.constexpr,  # constexpr: RATIO rounded up to a power of two for tl.arange
    BLOCK_K: tl.constexpr,  # constexpr: bk rounded up to a power of two
    BLOCK_W: tl.constexpr,  # constexpr: padding columns written per step
):
    row = tl.program_id(0).to(tl.int64)
    length = tl.maximum(tl.load(len_ptr + row).to(tl.int64), 0)
    nb = length // RATIO
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(blk_ptr + row * stride_b + kk, mask=kk < bk, other=-1).to(tl.int64)
    valid = ((ids >= 0) & (ids < nb)).to(tl.int32)
    rank = (tl.cumsum(valid, 0) - valid).to(tl.int64)
    t = tl.arange(0, RATIO_P2).to(tl.int64)
    pos = rank[:, None] * RATIO + t[None, :]
    tok = ids[:, None] * RATIO + t[None, :]
    keep = (valid[:, None] != 0) & (t[None, :] < RATIO) & (pos < TOKEN_TOPK)
    obase = out_ptr + row * stride_o
    tl.store(obase + pos, tok.to(tl.int32), mask=keep)
    count = tl.minimum(tl.sum(valid, 0).to(tl.int64) * RATIO, TOKEN_TOPK)
    tail = length - nb * RATIO
    tl.store(obase + count + t, (nb * RATIO + t).to(tl.int32), mask=t < tail)
    total = count + tail
    for start in range(0, WIDTH, BLOCK_W):
        offs = start + tl.arange(0, BLOCK_W)
        tl.store(
            obase + offs, tl.full([BLOCK_W], -1, tl.int32), mask=(offs >= total) & (offs < WIDTH)
        )


def expand_blocks(
    block_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    ratio: int = 4,
    token_topk: int = 2048,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expand blocks to token positions plus the incomplete-group tail.

    Same contract as :func:`expand_blocks_reference`; ``out`` (optional, ``[M, token_topk + ratio
    - 1]`` int32, unit last stride) is fully written.

    Args:
        block_ids: ``[M, bk]`` int32/int64, negative entries are padding.
        seq_lens: ``[M]`` int32/int64 tokens (query position + 1).
        ratio: tokens per block.
        token_topk: token budget before the tail.
        out: optional destination.

    Returns:
        ``[M, token_topk + ratio - 1]`` int32, valid positions first, ``-1`` after.
    """
    check_expand_inputs(block_ids, seq_lens, ratio, token_topk)
    rows, bk = block_ids.shape
    width = token_topk + ratio - 1
    if out is None:
        out = torch.empty((rows, width), dtype=torch.int32, device=block_ids.device)
    if (
        tuple(out.shape) != (rows, width)
        or out.dtype != torch.int32
        or out.device != block_ids.device
        or out.stride(-1) != 1
    ):
        msg = (
            f"out must be {(rows, width)!r} int32 on {block_ids.device!s} with unit last stride, "
            f"got {tuple(out.shape)!r} {out.dtype!r} on {out.device!s}"
        )
        raise KernelInputError(msg)
    if rows == 0:
        return out
    block_ids = block_ids.contiguous()
    _expand_kernel[(rows,)](
        block_ids,
        seq_lens,
        out,
        bk,
        block_ids.stride(0),
        out.stride(0),
        TOKEN_TOPK=token_topk,
        WIDTH=width,
        RATIO=ratio,
        RATIO_P2=triton.next_power_of_2(ratio),
        BLOCK_K=max(16, triton.next_power_of_2(bk)),
        BLOCK_W=1024,
        num_warps=4,
    )
    return out
