"""One rank's request offload: the store (host arena, hot caches, open-block tails) and its runtime.

:class:`OffloadedKV` composes the decode-path kernels (fetch, write-back, sparse decode, LSE
merge) into the data path of one rank; :class:`OffloadRuntime` is what an engine's attention
backend calls: request slots bound to rows, one prompt's staging, the hand-off, the planned
decode step and its counters.
"""

from qsa_kernels.offload._runtime import (
    LOG_EVERY_STEPS,
    CopyFence,
    OffloadCounts,
    OffloadRuntime,
    OffloadStateError,
)
from qsa_kernels.offload._store import KVComparison, OffloadedKV, OffloadGeometry, RowState

__all__ = (
    "LOG_EVERY_STEPS",
    "CopyFence",
    "KVComparison",
    "OffloadCounts",
    "OffloadGeometry",
    "OffloadRuntime",
    "OffloadStateError",
    "OffloadedKV",
    "RowState",
)
