"""Torch reference of sparse GQA decode: gather the selected tokens, then attend in fp32."""

from __future__ import annotations

import torch

from qsa_kernels._geometry import BLOCK_TOKENS
from qsa_kernels.sparse_decode._validate import check_decode_args

__all__ = ("gather_selected_kv", "sparse_decode_reference")


def gather_selected_kv(
    token_slots: torch.Tensor, kv_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the selected K and V rows.

    Args:
        token_slots: ``[B, T]`` int32 token slots (``4 * global_slot + token``), ``-1`` padding.
        kv_cache: ``[NS, 2, 4, Hkv, D]`` one layer's hot cache.

    Returns:
        ``(k [B, Hkv, T, D], v [B, Hkv, T, D], valid [B, T] bool)`` in ``kv_cache``'s dtype; padded
        positions hold slot 0's rows and are ``False`` in ``valid``.
    """
    valid = token_slots >= 0
    tok = torch.where(valid, token_slots, 0).long()
    blk, j = tok // BLOCK_TOKENS, tok % BLOCK_TOKENS
    k = kv_cache[blk, 0, j].permute(0, 2, 1, 3)
    v = kv_cache[blk, 1, j].permute(0, 2, 1, 3)
    return k, v, valid


def sparse_decode_reference(
    q: torch.Tensor,
    token_slots: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    scale: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse GQA decode over selected tokens (reference: gather, then fp32 attention).

    Same contract as :func:`qsa_kernels.sparse_decode.sparse_decode`, for ``[B, T]`` and ``[B, Hkv,
    T]`` token lists alike.
    """
    sm_scale = check_decode_args(q, token_slots, kv_cache, scale, out_dtype)
    B, Hq, D = q.shape
    Hkv = kv_cache.shape[3]
    group = Hq // Hkv
    per_head = token_slots if token_slots.dim() == 3 else token_slots[:, None].expand(-1, Hkv, -1)
    out = torch.empty((B, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, Hq), dtype=torch.float32, device=q.device)
    for g in range(Hkv):
        heads = slice(g * group, (g + 1) * group)
        k, v, valid = gather_selected_kv(per_head[:, g], kv_cache)  # k, v: [B, Hkv, T, D]
        scores = torch.einsum("bgd,btd->bgt", q[:, heads].float(), k[:, g].float()) * sm_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        head_lse = torch.logsumexp(scores, dim=-1)  # -inf for an empty row
        finite = torch.where(torch.isneginf(head_lse), 0.0, head_lse)
        probs = torch.exp(scores - finite.unsqueeze(-1))
        out[:, heads] = torch.einsum("bgt,btd->bgd", probs, v[:, g].float())
        lse[:, heads] = head_lse
    return out.to(out_dtype), lse
