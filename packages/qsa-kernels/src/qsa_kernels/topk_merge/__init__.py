"""Distributed top-k candidate merge in the ``qsa_core`` order (Triton kernel, torch reference)."""

from qsa_kernels.topk_merge.reference import MergedTopK, merge_candidates_reference
from qsa_kernels.topk_merge.triton import merge_candidates

__all__ = ("MergedTopK", "merge_candidates", "merge_candidates_reference")
