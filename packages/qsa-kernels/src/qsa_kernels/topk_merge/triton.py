"""Triton kernel for the distributed top-k candidate merge: one program sorts one row's keys.

Each valid candidate becomes the signed 64-bit key ``(ordered(score) << 32) | (0xFFFFFFFF - id)``
with ``ordered`` the fp32 bits mapped to a signed integer that increases with the value (``-0.0``
canonicalised first); padding becomes ``INT64_MIN``. Keys are unique for distinct ids, so a
descending bitonic sort (``tl.sort``) gives the exact merge order, and position ``c`` of the sorted
keys is rank ``c``. The score and id are unpacked from the key, so the output needs no gather.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._errors import KernelInputError
from qsa_kernels._topk_keys import KEY_NONE_JIT
from qsa_kernels._topk_select import pack_key
from qsa_kernels.topk_merge.reference import MergedTopK, check_merge_inputs

__all__ = ("merge_candidates",)

#: Candidates per row up to which one program sorts the whole row.
SORT_MAX = 2048
_PACK_BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator]
def _merge_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    s_ptr,  # [R, rows, k] fp32 candidate scores
    i_ptr,  # [R, rows, k] int32 candidate ids, negative = padding
    out_s_ptr,  # [rows, TOPK] fp32
    out_i_ptr,  # [rows, TOPK] int32
    k,
    stride_sr,
    stride_sw,
    stride_ir,
    stride_iw,
    stride_os,
    stride_oi,
    TOTAL: tl.constexpr,  # constexpr: ranks * k, the candidates per row
    N_PAD: tl.constexpr,  # constexpr: TOTAL rounded up to a power of two for tl.sort
    TOPK: tl.constexpr,  # constexpr: outputs per row
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, N_PAD)
    m = c < TOTAL
    rank = (c // k).to(tl.int64)
    pos = (c % k).to(tl.int64)
    s = tl.load(s_ptr + rank * stride_sr + row * stride_sw + pos, mask=m, other=0.0)
    ids = tl.load(i_ptr + rank * stride_ir + row * stride_iw + pos, mask=m, other=-1)
    s = tl.where(s == 0.0, 0.0, s)
    u = s.to(tl.int32, bitcast=True)
    ordered = tl.where(u >= 0, u, u ^ 0x7FFFFFFF).to(tl.int64)
    key = (ordered << 32) | (4294967295 - ids.to(tl.int64))
    key = tl.where(ids >= 0, key, KEY_NONE_JIT)
    key = tl.sort(key, descending=True)
    valid = key != KEY_NONE_JIT
    hi = (key >> 32).to(tl.int32)
    bits = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF)
    score = tl.where(valid, bits.to(tl.float32, bitcast=True), float("-inf"))
    gid = tl.where(valid, 4294967295 - (key & 4294967295), -1).to(tl.int32)
    keep = c < TOPK
    tl.store(out_s_ptr + row * stride_os + c, score, mask=keep)
    tl.store(out_i_ptr + row * stride_oi + c, gid, mask=keep)


@triton.jit  # type: ignore[untyped-decorator]
def _merge_pack_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    s_ptr,  # [R, rows, k] fp32
    i_ptr,  # [R, rows, k] int32, negative = padding
    key_ptr,  # [rows, R * k] int64
    k,
    total,
    stride_sr,
    stride_sw,
    stride_ir,
    stride_iw,
    stride_key,
    BLOCK: tl.constexpr,  # constexpr: candidates per program
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < total
    rank = (c // k).to(tl.int64)
    pos = (c % k).to(tl.int64)
    s = tl.load(s_ptr + rank * stride_sr + row * stride_sw + pos, mask=m, other=0.0)
    ids = tl.load(i_ptr + rank * stride_ir + row * stride_iw + pos, mask=m, other=-1)
    tl.store(key_ptr + row * stride_key + c, pack_key(s, ids, ids >= 0), mask=m)


@triton.jit  # type: ignore[untyped-decorator]
def _merge_unpack_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    key_ptr,  # [rows, TOPK] int64, best first
    out_s_ptr,  # [rows, TOPK] fp32
    out_i_ptr,  # [rows, TOPK] int32
    stride_key,
    stride_os,
    stride_oi,
    TOPK: tl.constexpr,  # constexpr: outputs per row
    BLOCK: tl.constexpr,  # constexpr: outputs per program
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < TOPK
    key = tl.load(key_ptr + row * stride_key + c, mask=m, other=KEY_NONE_JIT)
    valid = key != KEY_NONE_JIT
    hi = (key >> 32).to(tl.int32)
    bits = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF)
    score = tl.where(valid, bits.to(tl.float32, bitcast=True), float("-inf"))
    gid = tl.where(valid, 4294967295 - (key & 4294967295), -1).to(tl.int32)
    tl.store(out_s_ptr + row * stride_os + c, score, mask=m)
    tl.store(out_i_ptr + row * stride_oi + c, gid, mask=m)


def _merge_by_topk(scores: torch.Tensor, ids: torch.Tensor, out: MergedTopK) -> None:
    ranks, rows, k = scores.shape
    total = ranks * k
    k_out = out.ids.shape[1]
    keys = torch.empty((rows, total), dtype=torch.int64, device=scores.device)
    _merge_pack_kernel[(rows, triton.cdiv(total, _PACK_BLOCK))](
        scores,
        ids,
        keys,
        k,
        total,
        scores.stride(0),
        scores.stride(1),
        ids.stride(0),
        ids.stride(1),
        keys.stride(0),
        BLOCK=_PACK_BLOCK,
        num_warps=4,
    )
    top = torch.topk(keys, k_out, dim=1, sorted=True).values
    _merge_unpack_kernel[(rows, triton.cdiv(k_out, _PACK_BLOCK))](
        top,
        out.scores,
        out.ids,
        top.stride(0),
        out.scores.stride(0),
        out.ids.stride(0),
        TOPK=k_out,
        BLOCK=_PACK_BLOCK,
        num_warps=4,
    )


def merge_candidates(
    scores: torch.Tensor,
    ids: torch.Tensor,
    *,
    topk: int | None = None,
    check_nan: bool = True,
    out: MergedTopK | None = None,
) -> MergedTopK:
    """Merge per-rank candidates into the global top-k (see :func:`merge_candidates_reference`).

    Args:
        scores: ``[ranks, rows, k]`` fp32, unit stride on the last dim.
        ids: ``[ranks, rows, k]`` int32 global ids in ``[0, 2**32)``, ``-1`` for padding.
        topk: how many to keep, ``1 <= topk <= ranks * k``; default ``k``.
        check_nan: reject NaN scores (one device-to-host sync); pass ``False`` only when the
            producer guarantees finite scores (a NaN then sorts at an unspecified place).
        out: optional ``[rows, topk]`` destinations (fp32, int32); every element is written.

    Returns:
        :class:`MergedTopK` ``[rows, topk]``, best first, ``(-inf, -1)`` padding.
    """
    k_out = scores.shape[2] if topk is None and scores.dim() == 3 else (topk or 0)
    check_merge_inputs(scores, ids, k_out, check_nan=check_nan)
    ranks, rows, k = scores.shape
    if out is None:
        out = MergedTopK(
            torch.empty((rows, k_out), dtype=torch.float32, device=scores.device),
            torch.empty((rows, k_out), dtype=torch.int32, device=scores.device),
        )
    for t, dtype in ((out.scores, torch.float32), (out.ids, torch.int32)):
        if tuple(t.shape) != (rows, k_out) or t.dtype != dtype or t.stride(-1) != 1:
            msg = (
                f"out tensors must be {(rows, k_out)!r} {dtype!r}, got {tuple(t.shape)!r} "
                f"{t.dtype!r}"
            )
            raise KernelInputError(msg)
    if rows == 0:
        return out
    scores = scores.contiguous()
    ids = ids.contiguous()
    total = ranks * k
    if total > SORT_MAX:
        _merge_by_topk(scores, ids, out)
        return out
    _merge_kernel[(rows,)](
        scores,
        ids,
        out.scores,
        out.ids,
        k,
        scores.stride(0),
        scores.stride(1),
        ids.stride(0),
        ids.stride(1),
        out.scores.stride(0),
        out.ids.stride(0),
        TOTAL=total,
        N_PAD=triton.next_power_of_2(total),
        TOPK=k_out,
        num_warps=8,
    )
    return out
