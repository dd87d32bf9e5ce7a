"""``random_block_selection``: the QSA indexer's shapes, drawn the same from the same seed."""

from __future__ import annotations

import torch

from qsa_testing import random_block_selection


def test_blocks_are_distinct_complete_and_expand_to_their_tokens_then_the_open_block() -> None:
    lengths = torch.tensor([1, 3, 4, 9, 70, 611])
    blocks, positions = random_block_selection(lengths, 16, torch.Generator().manual_seed(7))
    assert blocks.shape == (6, 16)
    assert positions.shape == (6, 4 * 16 + 3)
    for row, length in enumerate(lengths.tolist()):
        chosen = [b for b in blocks[row].tolist() if b >= 0]
        assert len(chosen) == min(16, length // 4) == len(set(chosen))
        assert all(0 <= b < length // 4 for b in chosen)
        tokens = [4 * b + i for b in chosen for i in range(4)]
        tail = list(range(length // 4 * 4, length))
        valid = [p for p in positions[row].tolist() if p >= 0]
        assert valid == tokens + tail


def test_the_same_seed_draws_the_same_selection() -> None:
    lengths = torch.arange(1, 300)
    first = random_block_selection(lengths, 8, torch.Generator().manual_seed(1))
    again = random_block_selection(lengths, 8, torch.Generator().manual_seed(1))
    other = random_block_selection(lengths, 8, torch.Generator().manual_seed(2))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
