"""Torch reference of sparse GQA decode: gather the selected tokens, then attend in fp32."""

from __future__ import annotations

from collections.abc import Callable

import torch

from qsa_kernels._geometry import BLOCK_TOKENS
from qsa_kernels.sparse_decode._validate import check_decode_args, check_split_decode_args

__all__ = ("gather_selected_kv", "sparse_decode_reference", "sparse_decode_split_reference")

#: ``[B, T]`` slots of one KV head ``g`` -> its ``(k [B, T, D], v [B, T, D], valid [B, T])``.
_HeadGather = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


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
    merged: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse GQA decode over selected tokens (reference: gather, then fp32 attention).

    Same contract as :func:`qsa_kernels.sparse_decode.sparse_decode`, for ``[B, T]`` and ``[B, Hkv,
    T]`` token lists alike; unmerged, one part (``P = 1``).
    """
    sm_scale = check_decode_args(q, token_slots, kv_cache, scale, out_dtype)

    def head(slots: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v, valid = gather_selected_kv(slots, kv_cache)  # k, v: [B, Hkv, T, D]
        return k[:, g], v[:, g], valid

    return _attend(q, token_slots, int(kv_cache.shape[3]), head, sm_scale, out_dtype, merged)


def sparse_decode_split_reference(
    q: torch.Tensor,
    token_slots: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    *,
    scale: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    merged: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse GQA decode over selected tokens of a pool that keeps K and V apart (reference).

    SGLang's MHA pool holds one ``[slots, Hkv, D]`` buffer of keys and one of values per layer,
    indexed by the token slot of ``req_to_token``; this reads them as they are.

    Args:
        q: ``[B, Hq, D]`` bf16 queries.
        token_slots: ``[B, T]`` (one list per row) or ``[B, Hkv, T]`` (one per KV head) int32
            token slots into the buffers, ``-1`` padding.
        k_buffer: ``[N, Hkv, D]`` keys, bf16/fp16 (FP8 upcast unscaled).
        v_buffer: ``[N, Hkv, D]`` values, same shape and dtype.
        scale: softmax scale, ``1 / sqrt(D)`` if ``None``.
        out_dtype: bf16 or fp32.
        merged: ``False`` returns one unmerged part (``out [1, B, Hq, D] fp32``, ``lse [1, B,
            Hq]``), as the kernel's parts.

    Returns:
        ``(out [B, Hq, D] out_dtype, lse [B, Hq] fp32)``; a row with no valid slot gives zeros and
        ``-inf``.
    """
    sm_scale = check_split_decode_args(q, token_slots, k_buffer, v_buffer, scale, out_dtype)

    def head(slots: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = slots >= 0
        tok = torch.where(valid, slots, 0).long()
        return k_buffer[tok, g], v_buffer[tok, g], valid

    return _attend(q, token_slots, int(k_buffer.shape[1]), head, sm_scale, out_dtype, merged)


def _attend(  # noqa: PLR0917
    q: torch.Tensor,
    token_slots: torch.Tensor,
    hkv: int,
    head: _HeadGather,
    sm_scale: float,
    out_dtype: torch.dtype,
    merged: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of each KV head's query group over the tokens ``head`` gathers.

    Unmerged (``merged=False``), the result is one part: ``[1, ...]``.
    """
    B, Hq, D = q.shape
    group = Hq // hkv
    per_head = token_slots if token_slots.dim() == 3 else token_slots[:, None].expand(-1, hkv, -1)
    out = torch.empty((B, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, Hq), dtype=torch.float32, device=q.device)
    for g in range(hkv):
        heads = slice(g * group, (g + 1) * group)
        k, v, valid = head(per_head[:, g], g)  # k, v: [B, T, D]
        scores = torch.einsum("bgd,btd->bgt", q[:, heads].float(), k.float()) * sm_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        head_lse = torch.logsumexp(scores, dim=-1)  # -inf for an empty row
        finite = torch.where(torch.isneginf(head_lse), 0.0, head_lse)
        probs = torch.exp(scores - finite.unsqueeze(-1))
        out[:, heads] = torch.einsum("bgt,btd->bgd", probs, v.float())
        lse[:, heads] = head_lse
    if not merged:
        return out.unsqueeze(0), lse.unsqueeze(0)
    return out.to(out_dtype), lse
