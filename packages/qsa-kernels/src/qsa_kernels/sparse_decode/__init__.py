"""Sparse GQA decode over the selected tokens of a hot cache, returning the natural-log LSE."""

from qsa_kernels.sparse_decode.reference import (
    gather_selected_kv,
    sparse_decode_reference,
    sparse_decode_split_reference,
)
from qsa_kernels.sparse_decode.triton import sparse_decode, sparse_decode_split

__all__ = (
    "gather_selected_kv",
    "sparse_decode",
    "sparse_decode_reference",
    "sparse_decode_split",
    "sparse_decode_split_reference",
)
