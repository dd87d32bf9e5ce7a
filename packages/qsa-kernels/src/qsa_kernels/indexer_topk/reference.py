"""Torch definition of QSA decode indexer scoring and block top-k: the contract of the kernel."""

from __future__ import annotations

import math

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS, BLOCKS_PER_PAGE, INDEX_HEAD_DIM
from qsa_kernels._topk_select import row_topk_reference
from qsa_kernels.indexer_topk._validate import check_indexer_inputs

__all__ = ("indexer_scores_reference", "indexer_topk_reference")


def visible_blocks(seq_lens: torch.Tensor, page_table_width: int) -> torch.Tensor:
    """Complete blocks a decode query sees: ``min(seq_len // 4, P * 16)``, int32 ``[B]``."""
    n = torch.div(seq_lens.to(torch.int64), BLOCK_TOKENS, rounding_mode="floor")
    return n.clamp(0, page_table_width * BLOCKS_PER_PAGE).to(torch.int32)


def indexer_scores_reference(
    q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Block scores of the QSA indexer for one decode query per row.

    ``score[b, j] = (relu(q[b,0]·k_j) + relu(q[b,1]·k_j) + relu(q[b,2]·k_j) + relu(q[b,3]·k_j))
    / sqrt(128)`` in fp32, with ``k_j = k_cache[page_table[b, j // 16], j % 16]`` and the sum taken
    left to right. Only complete blocks are scored: ``j < min(seq_lens[b] // 4, P * 16)``.

    Args:
        q: ``[B, 4, 128]`` bf16 or float8_e4m3fn index queries (normalised and roped).
        k_cache: ``[pages, 16, 128]`` bf16 or float8_e4m3fn compressed index keys.
        page_table: ``[B, P]`` int32 compressed page ids; only the first ``ceil(n / 16)`` of a
            row are read.
        seq_lens: ``[B]`` int32/int64 tokens visible to the query (query position + 1).

    Returns:
        ``[B, P * 16]`` fp32; ``-inf`` at ``j >= n``.
    """
    check_indexer_inputs(q, k_cache, page_table, seq_lens)
    batch, width_pages = page_table.shape
    width = width_pages * BLOCKS_PER_PAGE
    n_blocks = visible_blocks(seq_lens, width_pages)
    out = torch.full((batch, width), -math.inf, dtype=torch.float32, device=q.device)
    scale = torch.tensor(math.sqrt(INDEX_HEAD_DIM), dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(n_blocks[b])
        if n == 0:
            continue
        pages = page_table[b, : (n + BLOCKS_PER_PAGE - 1) // BLOCKS_PER_PAGE].to(torch.int64)
        keys = k_cache[pages].reshape(-1, INDEX_HEAD_DIM)[:n].float()
        dots = torch.relu(q[b].float() @ keys.T)  # [4, n]
        total = ((dots[0] + dots[1]) + dots[2]) + dots[3]
        out[b, :n] = total / scale.expand_as(total)
    return out


def indexer_topk_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int = 512,
) -> torch.Tensor:
    """Top ``topk`` complete blocks per row by indexer score.

    Order of merit: score descending, ties to the smaller block id (``-0.0 == +0.0``). A row with
    ``n <= topk`` complete blocks selects all of them without scoring.

    Args:
        q: ``[B, 4, 128]`` bf16 or float8_e4m3fn.
        k_cache: ``[pages, 16, 128]`` bf16 or float8_e4m3fn.
        page_table: ``[B, P]`` int32.
        seq_lens: ``[B]`` int32/int64, tokens (query position + 1).
        topk: blocks to select, ``>= 1`` (QSA uses 512, or 2048).

    Returns:
        ``[B, topk]`` int32 block ids in ascending order, ``-1`` after the ``min(n, topk)`` valid
        ones.
    """
    if topk < 1:
        msg = f"topk must be >= 1, got {topk!r}"
        raise KernelInputError(msg)
    scores = indexer_scores_reference(q, k_cache, page_table, seq_lens)
    n_blocks = visible_blocks(seq_lens, page_table.shape[1])
    return row_topk_reference(scores, n_blocks, topk)
