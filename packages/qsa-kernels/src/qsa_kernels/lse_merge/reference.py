"""Torch reference of the log-sum-exp merge of partial attention outputs."""

from __future__ import annotations

import torch

from qsa_kernels.lse_merge._validate import check_merge_args

__all__ = ("lse_merge_reference",)


def lse_merge_reference(
    outputs: torch.Tensor,
    lse: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    more: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``P`` partial attention results over disjoint key sets (reference, fp32 math).

    Same contract as :func:`qsa_kernels.lse_merge.lse_merge`; ``more`` is concatenated.
    """
    check_merge_args(outputs, lse, out_dtype, more)
    if more is not None:
        outputs = torch.cat([outputs.float(), more[0].float()])
        lse = torch.cat([lse, more[1]])
    lse32 = lse.float()
    total = torch.logsumexp(lse32, dim=0)  # -inf where every part is empty
    empty = torch.isneginf(total)
    weight = torch.exp(lse32 - torch.where(empty, 0.0, total).unsqueeze(0))
    weight = torch.where(torch.isneginf(lse32), 0.0, weight)
    parts = torch.where(weight.unsqueeze(-1) > 0, outputs.float(), 0.0)
    merged = (weight.unsqueeze(-1) * parts).sum(dim=0)
    return merged.to(out_dtype), total
