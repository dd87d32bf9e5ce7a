"""QSA-shaped selections for tests that drive the attention paths without an indexer.

The QSA indexer picks complete 4-token blocks per query and, in prefill, hands attention their
token positions followed by the query's open block (upstream's expansion). Tests that feed the
backends or the sharded kernels by hand draw the same shapes here, from a seeded generator, so
every rank of a gloo scenario draws the same selection.
"""

from __future__ import annotations

import torch

__all__ = ("random_block_selection",)


def random_block_selection(
    lengths: torch.Tensor, block_topk: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random complete blocks per query, and the same selection as upstream's token positions.

    Args:
        lengths: ``[T]`` tokens each query sees (its position + 1).
        block_topk: blocks per query at most (its complete blocks if fewer).
        generator: the seeded source of the draw.

    Returns:
        ``(blocks [T, block_topk] int32, positions [T, 4 block_topk + 3] int32)``: distinct
        complete block ids, ``-1`` padded; their tokens in the order drawn, then the query's open
        block, ``-1`` padded (``qsa_kernels.expand.expand_blocks_reference``).
    """
    from qsa_kernels import BLOCK_TOKENS
    from qsa_kernels.expand import expand_blocks_reference

    blocks = torch.full((lengths.numel(), block_topk), -1, dtype=torch.int32)
    for row, length in enumerate(lengths.tolist()):
        pick = torch.randperm(length // BLOCK_TOKENS, generator=generator)[:block_topk]
        blocks[row, : pick.numel()] = pick.to(torch.int32)
    positions = expand_blocks_reference(
        blocks, lengths, ratio=BLOCK_TOKENS, token_topk=BLOCK_TOKENS * block_topk
    )
    return blocks, positions
