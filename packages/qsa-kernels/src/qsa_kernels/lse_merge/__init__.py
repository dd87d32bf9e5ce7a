"""Log-sum-exp merge of partial attention outputs (split-K decode, sharded attention).

LSE is the natural log, as SGLang's and vLLM's kernels use; ``-inf`` marks an empty part.
"""

from qsa_kernels.lse_merge.reference import lse_merge_reference
from qsa_kernels.lse_merge.triton import lse_merge

__all__ = ("lse_merge", "lse_merge_reference")
