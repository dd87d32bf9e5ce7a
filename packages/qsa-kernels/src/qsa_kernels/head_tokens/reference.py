"""Torch references of the per-head token ops: the operations the Triton kernels replace."""

from __future__ import annotations

import torch

from qsa_kernels._geometry import BLOCK_TOKENS, RECORD_ROWS, TAIL_TOKENS
from qsa_kernels.head_tokens._validate import check_head_blocks_args, check_head_tokens_args

__all__ = ("head_blocks_reference", "head_tokens_reference")

#: A block id past every real one (int32): where a position lies in no complete block.
_SENTINEL = 2**31 - 1


def _in_closed(positions: torch.Tensor, closed_blocks: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, W]`` bool: which positions lie in their row's complete blocks."""
    closed = closed_blocks.view(-1, 1, 1).long() * BLOCK_TOKENS
    return (positions >= 0) & (positions < closed)


def head_blocks_reference(
    positions: torch.Tensor, closed_blocks: torch.Tensor, *, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct complete blocks that hold each KV head's chosen tokens.

    Args:
        positions: ``[B, Hkv, W]`` int32 logical token positions, ``-1`` padded anywhere.
        closed_blocks: ``[B]`` int32 complete blocks of each row (a position below
            ``4 × closed_blocks`` lies in one; the others are in the open block's tail).
        slots: a hot cache's slots ``S``: the lists are cut to ``K = min(W, S)``.

    Returns:
        ``(blocks [B, Hkv, K] int32, counts [B, Hkv] int32)``: each head's distinct block ids
        ascending, ``-1`` padded (blocks past ``K`` dropped), and how many it has before the cut.
    """
    check_head_blocks_args(positions, closed_blocks, slots)
    ids = torch.where(_in_closed(positions, closed_blocks), positions // BLOCK_TOKENS, _SENTINEL)
    ids = ids.sort(dim=2).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.where(repeat, _SENTINEL, ids).sort(dim=2).values
    counts = (ids < _SENTINEL).sum(dim=2).to(torch.int32)
    ids = ids[..., : min(int(positions.shape[2]), slots)]
    return torch.where(ids < _SENTINEL, ids, -1).to(torch.int32), counts


def head_tokens_reference(
    positions: torch.Tensor,
    row_ids: torch.Tensor,
    closed_blocks: torch.Tensor,
    block_slot: torch.Tensor,
    *,
    slots: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chosen token's row in one layer's hot cache, and the chosen tokens of the tail.

    The hot cache of a layer is ``[Hkv, R, S, 2, 4, 1, D]`` and its tail ``[Hkv, R, 1, 2, 4, 1,
    D]``; viewed per head as rows of ``D`` (record ``r = row × S + slot`` holds its 4 keys at
    rows ``8r .. 8r + 3``), a token's key row is ``8 (row × S + slot) + position % 4``, and the
    tail's ``8 row + offset``.

    Args:
        positions: ``[B, Hkv, W]`` int32 logical positions, ``-1`` padded.
        row_ids: ``[B]`` int32 request row of each batch entry.
        closed_blocks: ``[B]`` int32 complete blocks of each row.
        block_slot: ``[Hkv, R, NB]`` int32 the layer's hot slot of each resident block (after
            the fetch, every chosen complete block has one).
        slots: a hot cache's slots ``S``.

    Returns:
        ``(hot [B, Hkv, W] int32, tail [B, Hkv, 3] int32)``: key rows in the hot cache (``-1``
        for a position outside the complete blocks), and in the tail the rows of the open
        block's offsets ``0, 1, 2`` the head chose (``-1`` for the others).
    """
    check_head_tokens_args(positions, row_ids, closed_blocks, block_slot, slots)
    batch, hkv, _ = positions.shape
    row_t = row_ids.long().view(batch, 1, 1)
    in_hot = _in_closed(positions, closed_blocks)
    block = torch.where(in_hot, positions // BLOCK_TOKENS, 0).long()
    heads = torch.arange(hkv, device=positions.device).view(1, -1, 1)
    slot = block_slot[heads, row_t, block]
    token = (row_t * slots + slot) * RECORD_ROWS + positions % BLOCK_TOKENS
    hot = torch.where(in_hot, token, -1).to(torch.int32).contiguous()
    offsets = torch.arange(TAIL_TOKENS, dtype=torch.int32, device=positions.device)
    closed = closed_blocks.view(batch, 1, 1, 1).long() * BLOCK_TOKENS
    chosen = (positions.unsqueeze(-1) == closed + offsets).any(dim=2)  # [B, Hkv, 3]
    tail_ids = (row_t * RECORD_ROWS + offsets).expand_as(chosen)
    tail = torch.where(chosen, tail_ids, -1).to(torch.int32).contiguous()
    return hot, tail
