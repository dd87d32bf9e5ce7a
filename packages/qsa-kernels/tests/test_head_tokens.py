"""Per-head token ops: the Triton kernels equal their torch references, every output written."""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import KernelInputError
from qsa_kernels.head_tokens import (
    head_blocks,
    head_blocks_reference,
    head_tokens,
    head_tokens_reference,
)


def _choice(
    device: str, *, batch: int, heads: int, width: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions with padding, repeats, open-block tokens and a dense ramp; closed blocks."""
    gen = torch.Generator().manual_seed(seed)
    closed = torch.randint(0, 40, (batch,), generator=gen, dtype=torch.int32)
    closed[0] = 0  # a row whose every token is in the tail
    positions = torch.randint(-1, 164, (batch, heads, width), generator=gen, dtype=torch.int32)
    positions[-1, 0] = torch.arange(width, dtype=torch.int32)  # a dense row's ramp
    positions[-1, -1, width // 2 :] = positions[-1, -1, 0]  # repeats of one block
    return positions.to(device), closed.to(device)


@pytest.mark.parametrize(("width", "slots"), [(37, 50), (37, 12), (64, 16), (1, 4)])
def test_head_blocks_equal_the_reference_cut_to_the_hot_slots(
    kernel_device: str, width: int, slots: int, poisoned_empty: None
) -> None:
    """Distinct closed blocks ascending, -1 padded, cut to min(W, S); counts before the cut."""
    del poisoned_empty
    positions, closed = _choice(kernel_device, batch=3, heads=4, width=width, seed=width)
    blocks, counts = head_blocks(positions, closed, slots=slots)
    want_blocks, want_counts = head_blocks_reference(positions, closed, slots=slots)
    assert blocks.shape == (3, 4, min(width, slots))
    assert torch.equal(blocks, want_blocks)
    assert torch.equal(counts, want_counts)


def test_head_blocks_of_a_known_choice(kernel_device: str) -> None:
    """One head's tokens 9, 2, 8, 1, -1, 13 with 3 closed blocks: blocks 0 and 2, count 2."""
    positions = torch.tensor([[[9, 2, 8, 1, -1, 13]]], dtype=torch.int32, device=kernel_device)
    closed = torch.tensor([3], dtype=torch.int32, device=kernel_device)
    blocks, counts = head_blocks(positions, closed, slots=4)
    assert blocks.tolist() == [[[0, 2, -1, -1]]]
    assert counts.tolist() == [[2]]


@pytest.mark.usefixtures("poisoned_empty")
def test_head_blocks_of_ascending_lists_skip_no_block(kernel_device: str) -> None:
    """Lists that already ascend (a dense ramp, heavy tokens in order, -1 after): the kernel's
    unsorted path gives the reference's blocks."""
    ramp = torch.arange(40, dtype=torch.int32)
    heavy = torch.tensor([1, 2, 9, 10, 11, 30, 31, 57, *[-1] * 32], dtype=torch.int32)
    positions = torch.stack([ramp, heavy]).view(2, 1, 40).to(kernel_device)
    closed = torch.tensor([9, 14], dtype=torch.int32, device=kernel_device)
    blocks, counts = head_blocks(positions, closed, slots=16)
    want_blocks, want_counts = head_blocks_reference(positions, closed, slots=16)
    assert torch.equal(blocks, want_blocks)
    assert torch.equal(counts, want_counts)
    assert blocks[1, 0, :5].tolist() == [0, 2, 7, -1, -1]  # 57 is past 14 closed blocks


@pytest.mark.parametrize("width", [37, 5])
def test_head_tokens_equal_the_reference(
    kernel_device: str, width: int, poisoned_empty: None
) -> None:
    """Hot-cache key rows through the block table, and the chosen tail offsets."""
    del poisoned_empty
    positions, closed = _choice(kernel_device, batch=3, heads=4, width=width, seed=7 + width)
    gen = torch.Generator().manual_seed(width)
    rows, slots, max_blocks = 6, 12, 48
    row_ids = torch.tensor([4, 0, 2], dtype=torch.int32).to(kernel_device)
    table = torch.randint(-1, slots, (4, rows, max_blocks), generator=gen, dtype=torch.int32)
    table = table.to(kernel_device)
    hot, tail = head_tokens(positions, row_ids, closed, table, slots=slots)
    want_hot, want_tail = head_tokens_reference(positions, row_ids, closed, table, slots=slots)
    assert torch.equal(hot, want_hot)
    assert torch.equal(tail, want_tail)


def test_head_tokens_of_a_known_choice(kernel_device: str) -> None:
    """Row 2, 2 closed blocks, S=3; block 1 in slot 2: token 5 is key row 8 (2*3+2)+1 = 65;
    tokens 8 and 10 of the open block are tail rows 16 and 18; token -1 is nowhere."""
    positions = torch.tensor([[[5, 8, 10, -1]]], dtype=torch.int32, device=kernel_device)
    table = torch.full((1, 3, 4), -1, dtype=torch.int32, device=kernel_device)
    table[0, 2, 1] = 2
    hot, tail = head_tokens(
        positions,
        torch.tensor([2], dtype=torch.int32, device=kernel_device),
        torch.tensor([2], dtype=torch.int32, device=kernel_device),
        table,
        slots=3,
    )
    assert hot.tolist() == [[[65, -1, -1, -1]]]
    assert tail.tolist() == [[[16, -1, 18]]]


def test_head_ops_refuse_int64_positions_and_a_table_of_other_heads() -> None:
    """The bad argument is named with what is allowed."""
    positions = torch.zeros(1, 2, 4, dtype=torch.int64)
    closed = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="positions"):
        head_blocks(positions, closed, slots=4)
    table = torch.zeros(3, 1, 4, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="block_slot"):
        head_tokens_reference(positions.int(), closed, closed, table, slots=4)
    with pytest.raises(KernelInputError, match="slots=0"):
        head_blocks_reference(positions.int(), closed, slots=0)
