"""Torch definition of block-to-token expansion with the incomplete-group tail."""

from __future__ import annotations

import torch

from qsa_kernels._errors import KernelInputError

__all__ = ("expand_blocks_reference",)


def check_expand_inputs(
    block_ids: torch.Tensor, seq_lens: torch.Tensor, ratio: int, token_topk: int
) -> None:
    """Raise :class:`KernelInputError` unless the arguments match the expansion contract."""
    if block_ids.dim() != 2 or block_ids.dtype not in (torch.int32, torch.int64):
        msg = (
            f"block_ids must be [M, bk] int32/int64, got {tuple(block_ids.shape)!r} "
            f"{block_ids.dtype!r}"
        )
        raise KernelInputError(msg)
    if seq_lens.shape != (block_ids.shape[0],) or seq_lens.dtype not in (torch.int32, torch.int64):
        msg = (
            f"seq_lens must be [M={block_ids.shape[0]}] int32/int64, got "
            f"{tuple(seq_lens.shape)!r} {seq_lens.dtype!r}"
        )
        raise KernelInputError(msg)
    if ratio < 1 or token_topk < 0:
        msg = f"need ratio >= 1 and token_topk >= 0, got ratio={ratio!r} token_topk={token_topk!r}"
        raise KernelInputError(msg)
    if block_ids.device != seq_lens.device:
        msg = f"block_ids on {block_ids.device!s} but seq_lens on {seq_lens.device!s}"
        raise KernelInputError(msg)


def expand_blocks_reference(
    block_ids: torch.Tensor, seq_lens: torch.Tensor, *, ratio: int = 4, token_topk: int = 2048
) -> torch.Tensor:
    """Expand selected blocks to token positions and append the current incomplete group.

    For row ``m`` with ``L = seq_lens[m]`` and ``nb = L // ratio`` complete blocks, each entry
    ``b`` of ``block_ids[m]`` with ``0 <= b < nb`` (others are padding and skipped) becomes the
    tokens ``ratio*b .. ratio*b + ratio - 1``, in the order the blocks appear; the list is cut to
    ``token_topk`` tokens. Then the tail ``nb*ratio .. L - 1`` (at most ``ratio - 1`` tokens) is
    appended, and ``-1`` fills the rest. Duplicated block ids expand twice.

    Args:
        block_ids: ``[M, bk]`` int32/int64 block ids, ``-1`` (any negative) as padding anywhere.
        seq_lens: ``[M]`` int32/int64 tokens visible to each query (query position + 1).
        ratio: tokens per block (QSA: 4).
        token_topk: token budget before the tail (QSA: 2048).

    Returns:
        ``[M, token_topk + ratio - 1]`` int32 token positions, valid entries first, ``-1`` after.
    """
    check_expand_inputs(block_ids, seq_lens, ratio, token_topk)
    rows = block_ids.shape[0]
    width = token_topk + ratio - 1
    out = torch.full((rows, width), -1, dtype=torch.int32, device=block_ids.device)
    steps = torch.arange(ratio, dtype=torch.int64, device=block_ids.device)
    for m in range(rows):
        length = int(seq_lens[m])
        nb = max(length, 0) // ratio
        ids = block_ids[m].to(torch.int64)
        ids = ids[(ids >= 0) & (ids < nb)]
        tokens = (ids[:, None] * ratio + steps[None, :]).reshape(-1)[:token_topk]
        tail = torch.arange(nb * ratio, max(length, 0), dtype=torch.int64, device=block_ids.device)
        row = torch.cat([tokens, tail])
        out[m, : row.numel()] = row.to(torch.int32)
    return out
