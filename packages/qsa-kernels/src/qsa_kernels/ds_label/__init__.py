"""Double-sparsity label scores and heavy-token selection (Triton kernel and torch reference)."""

from qsa_kernels.ds_label.reference import LabelTopK, label_keys_reference, label_topk_reference
from qsa_kernels.ds_label.triton import label_topk

__all__ = ("LabelTopK", "label_keys_reference", "label_topk", "label_topk_reference")
