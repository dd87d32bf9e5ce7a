"""Torch reference of causal sparse GQA prefill, single-rank and context-parallel (fp32 math).

Selection format (QSA, after block expansion): ``token_index [rows, T]`` lists, for each query
row, positions inside the row's own request (``0`` is the request's first token). Entries below
``0`` are padding; entries above the row's own position are masked (causal), so an index list may
be wider than what a row can see. Entries should be distinct: a repeated entry is attended twice,
as a gather-then-attend kernel would.

What is reference and what would be a kernel: the gather of selected K/V and the fp32 softmax here
are plain torch and materialise ``[rows, T, Hkv, D]``; on GPU the per-row sparse attention is the
job of a sparse-GQA prefill kernel (one program per query row and KV head, online softmax over the
``T`` selected tokens, as upstream's ``sparse_gqa`` prefill), reading K/V in global order from the
buffer :func:`~qsa_kernels.cp.all_gather_global` returns. The collectives and permutations are the
real thing on every backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from qsa_core import ZigzagLayout
from qsa_kernels._checks import check_dim, check_dtype, check_ndim, check_same_device
from qsa_kernels._errors import KernelInputError
from qsa_kernels.cp._collectives import all_gather_global, group_rank
from qsa_kernels.cp._plan import CPRowPlan, check_rows, zigzag_positions

__all__ = ("cp_sparse_prefill_reference", "sparse_prefill_reference")

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX = (torch.int32, torch.int64)


def _check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_index: torch.Tensor
) -> tuple[int, int, int]:
    check_ndim("q", q, 3, "[rows, Hq, D]")
    check_ndim("k", k, 3, "[rows, Hkv, D]")
    check_ndim("v", v, 3, "[rows, Hkv, D]")
    check_ndim("token_index", token_index, 2, "[rows, T]")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, t, _FLOATS)
    check_dtype("token_index", token_index, _INDEX)
    check_same_device(q.device, k=k, v=v, token_index=token_index)
    rows, hq, d = q.shape
    hkv = k.shape[1]
    if hkv < 1 or hq % hkv != 0:
        msg = f"q has {hq!r} heads and k {hkv!r}; Hq must be a positive multiple of Hkv"
        raise KernelInputError(msg)
    check_dim("k", k, 2, d, "head dim D of q")
    if v.shape != k.shape:
        msg = f"v has shape {tuple(v.shape)!r}; expected k's {tuple(k.shape)!r}"
        raise KernelInputError(msg)
    check_dim("k", k, 0, rows, "one K row per q row")
    check_dim("token_index", token_index, 0, rows, "one index list per q row")
    return hq, hkv, d


def _scale(scale: float | None, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if not scale > 0:  # also rejects NaN
        msg = f"scale={scale!r} is not allowed; it must be a positive float (or None: 1/sqrt(D))"
        raise KernelInputError(msg)
    return float(scale)


def _attend(  # noqa: PLR0917 (private; one positional per tensor)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    token_index: torch.Tensor,
    row_start: torch.Tensor,
    row_position: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 sparse attention of query rows over global K/V; ``row_position < 0`` marks padding."""
    rows, hq, d = q.shape
    hkv = k.shape[1]
    idx = token_index.long()
    valid = (idx >= 0) & (idx <= row_position.unsqueeze(1))
    glob = torch.where(valid, idx + row_start.unsqueeze(1), 0)
    if k.shape[0] == 0:  # no keys at all: every row is empty
        valid = torch.zeros_like(valid)
        k = k.new_zeros((1, hkv, d))
        v = v.new_zeros((1, hkv, d))
    kg = k.float()[glob]  # [rows, T, Hkv, D]
    vg = v.float()[glob]
    qg = q.float().view(rows, hkv, hq // hkv, d)
    scores = torch.einsum("rhgd,rthd->rhgt", qg, kg) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [rows, Hkv, G], -inf for an empty row
    finite = torch.where(torch.isneginf(lse), 0.0, lse)
    probs = torch.exp(scores - finite.unsqueeze(-1))
    out = torch.einsum("rhgt,rthd->rhgd", probs, vg)
    return out.reshape(rows, hq, d), lse.reshape(rows, hq)


def sparse_prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    token_index: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-rank causal sparse GQA prefill of packed requests (reference, fp32 math).

    Query head ``h`` reads KV head ``h // (Hq // Hkv)``. A row attends the selected positions of
    its own request that are ``<=`` its own position.

    Args:
        q: ``[N, Hq, D]`` queries of the packed requests (fp32/bf16/fp16/fp64).
        k: ``[N, Hkv, D]`` keys, same rows.
        v: ``[N, Hkv, D]`` values, same rows.
        token_index: ``[N, T]`` int32/int64 in-request positions per row, ``< 0`` padding.
        seq_lens: tokens of each packed request, summing to ``N``.
        scale: softmax scale; ``None`` is ``1 / sqrt(D)``.

    Returns:
        ``(out [N, Hq, D] fp32, lse [N, Hq] fp32)``; LSE is the natural log of the sum of
        ``exp(scale * q.k)`` over the attended tokens, ``-inf`` (and ``out`` zero) for a row that
        attends nothing.

    Raises:
        KernelInputError: bad shapes, dtypes, devices, lengths or scale.
    """
    _, _, d = _check_qkv(q, k, v, token_index)
    layout = ZigzagLayout(1, tuple(seq_lens))
    if layout.total_rows != q.shape[0]:
        msg = (
            f"seq_lens={tuple(seq_lens)!r} sum to {layout.total_rows!r}; q has {q.shape[0]!r} rows"
        )
        raise KernelInputError(msg)
    plan = CPRowPlan.from_layout(layout, q.device)
    starts = plan.request_starts[plan.row_request.clamp_min(0)]
    return _attend(q, k, v, token_index, starts, plan.row_position, _scale(scale, d))


def cp_sparse_prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    token_index: torch.Tensor,
    plan: CPRowPlan,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel causal sparse GQA prefill: this rank's query rows over global K/V.

    K and V are stacked and all-gathered to global order in one collective
    (:func:`~qsa_kernels.cp.all_gather_global`, ``2 * Hkv * D`` elements per row); the attention
    then runs only for this rank's local rows, each at its absolute in-request position. The
    unshard (:func:`~qsa_kernels.cp.zigzag_unshard`) of every rank's result equals
    :func:`sparse_prefill_reference` on the global rows.

    Args:
        q: ``[R, Hq, D]`` this rank's query rows in zigzag local order (padding rows ignored).
        k: ``[R, Hkv, D]`` this rank's key rows.
        v: ``[R, Hkv, D]`` this rank's value rows.
        token_index: ``[R, T]`` int32/int64 in-request positions of this rank's rows (the
            indexer's selection for the local rows), ``< 0`` padding.
        plan: the row plan, identical on every rank, on ``q.device``.
        group: the CP process group of ``C`` ranks (``None``: the default group).
        scale: softmax scale; ``None`` is ``1 / sqrt(D)``.

    Returns:
        ``(out [R, Hq, D] fp32, lse [R, Hq] fp32)`` for the local rows; padding rows are zero and
        ``-inf``. Same LSE contract as :func:`sparse_prefill_reference`.

    Raises:
        KernelInputError: bad inputs, or the group size is not ``C``.
    """
    _, _, d = _check_qkv(q, k, v, token_index)
    check_rows("q", q, plan, plan.rows_per_rank, "rows_per_rank R of the plan")
    rank = group_rank(plan, group)
    if k.dtype != v.dtype:
        msg = f"k has dtype {k.dtype!r} and v {v.dtype!r}; they are gathered together"
        raise KernelInputError(msg)
    kv = all_gather_global(torch.stack((k, v), dim=1), plan, group=group)  # [N, 2, Hkv, D]
    request, position = zigzag_positions(plan, rank)
    starts = plan.request_starts[request.clamp_min(0)]
    return _attend(q, kv[:, 0], kv[:, 1], token_index, starts, position, _scale(scale, d))
