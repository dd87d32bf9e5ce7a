"""The two CP collectives of QSA prefill over ``torch.distributed``: gather to global, and RS.

Both move rank-major buffers (every rank's ``R`` local rows, rank after rank) so that one
equal-size collective does the work, and the zigzag permutation is a local ``index_select`` on
one side of it. With a plan of ``C == 1`` and no initialised process group they run locally.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from qsa_kernels._errors import KernelInputError
from qsa_kernels.cp._plan import CPRowPlan, check_rows, zigzag_to_rank_major

__all__ = ("all_gather_global", "group_rank", "reduce_scatter_rank_major")

logger = logging.getLogger(__name__)

# torch renamed the tensor-in/tensor-out collectives (``*_into_tensor`` / ``*_tensor`` are
# deprecated aliases from 2.14); the declared floor is 2.11, which has only the old names.
_all_gather_single: Callable[..., Any] = (
    dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
)
_reduce_scatter_single: Callable[..., Any] = (
    dist.reduce_scatter_single
    if hasattr(dist, "reduce_scatter_single")
    else dist.reduce_scatter_tensor
)


def group_rank(plan: CPRowPlan, group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``, after checking the group has ``plan.cp_size`` ranks.

    With no initialised process group, a plan of ``C == 1`` is rank 0 (single-process use).

    Raises:
        KernelInputError: the group size is not ``C``, or no group exists and ``C > 1``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if plan.cp_size == 1 and group is None:
            return 0
        msg = (
            f"torch.distributed is not initialised; a plan of cp_size={plan.cp_size!r} needs a "
            "process group of that size (only cp_size=1 runs without one)"
        )
        raise KernelInputError(msg)
    size = dist.get_world_size(group)
    if size != plan.cp_size:
        msg = f"process group has {size!r} ranks; the plan's cp_size is {plan.cp_size!r}"
        raise KernelInputError(msg)
    return dist.get_rank(group)


def all_gather_global(
    local_rows: torch.Tensor, plan: CPRowPlan, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Gather every rank's local rows and return them in global (packed request) order.

    One all-gather of the ``[R, ...]`` local rows into a ``[C * R, ...]`` rank-major buffer, then
    one ``index_select`` by ``plan.inverse_index`` (padding rows dropped). This is what K/V and the
    raw indexer keys need before the pool write, the ring store and the block compression, whose
    write plans are in global order. To move K and V in one collective, stack them along a
    trailing dim first (``[R, 2, Hkv, D]``).

    Bytes per rank (ring all-gather): sends and receives ``(C - 1) * R * row_bytes``; allocates
    ``C * R * row_bytes`` plus the ``N * row_bytes`` result.

    Args:
        local_rows: ``[R, ...]`` this rank's rows as :func:`zigzag_shard` lays them out, any dtype
            the backend can gather, on ``plan.device``. Padding rows are never read into the
            result.
        plan: the row plan, identical on every rank.
        group: the CP process group of ``C`` ranks (``None``: the default group).

    Returns:
        ``[N, ...]`` global rows, same dtype, bit-identical to the rows each owner holds.

    Raises:
        KernelInputError: bad ``local_rows``, or the group size is not ``C``.
    """
    check_rows("local_rows", local_rows, plan, plan.rows_per_rank, "rows_per_rank R of the plan")
    group_rank(plan, group)
    if plan.cp_size == 1 or plan.rows_per_rank == 0:
        gathered = local_rows  # rank-major == local: identity (C == 1) or empty (N == 0)
    else:
        src = local_rows.contiguous()
        gathered = src.new_empty((plan.cp_size * plan.rows_per_rank, *src.shape[1:]))
        _all_gather_single(gathered, src, group=group)
    logger.debug("cp all-gather: %d rows per rank -> %d rows", plan.rows_per_rank, plan.total_rows)
    return gathered.index_select(0, plan.inverse_index)


def reduce_scatter_rank_major(
    partial_global_rows: torch.Tensor,
    plan: CPRowPlan,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Sum per-rank partial global rows over the group, landing each rank's zigzag rows directly.

    Each rank permutes its ``[N, ...]`` partial sums into the rank-major layout (padding rows zero)
    and one reduce-scatter (sum) hands chunk ``r`` to rank ``r``. The pinned invariant:
    ``reduce_scatter_rank_major(x_r)`` on rank ``r`` equals ``zigzag_shard(sum_r x_r, plan, r)``.
    It replaces an all-reduce of ``N`` rows followed by a local re-shard.

    Bytes per rank (ring reduce-scatter): sends and receives ``(C - 1) * R * row_bytes``, about
    half of the ``2 * (C - 1) / C * N * row_bytes`` of a ring all-reduce.

    Args:
        partial_global_rows: ``[N, ...]`` this rank's partial sums in global order, a dtype the
            backend can sum, on ``plan.device``.
        plan: the row plan, identical on every rank.
        group: the CP process group of ``C`` ranks (``None``: the default group).

    Returns:
        ``[R, ...]`` this rank's local rows of the sum, same dtype; padding rows are zero. The sum
        order is the backend's, so float results match a single-rank sum up to rounding (exactly
        for values whose sums are exact, such as small integers).

    Raises:
        KernelInputError: bad ``partial_global_rows``, or the group size is not ``C``.
    """
    rank_major = zigzag_to_rank_major(partial_global_rows, plan, pad=0)
    group_rank(plan, group)
    if plan.cp_size == 1 or plan.rows_per_rank == 0:
        return rank_major
    out = rank_major.new_empty((plan.rows_per_rank, *rank_major.shape[1:]))
    _reduce_scatter_single(out, rank_major, op=dist.ReduceOp.SUM, group=group)
    return out
