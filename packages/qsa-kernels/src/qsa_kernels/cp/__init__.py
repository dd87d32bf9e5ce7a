"""Context parallelism for QSA prefill: zigzag rows, their two collectives, attention references.

With ``C`` CP ranks each packed request is cut into ``2C`` blocks and rank ``r`` holds blocks ``r``
and ``2C-1-r`` (:class:`qsa_core.ZigzagLayout`), padded to equal per-rank row counts ``R``.
:class:`CPRowPlan` turns the layout into index tensors; the shard, unshard and rank-major
permutations are single ``index_select`` copies; :func:`all_gather_global` (one all-gather) gives
every rank the global rows that K/V, the ring store and the block compression need;
:func:`reduce_scatter_rank_major` (one reduce-scatter) lands each rank's zigzag rows of a sum of
partial global rows. The attention functions are fp32 torch references of causal sparse GQA prefill.
"""

from qsa_kernels.cp._collectives import all_gather_global, reduce_scatter_rank_major
from qsa_kernels.cp._plan import (
    CPRowPlan,
    zigzag_positions,
    zigzag_shard,
    zigzag_to_rank_major,
    zigzag_unshard,
)
from qsa_kernels.cp.reference import cp_sparse_prefill_reference, sparse_prefill_reference

__all__ = (  # noqa: RUF022 (grouped by comment, sorted within each group)
    # -- Layout: index tensors and local permutations --
    "CPRowPlan",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_to_rank_major",
    "zigzag_unshard",
    # -- Collectives --
    "all_gather_global",
    "reduce_scatter_rank_major",
    # -- Attention references --
    "cp_sparse_prefill_reference",
    "sparse_prefill_reference",
)
