"""Triton write-back: zero-copy stores from the device into the pinned host arena."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._checks import next_pow2
from qsa_kernels._uva import device_view
from qsa_kernels.writeback._common import check_blocks_args, check_prompt_args, run_on_side_stream

__all__ = ("offload_prompt", "writeback_blocks")


@triton.jit  # type: ignore[untyped-decorator]
def _writeback_blocks_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    hot_ptr,  # [L, R, S, W] int32 words of the hot cache
    host_ptr,  # [R, L, NB, W] int32 words of the host arena (pinned, device-mapped)
    rows_ptr,  # [N] int32
    layers_ptr,  # [N] int32
    slots_ptr,  # [N] int32 local hot slot
    blocks_ptr,  # [N] int32 host block id, -1 to skip the entry
    L,
    R,
    S,
    NB,
    W: tl.constexpr,  # 32-bit words per record; constexpr so the copy is one unrolled tile
    BLOCK_W: tl.constexpr,  # next_pow2(W)
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    layer = tl.load(layers_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    blk = tl.load(blocks_ptr + i).to(tl.int64)
    offs = tl.arange(0, BLOCK_W)
    mask = (offs < W) & (blk >= 0)
    words = tl.load(hot_ptr + ((layer * R + row) * S + slot) * W + offs, mask=mask)
    tl.store(host_ptr + ((row * L + layer) * NB + blk) * W + offs, words, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _offload_prompt_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    k_ptr,  # [L, T, HALF / 4 per token] int32 words of the prompt's K
    v_ptr,  # [L, T, ...] int32 words of the prompt's V
    host_ptr,  # [R, L, NB, 2 * HALF] int32 words of the host arena (pinned, device-mapped)
    row,
    first_block,
    T_WORDS,  # int32 words of one layer of k (T * Hkv * D * itemsize / 4)
    L,
    NB,
    HALF: tl.constexpr,  # int32 words of one block's K (or V) rows; constexpr for one tile
    BLOCK_H: tl.constexpr,  # next_pow2(HALF)
):
    # Blocks on grid axis 0 (up to 2**31 - 1 programs; axis 1 stops at 65,535, 262,144 tokens).
    blk = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HALF
    src = layer * T_WORDS + blk * HALF + offs
    dst = ((row * L + layer) * NB + first_block + blk) * (2 * HALF) + offs
    tl.store(host_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(host_ptr + dst + HALF, tl.load(v_ptr + src, mask=mask), mask=mask)


def writeback_blocks(
    hot: torch.Tensor,
    host_arena: torch.Tensor,
    *,
    rows: torch.Tensor,
    layers: torch.Tensor,
    slots: torch.Tensor,
    blocks: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event | None:
    """Copy newly closed blocks from hot-cache slots to their place in the host arena.

    Entry ``i`` copies the record ``hot[layers[i], rows[i], slots[i]]`` to
    ``host_arena[rows[i], layers[i], blocks[i]]``, bit for bit, with the GPU storing straight into
    pinned memory; an entry whose block is ``-1`` is skipped, so a CUDA graph can launch a fixed
    number of entries and mask those without a closed block. Nothing else in the arena is written.
    The copy runs on ``stream`` (a fresh side stream if ``None``) after all work already queued on
    the current stream; given the current stream, it is queued in order and no event is returned.

    Args:
        hot: ``[L, R, S, 2, 4, Hkv, D]`` hot cache (FP8 E4M3 or bf16).
        host_arena: ``[R, L, NB, 2, 4, Hkv, D]`` pinned host arena, same dtype.
        rows: ``[N]`` int32 request rows.
        layers: ``[N]`` int32 layers.
        slots: ``[N]`` int32 local hot slots in ``[0, S)``.
        blocks: ``[N]`` int32 destination block ids in ``[0, NB)``, distinct per (row, layer), or
            ``-1`` to skip the entry.
        stream: CUDA stream to copy on; a fresh side stream if ``None``.

    Returns:
        A CUDA event recorded after the copy on the side stream (wait on it before reading the
        arena or refetching those blocks); ``None`` on the CPU, where the copy is already done,
        and on the current stream, which orders everything after it.

    Raises:
        KernelInputError: On a bad shape, dtype, device or layout.
    """
    check_blocks_args(hot, host_arena, rows=rows, layers=layers, slots=slots, blocks=blocks)
    L, R, S = hot.shape[:3]
    NB = host_arena.shape[2]
    words = hot[0, 0, 0].numel() * hot.element_size() // 4
    n = rows.shape[0]
    host_words = device_view(host_arena, hot.device).view(torch.int32)

    def launch() -> None:
        if n == 0:
            return
        _writeback_blocks_kernel[(n,)](
            hot.view(torch.int32),
            host_words,
            rows,
            layers,
            slots,
            blocks,
            L,
            R,
            S,
            NB,
            W=words,
            BLOCK_W=next_pow2(words),
            num_warps=4,
        )

    return run_on_side_stream(hot.device, stream, launch, (hot, rows, layers, slots, blocks))


def offload_prompt(
    k: torch.Tensor,
    v: torch.Tensor,
    host_arena: torch.Tensor,
    row: int,
    *,
    first_block: int = 0,
    stream: torch.cuda.Stream | None = None,
) -> tuple[int, torch.cuda.Event | None]:
    """Copy a prompt's K/V, all layers, from the device to its request row of the host arena.

    Block ``b`` (tokens ``4b .. 4b+3``) of layer ``l`` becomes the record
    ``host_arena[row, l, first_block + b]`` = (its 4 K rows, its 4 V rows). Only complete blocks
    are written: the last ``T % 4`` tokens (the open block) are left to the caller, and no other
    record of the arena is touched. Runs on ``stream`` (a fresh side stream if ``None``) after the
    work already queued on the current stream.

    Args:
        k: ``[L, T, Hkv, D]`` prompt keys of every QSA layer, FP8 E4M3 or bf16, contiguous.
        v: ``[L, T, Hkv, D]`` prompt values, same dtype and shape.
        host_arena: ``[R, L, NB, 2, 4, Hkv, D]`` pinned host arena, same dtype.
        row: Request row in ``[0, R)``.
        first_block: Arena block of the prompt's first token (0 for a fresh request).
        stream: CUDA stream to copy on; a fresh side stream if ``None``.

    Returns:
        ``(blocks written, completion event)``; the event is ``None`` on the CPU.

    Raises:
        KernelInputError: On a bad shape, dtype or layout, or if the blocks do not fit ``NB``.
    """
    n = check_prompt_args(k, v, host_arena, row, first_block)
    L, T = k.shape[:2]
    half = host_arena[0, 0, 0, 0].numel() * host_arena.element_size() // 4
    t_words = k[0].numel() * k.element_size() // 4
    host_words = device_view(host_arena, k.device).view(torch.int32)

    def launch() -> None:
        if n == 0:
            return
        _offload_prompt_kernel[(n, L)](
            k.view(torch.int32) if T else k,
            v.view(torch.int32) if T else v,
            host_words,
            row,
            first_block,
            t_words,
            L,
            host_arena.shape[2],
            HALF=half,
            BLOCK_H=next_pow2(half),
            num_warps=4,
        )

    return n, run_on_side_stream(k.device, stream, launch, (k, v))
