"""Triton kernel for double-sparsity label scores; selection reuses the exact radix top-k.

One program scores ``BLOCK_T`` context tokens of one request and KV head: it gathers the label rows
through ``req_to_token`` (``C`` channels each, the only key bytes read), gathers the group's query
heads at the heavy channels, and forms ``[BLOCK_T, C] x [C, G]`` on tensor cores, summed over the
group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._checks import check_unit_last_stride, list_tile
from qsa_kernels._topk_select import interpreting, row_topk
from qsa_kernels.ds_label.reference import LabelTopK, check_fixed_width_args, check_label_inputs

__all__ = ("fixed_width_lists", "label_topk")

_BLOCK_T = 128


@triton.jit  # type: ignore[untyped-decorator]
def _label_score_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    q_ptr,  # [B, Hq, D] bf16 / fp16 / fp32
    lab_ptr,  # [slots, Hkv, C] bf16 / fp16
    ch_ptr,  # [Hkv, C] int32 / int64
    r2t_ptr,  # [B, S] int32 / int64
    len_ptr,  # [B] int32 / int64
    out_ptr,  # [B, Hkv, S] fp32
    width,
    stride_qb,
    stride_qh,
    stride_ls,
    stride_lh,
    stride_ch,
    stride_rb,
    stride_ob,
    stride_oh,
    C: tl.constexpr,  # constexpr: heavy channels per head (e.g. 16, 32)
    C_PAD: tl.constexpr,  # constexpr: C rounded up to a power of two, >= 16 for tl.dot
    G: tl.constexpr,  # constexpr: query heads per KV head
    G_PAD: tl.constexpr,  # constexpr: G rounded up to a power of two, >= 16 for tl.dot
    BLOCK_T: tl.constexpr,  # constexpr: tokens per program
    DOT_FP32: tl.constexpr,  # constexpr: fp32 operands in the interpreter
):
    # Token tiles on grid axis 0: axes 1 and 2 stop at 65,535 programs (8.4M tokens here).
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    g = tl.program_id(2).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int32), 0), width)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    obase = out_ptr + b * stride_ob + g * stride_oh
    if tile * BLOCK_T < n:
        m = t < n
        slot = tl.load(r2t_ptr + b * stride_rb + t, mask=m, other=0).to(tl.int64)
        cc = tl.arange(0, C_PAD)
        cm = cc < C
        lab = tl.load(
            lab_ptr + slot[:, None] * stride_ls + g * stride_lh + cc[None, :],
            mask=m[:, None] & cm[None, :],
            other=0.0,
        )
        ch = tl.load(ch_ptr + g * stride_ch + cc, mask=cm, other=0).to(tl.int64)
        hh = tl.arange(0, G_PAD)
        qv = tl.load(
            q_ptr + b * stride_qb + (g * G + hh)[:, None] * stride_qh + ch[None, :],
            mask=(hh[:, None] < G) & cm[None, :],
            other=0.0,
        )
        if DOT_FP32:
            dots = tl.dot(lab.to(tl.float32), tl.trans(qv.to(tl.float32)), input_precision="ieee")
        else:
            dots = tl.dot(lab.to(tl.bfloat16), tl.trans(qv.to(tl.bfloat16)))
        score = tl.where(m, tl.sum(dots, 1), float("-inf"))
    else:
        score = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    tl.store(obase + t, score, mask=t < width)


def label_topk(
    q: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    heavy_token_num: int,
) -> LabelTopK:
    """Label scores and heavy tokens; contract of :func:`label_topk_reference`.

    The query is rounded to bf16 for the tensor-core product (bf16 queries are used as they are);
    products and sums are fp32, so scores match the reference to fp32 rounding, and the selection
    is exact over the kernel's scores.

    Args:
        q: ``[B, Hq, D]`` bf16/fp16/fp32, unit stride on ``D``.
        label_cache: ``[slots, Hkv, C]`` bf16/fp16, unit stride on ``C``.
        channels: ``[Hkv, C]`` int32/int64 heavy channels.
        req_to_token: ``[B, S]`` int32/int64 slots.
        seq_lens: ``[B]`` int32/int64 context lengths.
        heavy_token_num: tokens to keep per request and KV head.

    Returns:
        :class:`LabelTopK` (``[B, Hkv, S]`` fp32 scores, ``[B, Hkv, heavy_token_num]`` int32).
    """
    check_label_inputs(q, label_cache, channels, req_to_token, seq_lens, heavy_token_num)
    batch, hq, _ = q.shape
    _, hkv, c = label_cache.shape
    width = req_to_token.shape[1]
    check_unit_last_stride(q=q, label_cache=label_cache)
    scores = torch.empty((batch, hkv, width), dtype=torch.float32, device=q.device)
    positions = torch.empty((batch, hkv, heavy_token_num), dtype=torch.int32, device=q.device)
    if batch == 0 or width == 0:
        positions.fill_(-1)
        return LabelTopK(scores, positions)
    channels = channels.contiguous()
    req_to_token = req_to_token.contiguous()
    group = hq // hkv
    grid = (triton.cdiv(width, _BLOCK_T), batch, hkv)
    _label_score_kernel[grid](
        q,
        label_cache,
        channels,
        req_to_token,
        seq_lens,
        scores,
        width,
        q.stride(0),
        q.stride(1),
        label_cache.stride(0),
        label_cache.stride(1),
        channels.stride(0),
        req_to_token.stride(0),
        scores.stride(0),
        scores.stride(1),
        C=c,
        C_PAD=max(16, triton.next_power_of_2(c)),
        G=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_T=_BLOCK_T,
        DOT_FP32=interpreting(),
        num_warps=4,
    )
    lengths = seq_lens.repeat_interleave(hkv)
    row_topk(
        scores.view(batch * hkv, width),
        lengths,
        heavy_token_num,
        positions.view(-1, heavy_token_num),
    )
    return LabelTopK(scores, positions)


@triton.jit  # type: ignore[untyped-decorator]
def _fixed_width_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    chosen_ptr,  # [B, Hkv, HEAVY] int32 heavy-token positions
    len_ptr,  # [B] int32 / int64 context lengths
    out_ptr,  # [B, Hkv, W] int32 lists
    HKV,
    W,
    HEAVY,
    threshold,
    BLOCK_W: tl.constexpr,  # next_pow2(W)
):
    g = tl.program_id(0)  # b * Hkv + h
    n = tl.load(len_ptr + g // HKV)
    offs = tl.arange(0, BLOCK_W)
    chosen = tl.load(chosen_ptr + g.to(tl.int64) * HEAVY + offs, mask=offs < HEAVY, other=-1)
    ramp = tl.where(offs < n, offs, -1)
    sparse = (n >= threshold) & (n > HEAVY)
    lists = tl.where(sparse, chosen, ramp)
    tl.store(out_ptr + g.to(tl.int64) * W + offs, lists, mask=offs < W)


def fixed_width_lists(
    chosen: torch.Tensor, seq_lens: torch.Tensor, *, width: int, threshold: int
) -> torch.Tensor:
    """Every row's token list at one width, in one launch (CUDA-graph capturable).

    Same contract as :func:`qsa_kernels.ds_label.fixed_width_lists_reference`: a sparse row's
    heavy tokens, a dense row's whole context, ``-1`` padded to ``width``.

    Args:
        chosen: ``[B, Hkv, heavy]`` int32 heavy-token positions.
        seq_lens: ``[B]`` int32/int64 device context lengths.
        width: the lists' width, at least ``heavy``.
        threshold: the sparse-decode threshold.

    Returns:
        ``[B, Hkv, width]`` int32 positions.

    Raises:
        KernelInputError: a bad shape, dtype or device, or ``width < heavy``.
    """
    check_fixed_width_args(chosen, seq_lens, width, threshold)
    batch, hkv, heavy = chosen.shape
    out = torch.empty((batch, hkv, width), dtype=torch.int32, device=chosen.device)
    if batch * hkv and width:
        tile, warps = list_tile(width)
        _fixed_width_kernel[(batch * hkv,)](
            chosen.contiguous(), seq_lens, out, hkv, width, heavy, threshold,
            BLOCK_W=tile, num_warps=warps,
        )  # fmt: skip
    return out
