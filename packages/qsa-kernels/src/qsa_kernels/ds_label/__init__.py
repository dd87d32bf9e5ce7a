"""Double-sparsity label scores and heavy-token selection (Triton kernel and torch reference)."""

from qsa_kernels.ds_label.reference import (
    LabelTopK,
    fixed_width_lists_reference,
    label_keys_reference,
    label_topk_reference,
)
from qsa_kernels.ds_label.triton import fixed_width_lists, label_topk

__all__ = (
    "LabelTopK",
    "fixed_width_lists",
    "fixed_width_lists_reference",
    "label_keys_reference",
    "label_topk",
    "label_topk_reference",
)
