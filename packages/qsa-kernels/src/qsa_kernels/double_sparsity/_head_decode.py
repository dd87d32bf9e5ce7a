"""Sparse GQA decode where each KV head attends to its own selected tokens.

:func:`qsa_kernels.sparse_decode` takes one token list per request row, shared by all KV heads;
double sparsity selects tokens per (row, KV head). This kernel is the same split-K flash decode
with one change: the token list is read at ``token_slots[b, h]`` for the program of KV head ``h``.
One launch serves every head (no per-head launches, no union), and the split parts are merged by
:func:`qsa_kernels.lse_merge`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qsa_kernels._checks import next_pow2
from qsa_kernels._errors import KernelInputError
from qsa_kernels.lse_merge import lse_merge
from qsa_kernels.sparse_decode import gather_selected_kv
from qsa_kernels.sparse_decode._validate import check_decode_args

__all__ = ("head_sparse_decode", "head_sparse_decode_reference")

_LOG2E = math.log2(math.e)
_BLOCK_N = 64


@triton.jit  # type: ignore[untyped-decorator]
def _head_decode_split_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    q_ptr,  # [B, Hq, D] bf16
    tok_ptr,  # [B, Hkv, T] int32 token slots (4 * record + token), -1 padding
    kv_ptr,  # [NS, 2, 4, Hkv, D] fp8 e4m3 / bf16 records
    o_ptr,  # [P, B, Hq, D] fp32 partial outputs
    lse_ptr,  # [P, B, Hq] fp32 partial natural-log LSE, -inf for an empty split
    B,
    T,
    stride_qb,
    stride_qh,
    stride_tb,
    stride_th,
    split,  # tokens per program, a multiple of BLOCK_N
    qk_scale,  # softmax scale * log2(e): scores kept in base 2
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # max(16, next_pow2(GROUP)): the dot's minimum M tile
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # bf16 on GPUs; fp32 under the CPU interpreter
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
    tok_base = tok_ptr + b.to(tl.int64) * stride_tb + h.to(tl.int64) * stride_th
    start = p * split
    for n0 in range(0, split, BLOCK_N):
        offs_n = start + n0 + tl.arange(0, BLOCK_N)
        tok = tl.load(tok_base + offs_n, mask=offs_n < T, other=-1)
        valid = tok >= 0
        tok64 = tl.where(valid, tok, 0).to(tl.int64)
        row = ((tok64 // 4) * 8 + tok64 % 4) * HKV + h
        k = tl.load(kv_ptr + row[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(
            kv_ptr + (row + 4 * HKV)[:, None] * D + offs_d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
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


def _check_head_slots(token_slots: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    hkv = kv_cache.shape[3] if kv_cache.dim() == 5 else -1
    if (
        token_slots.dim() != 3
        or token_slots.shape[0] != q.shape[0]
        or token_slots.shape[1] != hkv
        or token_slots.dtype != torch.int32
    ):
        msg = (
            f"token_slots must be [B={q.shape[0]}, Hkv={hkv}, T] int32; got "
            f"{tuple(token_slots.shape)!r} {token_slots.dtype!r}"
        )
        raise KernelInputError(msg)


def _split_args(
    q: torch.Tensor, token_slots: torch.Tensor, kv_cache: torch.Tensor, scale: float | None
) -> float:
    _check_head_slots(token_slots, q, kv_cache)
    # the shared checks see one head's [B, T] list; the rest is sparse_decode's contract
    return check_decode_args(q, token_slots[:, 0], kv_cache, scale)


def head_sparse_decode(
    q: torch.Tensor,
    token_slots: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse GQA decode with a token list per (row, KV head).

    For row ``b`` and query head ``h`` of KV head ``g = h // (Hq / Hkv)``: ``out = softmax(scale ·
    q · Kᵀ) · V`` and ``lse = log Σ exp(scale · q · Kᵀ)`` (natural log) over the tokens
    ``token_slots[b, g, t] != -1``. A (row, head) with no token gets ``out = 0``, ``lse = -inf``.
    Dots in bf16 (FP8 upcast unscaled) with fp32 accumulation.

    Args:
        q: ``[B, Hq, D]`` bf16; ``D`` a power of two >= 16; ``Hq`` a multiple of ``Hkv``.
        token_slots: ``[B, Hkv, T]`` int32 token slots ``4 * record + token``, ``-1`` padding
            anywhere; unit stride on ``T``.
        kv_cache: ``[NS, 2, 4, Hkv, D]`` FP8 E4M3 / bf16 records (K rows, then V rows), contiguous.
        scale: softmax scale, ``1 / sqrt(D)`` if ``None``.
        num_splits: programs per (row, KV head) along ``T``; from ``T`` if ``None``.

    Returns:
        ``(out [B, Hq, D] bf16, lse [B, Hq] fp32)``.

    Raises:
        KernelInputError: on a bad shape, dtype, device or layout.
    """
    sm_scale = _split_args(q, token_slots, kv_cache, scale)
    B, Hq, D = q.shape
    _, Hkv, T = token_slots.shape
    group = Hq // Hkv
    if num_splits is None:
        sms = 8
        if q.device.type == "cuda":
            sms = int(torch.cuda.get_device_properties(q.device).multi_processor_count)
        num_splits = max(1, min(-(-2 * sms // max(B * Hkv, 1)), -(-T // _BLOCK_N)))
    split = max(
        _BLOCK_N, triton.cdiv(triton.cdiv(max(T, 1), max(num_splits, 1)), _BLOCK_N) * _BLOCK_N
    )
    P = max(1, triton.cdiv(T, split))
    o_part = torch.empty((P, B, Hq, D), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((P, B, Hq), dtype=torch.float32, device=q.device)
    if B:
        _head_decode_split_kernel[(B, Hkv, P)](
            q,
            token_slots,
            kv_cache,
            o_part,
            lse_part,
            B,
            T,
            q.stride(0),
            q.stride(1),
            token_slots.stride(0),
            token_slots.stride(1),
            split,
            sm_scale * _LOG2E,
            HQ=Hq,
            HKV=Hkv,
            GROUP=group,
            BLOCK_M=max(16, next_pow2(group)),
            D=D,
            BLOCK_N=_BLOCK_N,
            DOT_DTYPE=tl.bfloat16 if q.device.type == "cuda" else tl.float32,
            num_warps=4,
            num_stages=2,
        )
    return lse_merge(o_part, lse_part, out_dtype=torch.bfloat16)


def head_sparse_decode_reference(
    q: torch.Tensor,
    token_slots: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`head_sparse_decode`: gather each head's tokens, attend in fp32."""
    sm_scale = _split_args(q, token_slots, kv_cache, scale)
    B, Hq, D = q.shape
    Hkv = kv_cache.shape[3]
    group = Hq // Hkv
    out = torch.empty((B, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, Hq), dtype=torch.float32, device=q.device)
    for g in range(Hkv):
        k, v, valid = gather_selected_kv(token_slots[:, g], kv_cache)  # [B, Hkv, T, D]
        qg = q[:, g * group : (g + 1) * group].float()  # [B, G, D]
        s = torch.einsum("bgd,btd->bgt", qg, k[:, g].float()) * sm_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        head_lse = torch.logsumexp(s, dim=-1)
        finite = torch.where(torch.isneginf(head_lse), 0.0, head_lse)
        probs = torch.exp(s - finite.unsqueeze(-1))
        out[:, g * group : (g + 1) * group] = torch.einsum("bgt,btd->bgd", probs, v[:, g].float())
        lse[:, g * group : (g + 1) * group] = head_lse
    return out.to(torch.bfloat16), lse
