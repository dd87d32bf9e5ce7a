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
    out_ptr,  # [N, D] merged output
    out_lse_ptr,  # [N] fp32 merged LSE
    P,
    N,
    D,
    BLOCK_P: tl.constexpr,  # next_pow2(P): every part's LSE in one register tile
    BLOCK_D: tl.constexpr,  # next_pow2(D)
):
    n = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    pmask = offs_p < P
    lse = tl.load(lse_ptr + offs_p.to(tl.int64) * N + n, mask=pmask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_safe))
    total = tl.sum(w, axis=0)
    total_safe = tl.where(total > 0, total, 1.0)
    merged_lse = tl.where(total > 0, m_safe + tl.log(total_safe), float("-inf"))
    scale = w / total_safe
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    live = pmask & (w > 0)
    parts = tl.load(
        o_ptr + (offs_p.to(tl.int64) * N + n)[:, None] * D + offs_d[None, :],
        mask=live[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = tl.sum(parts * scale[:, None], axis=0)
    tl.store(out_ptr + n * D + offs_d, acc.to(out_ptr.dtype.element_ty), mask=dmask)
    tl.store(out_lse_ptr + n, merged_lse)


def lse_merge(
    outputs: torch.Tensor, lse: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
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

    Returns:
        ``(out [*N, D] out_dtype, lse [*N] fp32)``.

    Raises:
        KernelInputError: On mismatched shapes, a bad dtype or mixed devices.
    """
    check_merge_args(outputs, lse, out_dtype)
    P = outputs.shape[0]
    batch = tuple(outputs.shape[1:-1])
    D = outputs.shape[-1]
    o = outputs.reshape(P, -1, D).contiguous()
    lse2 = lse.reshape(P, -1).contiguous()
    N = o.shape[1]
    out = torch.empty((N, D), dtype=out_dtype, device=outputs.device)
    out_lse = torch.empty((N,), dtype=torch.float32, device=outputs.device)
    if N:
        _lse_merge_kernel[(N,)](
            o,
            lse2,
            out,
            out_lse,
            P,
            N,
            D,
            BLOCK_P=next_pow2(P),
            BLOCK_D=next_pow2(D),
            num_warps=4,
        )
    return out.view(*batch, D), out_lse.view(batch)
