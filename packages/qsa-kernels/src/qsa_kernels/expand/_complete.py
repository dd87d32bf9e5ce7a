"""The complete blocks of a QSA indexer selection, from block ids or expanded token positions."""

from __future__ import annotations

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS, TAIL_TOKENS

__all__ = ("complete_blocks",)


def complete_blocks(indices: torch.Tensor, closed: torch.Tensor, block_topk: int) -> torch.Tensor:
    """``[B, block_topk]`` int32 selected complete blocks (``-1`` padded) of the QSA indexer.

    Args:
        indices: ``[B, block_topk]`` block ids, or the same blocks expanded to token positions
            followed by the open block's (``[B, 4 block_topk + 3]``, what SGLang's QSA indexer
            returns in prefill and where it does not defer the expansion); ``-1`` padded.
        closed: ``[B]`` complete blocks each row may attend (its length // 4); an entry at or
            beyond it is not a complete block.
        block_topk: the indexer's block selection width.

    Raises:
        KernelInputError: ``indices`` has neither shape.
    """
    limit = closed.to(torch.int32).unsqueeze(1)
    width = indices.shape[1] if indices.dim() == 2 else -1
    if width == block_topk:
        blocks = indices.to(torch.int32)
        return torch.where(blocks < limit, blocks, -1)
    if width == BLOCK_TOKENS * block_topk + TAIL_TOKENS:
        # Token positions: a selected block contributes its first token (4 b); the open
        # block's tokens lie at or after 4 * closed.
        tokens = indices.to(torch.int32)
        starts = (tokens >= 0) & (tokens % BLOCK_TOKENS == 0) & (tokens < BLOCK_TOKENS * limit)
        candidates = torch.where(starts, tokens // BLOCK_TOKENS, -1)
        return candidates.sort(dim=1, descending=True).values[:, :block_topk].contiguous()
    msg = (
        f"the QSA indexer's selection must be [B, {block_topk}] block ids or "
        f"[B, {BLOCK_TOKENS * (block_topk + 1) - 1}] token positions; got "
        f"{tuple(indices.shape)!r}"
    )
    raise KernelInputError(msg)
