"""Argument checks shared by the per-head token ops and their references."""

from __future__ import annotations

import torch

from qsa_kernels._checks import (
    check_contiguous,
    check_dim,
    check_dtype,
    check_ndim,
    check_same_device,
)
from qsa_kernels._errors import KernelInputError

__all__ = ("check_head_blocks_args", "check_head_tokens_args")


def check_head_blocks_args(
    positions: torch.Tensor, closed_blocks: torch.Tensor, slots: int
) -> None:
    """Validate a :func:`head_blocks` call (no device sync)."""
    check_ndim("positions", positions, 3, "[B, Hkv, W]")
    check_dtype("positions", positions, (torch.int32,))
    check_ndim("closed_blocks", closed_blocks, 1, "[B]")
    check_dtype("closed_blocks", closed_blocks, (torch.int32,))
    check_dim("closed_blocks", closed_blocks, 0, positions.shape[0], "B of positions")
    check_same_device(positions.device, closed_blocks=closed_blocks)
    check_contiguous(positions=positions, closed_blocks=closed_blocks)
    if slots < 1:
        msg = f"slots={slots!r} is not allowed; allowed: at least 1 (a hot cache's slots)"
        raise KernelInputError(msg)


def check_head_tokens_args(
    positions: torch.Tensor,
    row_ids: torch.Tensor,
    closed_blocks: torch.Tensor,
    block_slot: torch.Tensor,
    slots: int,
) -> None:
    """Validate a :func:`head_tokens` call (no device sync)."""
    check_head_blocks_args(positions, closed_blocks, slots)
    check_ndim("row_ids", row_ids, 1, "[B]")
    check_dtype("row_ids", row_ids, (torch.int32,))
    check_dim("row_ids", row_ids, 0, positions.shape[0], "B of positions")
    check_ndim("block_slot", block_slot, 3, "[Hkv, R, NB]")
    check_dtype("block_slot", block_slot, (torch.int32,))
    check_dim("block_slot", block_slot, 0, positions.shape[1], "Hkv of positions")
    check_same_device(positions.device, row_ids=row_ids, block_slot=block_slot)
    check_contiguous(row_ids=row_ids, block_slot=block_slot)
