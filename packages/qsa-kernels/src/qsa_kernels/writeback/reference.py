"""Torch references of the write-back copies (device hot cache / prompt K/V to the host arena)."""

from __future__ import annotations

import torch

from qsa_kernels._geometry import BLOCK_TOKENS
from qsa_kernels.writeback._common import check_blocks_args, check_prompt_args

__all__ = ("offload_prompt_reference", "writeback_blocks_reference")


def writeback_blocks_reference(
    hot: torch.Tensor,
    host_arena: torch.Tensor,
    *,
    rows: torch.Tensor,
    layers: torch.Tensor,
    slots: torch.Tensor,
    blocks: torch.Tensor,
) -> None:
    """Copy ``hot[layers[i], rows[i], slots[i]]`` to ``host_arena[rows[i], layers[i], blocks[i]]``.

    Synchronous reference of :func:`qsa_kernels.writeback.writeback_blocks` (same arguments, no
    stream); an entry whose block is ``-1`` is skipped.
    """
    check_blocks_args(hot, host_arena, rows=rows, layers=layers, slots=slots, blocks=blocks)
    for r, layer, s, b in zip(
        rows.tolist(), layers.tolist(), slots.tolist(), blocks.tolist(), strict=True
    ):
        if b >= 0:
            host_arena[r, layer, b].copy_(hot[layer, r, s])


def offload_prompt_reference(
    k: torch.Tensor, v: torch.Tensor, host_arena: torch.Tensor, row: int, *, first_block: int = 0
) -> int:
    """Pack a prompt's complete blocks into ``host_arena[row, :, first_block:]``; return the count.

    Synchronous reference of :func:`qsa_kernels.writeback.offload_prompt` (same arguments, no
    stream).
    """
    n = check_prompt_args(k, v, host_arena, row, first_block)
    L, _, Hkv, D = k.shape
    used = n * BLOCK_TOKENS
    kb = k[:, :used].reshape(L, n, 1, BLOCK_TOKENS, Hkv, D)
    vb = v[:, :used].reshape(L, n, 1, BLOCK_TOKENS, Hkv, D)
    host_arena[row, :, first_block : first_block + n].copy_(torch.cat((kb, vb), dim=2))
    return n
