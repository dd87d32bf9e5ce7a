"""Input checks shared by the indexer kernel and its reference."""

from __future__ import annotations

import torch

from qsa_kernels._checks import KV_DTYPES
from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCKS_PER_PAGE, INDEX_HEAD_DIM, INDEX_HEADS

_INT_DTYPES = (torch.int32, torch.int64)


def check_indexer_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """Raise :class:`KernelInputError` unless the tensors match the indexer contract."""
    if q.dim() != 3 or tuple(q.shape[1:]) != (INDEX_HEADS, INDEX_HEAD_DIM):
        msg = f"q must be [B, {INDEX_HEADS}, {INDEX_HEAD_DIM}], got {tuple(q.shape)!r}"
        raise KernelInputError(msg)
    if k_cache.dim() != 3 or tuple(k_cache.shape[1:]) != (BLOCKS_PER_PAGE, INDEX_HEAD_DIM):
        msg = (
            f"k_cache must be [pages, {BLOCKS_PER_PAGE}, {INDEX_HEAD_DIM}], got "
            f"{tuple(k_cache.shape)!r}"
        )
        raise KernelInputError(msg)
    for name, t in (("q", q), ("k_cache", k_cache)):
        if t.dtype not in KV_DTYPES:
            msg = f"{name} dtype must be one of {KV_DTYPES!r}, got {t.dtype!r}"
            raise KernelInputError(msg)
    if page_table.dim() != 2 or page_table.shape[0] != q.shape[0]:
        msg = f"page_table must be [B={q.shape[0]}, P], got {tuple(page_table.shape)!r}"
        raise KernelInputError(msg)
    if page_table.dtype not in _INT_DTYPES:
        msg = f"page_table dtype must be one of {_INT_DTYPES!r}, got {page_table.dtype!r}"
        raise KernelInputError(msg)
    if seq_lens.shape != (q.shape[0],) or seq_lens.dtype not in _INT_DTYPES:
        msg = (
            f"seq_lens must be [B={q.shape[0]}] int32/int64, got {tuple(seq_lens.shape)!r} "
            f"{seq_lens.dtype!r}"
        )
        raise KernelInputError(msg)
    devices = {t.device for t in (q, k_cache, page_table, seq_lens)}
    if len(devices) != 1:
        msg = f"all tensors must share one device, got {sorted(map(str, devices))!r}"
        raise KernelInputError(msg)
