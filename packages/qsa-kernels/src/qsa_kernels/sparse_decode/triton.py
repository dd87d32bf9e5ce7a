"""Triton sparse GQA decode: split-K over the selected tokens, then an LSE merge.

One kernel reads either K/V layout: the hot cache's ``[NS, 2, 4, Hkv, D]`` records (the QSA
offload's) or a pool that keeps keys and values in two ``[N, Hkv, D]`` buffers (SGLang's MHA pool,
which double sparsity decodes over).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from qsa_kernels._checks import check_unit_last_stride, next_pow2, sm_count
from qsa_kernels.lse_merge.triton import lse_merge
from qsa_kernels.sparse_decode._validate import (
    check_decode_args,
    check_kernel_head_dim,
    check_split_decode_args,
)

__all__ = ("sparse_decode", "sparse_decode_split")

_LOG2E = math.log2(math.e)
_BLOCK_N = 64


@triton.jit  # type: ignore[untyped-decorator]
def _sparse_decode_parts_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    q_ptr,  # [B, Hq, D] bf16
    tok_ptr,  # [B, T] or [B, Hkv, T] int32 token slots, -1 padding
    k_ptr,  # records: [NS, 2, 4, Hkv, D] hot cache of one layer; split: [N, Hkv, D] keys
    v_ptr,  # records: the same tensor as k_ptr; split: [N, Hkv, D] values
    o_ptr,  # [P, B, Hq, D] fp32 partial outputs
    lse_ptr,  # [P, B, Hq] fp32 partial natural-log LSE, -inf for an empty split
    B,
    T,
    stride_qb,
    stride_qh,
    stride_tb,
    stride_th,  # 0 when every KV head shares the row's list
    stride_kn,  # split buffers only: elements between token slots of k / v
    stride_kh,
    stride_vn,
    stride_vh,
    split,  # tokens per program, a multiple of BLOCK_N
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2
    HQ: tl.constexpr,
    HKV: tl.constexpr,  # constexpr so the K/V address arithmetic folds
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # max(16, next_pow2(GROUP)): the dot's minimum M tile
    D: tl.constexpr,  # head dim; constexpr for the [BLOCK_N, D] tiles
    BLOCK_N: tl.constexpr,  # tokens per inner step
    SPLIT_KV: tl.constexpr,  # keys and values in two [N, Hkv, D] buffers, not records
    DOT_DTYPE: tl.constexpr,  # fp16 over fp16 K/V, else bf16; fp32 under the CPU interpreter
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < GROUP
    offs_d = tl.arange(0, D)
    heads = h * GROUP + offs_m
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mmask[:, None],
        other=0.0,
    ).to(DOT_DTYPE)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    start = p * split
    for n0 in range(0, split, BLOCK_N):
        offs_n = start + n0 + tl.arange(0, BLOCK_N)
        tok = tl.load(
            tok_ptr + b.to(tl.int64) * stride_tb + h * stride_th + offs_n,
            mask=offs_n < T,
            other=-1,
        )
        valid = tok >= 0
        tok64 = tl.where(valid, tok, 0).to(tl.int64)
        if SPLIT_KV:  # token slot t of SGLang's pool: keys[t, h], values[t, h]
            k_off = tok64 * stride_kn + h * stride_kh
            v_off = tok64 * stride_vn + h * stride_vh
        else:  # 4 * record + j: [NS, 2, 4, Hkv] row of K, the V row 4 * Hkv after it
            row = ((tok64 // 4) * 8 + tok64 % 4) * HKV + h
            k_off = row * D
            v_off = (row + 4 * HKV) * D
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE))) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(DOT_DTYPE), v.to(DOT_DTYPE))
        m_i = m_new
    live = l_i > 0
    l_safe = tl.where(live, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(live, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    part = (p * B + b).to(tl.int64) * HQ + heads
    tl.store(o_ptr + part[:, None] * D + offs_d[None, :], out, mask=mmask[:, None])
    tl.store(lse_ptr + part, lse, mask=mmask)


def _dot_dtype(device: torch.device, kv_dtype: torch.dtype) -> Any:
    """The dots' operand type: fp16 over an fp16 cache, else bf16; fp32 under the interpreter.

    bf16 would drop 3 bits of every fp16 key; the bf16 queries fit fp16 exactly within its range
    (6e-8 to 65504 in magnitude).
    """
    if device.type != "cuda":
        return tl.float32
    return tl.float16 if kv_dtype == torch.float16 else tl.bfloat16


def _default_splits(B: int, Hkv: int, T: int, device: torch.device) -> int:
    """Enough splits to give every SM two programs, but at least one ``BLOCK_N`` tile each."""
    sms = sm_count(device, cpu=8)
    return max(1, min(-(-2 * sms // max(B * Hkv, 1)), -(-T // _BLOCK_N)))


def sparse_decode(
    q: torch.Tensor,
    token_slots: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    merged: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse GQA decode: each query row attends only to its selected tokens of the hot cache.

    For row ``b`` and query head ``h`` (KV head ``g = h // (Hq / Hkv)``), attends over the tokens
    ``token_slots[b, t] != -1``, or ``token_slots[b, g, t] != -1`` when each KV head has its own
    list (double sparsity selects per head): ``out = softmax(scale · q · Kᵀ) · V`` and
    ``lse = log Σ exp(scale · q · Kᵀ)`` (natural log). A row with no valid token gets ``out = 0``
    and ``lse = -inf``. Tokens are split across programs (split-K) and the parts merged by
    :func:`qsa_kernels.lse_merge.lse_merge`; K/V are read in place from the hot cache (FP8 is upcast
    to bf16 on load, unscaled), the dots run in bf16 (fp16 over an fp16 cache) with fp32
    accumulation.

    Args:
        q: ``[B, Hq, D]`` bf16 queries; Hq a multiple of Hkv (the model's groups are 12 and 24).
        token_slots: ``[B, T]`` (shared by the row's KV heads) or ``[B, Hkv, T]`` (one list per
            KV head) int32 token slots into ``kv_cache``: ``4 * global_slot + token`` where
            ``global_slot = row * S + slot`` as returned by the fetch; ``-1`` is padding,
            anywhere; unit stride along ``T``. Up to 2051 per row for QSA (512 blocks + 3 tail
            tokens), any ``T`` accepted.
        kv_cache: ``[NS, 2, 4, Hkv, D]`` one layer's hot cache (``hot[layer].view(R * S, ...)``),
            FP8 E4M3 or bf16, contiguous.
        scale: Softmax scale; ``1 / sqrt(D)`` if ``None``.
        num_splits: Programs per (row, KV head); chosen from the SM count if ``None``.
        out_dtype: ``torch.bfloat16``, or ``torch.float32`` for a part that is merged with
            others afterwards (rounded once, after the merge).
        merged: ``False`` returns the split-K parts unmerged, to merge with other parts in one
            :func:`~qsa_kernels.lse_merge.lse_merge` (``out_dtype`` is then unused).

    Returns:
        ``(out [B, Hq, D] out_dtype, lse [B, Hq] fp32)``; unmerged, ``(out [P, B, Hq, D] fp32,
        lse [P, B, Hq] fp32)``, ``P >= 1`` parts whose merge is the merged result.

    Raises:
        KernelInputError: On a bad shape, dtype, device or layout.
    """
    sm_scale = check_decode_args(q, token_slots, kv_cache, scale, out_dtype)
    return _launch(
        q,
        token_slots,
        (kv_cache, kv_cache),
        None,
        int(kv_cache.shape[3]),
        sm_scale=sm_scale,
        num_splits=num_splits,
        out_dtype=out_dtype,
        merged=merged,
    )


