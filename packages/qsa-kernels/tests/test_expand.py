"""Block-to-token expansion with the incomplete-group tail against the torch reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels.expand import complete_blocks, expand_blocks, expand_blocks_reference


def test_reference_expands_blocks_then_tail() -> None:
    """Blocks 2 and 0 of a 14-token row give 8..11, 0..3, then tail 12, 13 and -1 padding."""
    out = expand_blocks_reference(
        torch.tensor([[2, -1, 0]]), torch.tensor([14]), ratio=4, token_topk=12
    )
    assert out.tolist() == [[8, 9, 10, 11, 0, 1, 2, 3, 12, 13, -1, -1, -1, -1, -1]]


def test_reference_drops_incomplete_and_out_of_range_blocks() -> None:
    """A block at or past floor(L/4) is padding; the width is token_topk + ratio - 1."""
    out = expand_blocks_reference(torch.tensor([[1, 2, 5]]), torch.tensor([11]), token_topk=8)
    assert out.tolist() == [[4, 5, 6, 7, 8, 9, 10, -1, -1, -1, -1]]


def test_rejects_zero_ratio() -> None:
    """ratio < 1 is refused with the value in the message."""
    with pytest.raises(KernelInputError, match="ratio=0"):
        expand_blocks_reference(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([4]), ratio=0)


@pytest.mark.parametrize(
    ("rows", "bk", "ratio", "token_topk"),
    [
        pytest.param(7, 512, 4, 2048, id="qsa-512"),
        pytest.param(5, 2048, 4, 2048, id="k2048-truncated"),
        pytest.param(3, 13, 3, 17, id="odd-ratio3"),
        pytest.param(1, 1, 4, 4, id="single"),
    ],
)
def test_kernel_equals_reference(  # noqa: PLR0917
    rows: int,
    bk: int,
    ratio: int,
    token_topk: int,
    kernel_device: str,
    poisoned_int: Callable[..., torch.Tensor],
    int_poison: int,
) -> None:
    """Random ids with padding, duplicates and out-of-range entries expand exactly like the ref."""
    g = torch.Generator().manual_seed(rows * bk)
    ids = torch.randint(-3, 2 * bk, (rows, bk), generator=g, dtype=torch.int32)
    lens = torch.randint(0, 4 * 2 * bk, (rows,), generator=g)
    lens[0] = 4 * bk  # block boundary, no tail
    ids, lens = ids.to(kernel_device), lens.to(kernel_device)
    out = poisoned_int(rows, token_topk + ratio - 1)
    expand_blocks(ids, lens, ratio=ratio, token_topk=token_topk, out=out)
    assert not (out == int_poison).any()
    ref = expand_blocks_reference(ids, lens, ratio=ratio, token_topk=token_topk)
    assert torch.equal(out.cpu(), ref.cpu())


def test_complete_blocks_reads_block_ids_and_token_positions_alike() -> None:
    closed = torch.tensor([3])
    ids = torch.tensor([[2, 0, 5, -1]], dtype=torch.int32)  # 5 is not a complete block
    assert complete_blocks(ids, closed, 4).tolist() == [[2, 0, -1, -1]]
    tokens = torch.full((1, 4 * 4 + 3), -1, dtype=torch.int32)
    tokens[0, :8] = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])  # blocks 2 and 0
    tokens[0, 8:10] = torch.tensor([12, 13])  # the open block
    assert complete_blocks(tokens, closed, 4).tolist() == [[2, 0, -1, -1]]
    with pytest.raises(KernelInputError, match=r"\[B, 4\] block ids or \[B, 19\] token"):
        complete_blocks(torch.zeros((1, 5), dtype=torch.int32), closed, 4)
