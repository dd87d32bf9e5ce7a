"""One rank's request offload: the planner, the stores (host arena, hot caches, tails), the runtime.

The planner (host side: rows, their lengths, the planned decode step and its padding rows) and
the stores (device side, one per record layout) split like a manager and its workers: the stores
compose the decode-path kernels (fetch, write-back, sparse decode, LSE merge) into the data path
of one rank. :class:`OffloadedKV` keeps one record per block of every KV head and attends QSA's
block selection (under a shard group over the rank's own pages); :class:`PerHeadOffloadedKV`
keeps one record per KV head and attends tokens chosen per head (double sparsity).
:class:`OffloadRuntime` is what an engine's attention backend calls: request slots bound to rows,
one prompt's staging, the hand-off, the planned decode step and its counters; the engine describes
its layers as an :class:`OffloadLayout` and a prefill batch as :func:`chunk_spans`.
"""

from qsa_kernels.offload._block_store import OffloadedKV
from qsa_kernels.offload._engine import ChunkSpan, OffloadLayout, chunk_spans
from qsa_kernels.offload._head_store import PerHeadOffloadedKV
from qsa_kernels.offload._plan import RowState
from qsa_kernels.offload._runtime import (
    LOG_EVERY_STEPS,
    CopyFence,
    OffloadCounts,
    OffloadRuntime,
    OffloadStateError,
)
from qsa_kernels.offload._store import KVComparison, OffloadGeometry

__all__ = (
    "LOG_EVERY_STEPS",
    "ChunkSpan",
    "CopyFence",
    "KVComparison",
    "OffloadCounts",
    "OffloadGeometry",
    "OffloadLayout",
    "OffloadRuntime",
    "OffloadStateError",
    "OffloadedKV",
    "PerHeadOffloadedKV",
    "RowState",
    "chunk_spans",
)
