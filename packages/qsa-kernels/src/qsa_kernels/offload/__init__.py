"""The offloaded K/V of one rank: host arena, hot caches and open-block tails.

Composed from the decode-path kernels (fetch, write-back, sparse decode, LSE merge).
"""

from qsa_kernels.offload._store import KVComparison, OffloadedKV, OffloadGeometry, RowState

__all__ = ("KVComparison", "OffloadGeometry", "OffloadedKV", "RowState")