def sparse_decode_split(
    q: torch.Tensor,
    token_slots: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    merged: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse GQA decode over the selected token slots of a pool that keeps K and V apart.

    SGLang's MHA pool holds one ``[N, Hkv, D]`` key buffer and one value buffer per layer, indexed
    by the token slots of ``req_to_token``; this kernel reads them in place, with the same split-K
    and LSE merge as :func:`sparse_decode` (the same kernel, another address map). Reference:
    :func:`qsa_kernels.sparse_decode.sparse_decode_split_reference`.

    Args:
        q: ``[B, Hq, D]`` bf16 queries; ``D`` a power of two >= 16.
        token_slots: ``[B, T]`` (one list per row) or ``[B, Hkv, T]`` (one per KV head) int32
            token slots into the buffers, ``-1`` padding anywhere; unit stride along ``T``.
        k_buffer: ``[N, Hkv, D]`` keys, bf16/fp16/FP8 E4M3 (FP8 upcast unscaled); any token and
            head strides, unit stride along ``D``.
        v_buffer: ``[N, Hkv, D]`` values, the shape and dtype of ``k_buffer``.
        scale: softmax scale; ``1 / sqrt(D)`` if ``None``.
        num_splits: programs per (row, KV head); chosen from the SM count if ``None``.
        out_dtype: ``torch.bfloat16``, or ``torch.float32`` for a part merged afterwards.
        merged: ``False`` returns the split-K parts unmerged (as :func:`sparse_decode`).

    Returns:
        ``(out [B, Hq, D] out_dtype, lse [B, Hq] fp32)``; a row with no valid slot gives zeros
        and ``-inf``; unmerged, ``(out [P, B, Hq, D] fp32, lse [P, B, Hq] fp32)``.

    Raises:
        KernelInputError: On a bad shape, dtype, device or layout.
    """
    sm_scale = check_split_decode_args(q, token_slots, k_buffer, v_buffer, scale, out_dtype)
    check_kernel_head_dim(q)
    check_unit_last_stride(q=q, token_slots=token_slots, k_buffer=k_buffer, v_buffer=v_buffer)
    return _launch(
        q,
        token_slots,
        (k_buffer, v_buffer),
        (k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1)),
        int(k_buffer.shape[1]),
        sm_scale=sm_scale,
        num_splits=num_splits,
        out_dtype=out_dtype,
        merged=merged,
    )


def _launch(
    q: torch.Tensor,
    token_slots: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    split_strides: tuple[int, int, int, int] | None,
    hkv: int,
    *,
    sm_scale: float,
    num_splits: int | None,
    out_dtype: torch.dtype,
    merged: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the parts kernel over ``kv`` (records, or split buffers with their strides).

    The parts are merged unless ``merged`` is False.
    """
    B, Hq, D = q.shape
    T = token_slots.shape[-1]
    group = Hq // hkv
    splits = num_splits if num_splits is not None else _default_splits(B, hkv, T, q.device)
    split = max(_BLOCK_N, triton.cdiv(triton.cdiv(max(T, 1), max(splits, 1)), _BLOCK_N) * _BLOCK_N)
    P = max(1, triton.cdiv(T, split))
    o_part = torch.empty((P, B, Hq, D), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((P, B, Hq), dtype=torch.float32, device=q.device)
    if B:
        _sparse_decode_parts_kernel[(B, hkv, P)](
            q,
            token_slots,
            kv[0],
            kv[1],
            o_part,
            lse_part,
            B,
            T,
            q.stride(0),
            q.stride(1),
            token_slots.stride(0),
            token_slots.stride(1) if token_slots.dim() == 3 else 0,
            *(split_strides or (0, 0, 0, 0)),
            split,
            sm_scale * _LOG2E,
            HQ=Hq,
            HKV=hkv,
            GROUP=group,
            BLOCK_M=max(16, next_pow2(group)),
            D=D,
            BLOCK_N=_BLOCK_N,
            SPLIT_KV=split_strides is not None,
            DOT_DTYPE=_dot_dtype(q.device, kv[0].dtype),
            num_warps=4,
            num_stages=2,
        )
    if not merged:
        return o_part, lse_part
    return lse_merge(o_part, lse_part, out_dtype=out_dtype)
