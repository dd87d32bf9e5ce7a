"""QSA decode indexer: block scores and exact block top-k (Triton kernel and torch reference)."""

from qsa_kernels.indexer_topk.reference import indexer_scores_reference, indexer_topk_reference
from qsa_kernels.indexer_topk.triton import indexer_scores, indexer_topk

__all__ = (
    "indexer_scores",
    "indexer_scores_reference",
    "indexer_topk",
    "indexer_topk_reference",
)
