"""Triton log-sum-exp merge: one program per output row, parts streamed in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._checks import next_pow2
from qsa_kernels.lse_merge._validate import check_merge_args

__all__ = ("lse_merge",)


@triton.jit  # type: ignore[untyped-decorator]
def _lse_merge_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    o_ptr,  # [P, N, D] partial outputs (fp32 / bf16 / fp16), rows of D contiguous
    lse_ptr,  # [P, N] fp32 natural-log LSE of each part, -inf for an empty part
    o2_ptr,  # [P2, N, D] more parts, merged as if after the first ones (unread when P2 = 0)
    lse2_ptr,  # [P2, N] their LSE
    out_ptr,  # [N, D] merged output
    out_lse_ptr,  # [N] fp32 merged LSE
    P,
    P2,
    N,
    D,
    BLOCK_P: tl.constexpr,  # next_pow2(P): every part's LSE in one register tile
    BLOCK_P2: tl.constexpr,  # next_pow2(max(P2, 1))
    BLOCK_D: tl.constexpr,  # next_pow2(D)
):
    n = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    offs_q = tl.arange(0, BLOCK_P2)
    pmask = offs_p < P
    qmask = offs_q < P2
    lse = tl.load(lse_ptr + offs_p.to(tl.int64) * N + n, mask=pmask, other=float("-inf"))
    lse2 = tl.load(lse2_ptr + offs_q.to(tl.int64) * N + n, mask=qmask, other=float("-inf"))
    m = tl.maximum(tl.max(lse, axis=0), tl.max(lse2, axis=0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_safe))
    w2 = tl.where(lse2 == float("-inf"), 0.0, tl.exp(lse2 - m_safe))
    total = tl.sum(w, axis=0) + tl.sum(w2, axis=0)
    total_safe = tl.where(total > 0, total, 1.0)
    merged_lse = tl.where(total > 0, m_safe + tl.log(total_safe), float("-inf"))
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    live = pmask & (w > 0)
    live2 = qmask & (w2 > 0)
    parts = tl.load(
        o_ptr + (offs_p.to(tl.int64) * N + n)[:, None] * D + offs_d[None, :],
        mask=live[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    parts2 = tl.load(
        o2_ptr + (offs_q.to(tl.int64) * N + n)[:, None] * D + offs_d[None, :],
        mask=live2[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = tl.sum(parts * (w / total_safe)[:, None], axis=0)
    acc += tl.sum(parts2 * (w2 / total_safe)[:, None], axis=0)
    tl.store(out_ptr + n * D + offs_d, acc.to(out_ptr.dtype.element_ty), mask=dmask)
    tl.store(out_lse_ptr + n, merged_lse)


def lse_merge(
    outputs: torch.Tensor,
    lse: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    more: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``P`` partial attention results over disjoint key sets into one.

    With ``m = max_p lse[p]`` (taken as 0 when every part is empty), ``w_p = exp(lse[p] - m)``:
    ``out = Σ_p w_p · outputs[p] / Σ_p w_p`` and ``lse_out = m + log Σ_p w_p``, in fp32. A part
    with ``lse = -inf`` is empty: its weight is exactly 0 and its output is never read, so NaN or
    garbage there cannot leak. If every part is empty the output is 0 and the LSE ``-inf``.

    Args:
        outputs: ``[P, *N, D]`` partial outputs, fp32, bf16 or fp16 (the leading dims ``*N`` are
            any batch shape, e.g. ``[B, H]``).
        lse: ``[P, *N]`` fp32 natural-log log-sum-exp of each part's scores.
        out_dtype: dtype of the merged output (fp32, bf16 or fp16).
        more: ``(outputs [P2, *N, D], lse [P2, *N])``, parts of another kernel merged in the same
            launch, as if concatenated after ``outputs`` and ``lse`` (no concatenation runs).

    Returns:
        ``(out [*N, D] out_dtype, lse [*N] fp32)``.

    Raises:
        KernelInputError: On mismatched shapes, a bad dtype or mixed devices.
    """
    check_merge_args(outputs, lse, out_dtype, more)
    P = outputs.shape[0]
    batch = tuple(outputs.shape[1:-1])
    D = outputs.shape[-1]
    o = outputs.reshape(P, -1, D).contiguous()
    lse2 = lse.reshape(P, -1).contiguous()
    N = o.shape[1]
    if more is None:
        P2, o_more, lse_more = 0, o, lse2
    else:
        P2 = more[0].shape[0]
        o_more = more[0].reshape(P2, -1, D).contiguous()
        lse_more = more[1].reshape(P2, -1).contiguous()
    out = torch.empty((N, D), dtype=out_dtype, device=outputs.device)
    out_lse = torch.empty((N,), dtype=torch.float32, device=outputs.device)
    if N:
        _lse_merge_kernel[(N,)](
            o,
            lse2,
            o_more,
            lse_more,
            out,
            out_lse,
            P,
            P2,
            N,
            D,
            BLOCK_P=next_pow2(P),
            BLOCK_P2=next_pow2(max(P2, 1)),
            BLOCK_D=next_pow2(D),
            num_warps=4,
        )
    return out.view(*batch, D), out_lse.view(batch)
