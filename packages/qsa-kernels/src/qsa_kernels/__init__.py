"""Triton kernels for QSA HiSparse, each beside the torch reference that defines it.

Every op is a host-side launcher taking documented tensors; its reference (``*_reference``) lives in
the same subpackage, computes the same contract with plain torch, and is what tests and benchmarks
compare against.
"""

from importlib.metadata import version as _version

__version__: str = _version("qsa-kernels")

__all__ = (
    "__version__",
    # -- Decode data path: fetch, write-back, sparse decode, LSE merge --
    # -- Selection: indexer top-k, block expansion, distributed merge, double sparsity --
)
