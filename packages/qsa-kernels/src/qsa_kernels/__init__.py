"""Triton kernels for QSA HiSparse, each beside the torch reference that defines it.

Every op is a host-side launcher taking documented tensors; its reference (``*_reference``) lives in
the same subpackage, computes the same contract with plain torch, and is what tests and benchmarks
compare against. Each public name has one import path: the package root holds what every layer
shares; each op and each composed path is imported from its subpackage.

Ops (``<op>/triton.py`` beside ``<op>/reference.py``):

* decode data path: :mod:`qsa_kernels.fetch`, :mod:`qsa_kernels.writeback`,
  :mod:`qsa_kernels.sparse_decode`, :mod:`qsa_kernels.lse_merge`;
* selection: :mod:`qsa_kernels.indexer_topk`, :mod:`qsa_kernels.expand`,
  :mod:`qsa_kernels.topk_merge`, :mod:`qsa_kernels.ds_label`;
* embeddings: :mod:`qsa_kernels.int8_rows` (INT8-row tables, such as the PLE n-gram table, and
  the gather that reads the rows a batch names from host memory).

Composed paths (they call the ops' public functions): :mod:`qsa_kernels.offload` (one rank's
offloaded K/V), :mod:`qsa_kernels.sharded` (QSA cache sharding), :mod:`qsa_kernels.cp`
(context-parallel prefill), :mod:`qsa_kernels.double_sparsity` (DS decode and DS-Offload).
"""

from qsa_kernels._checks import kv_torch_dtype
from qsa_kernels._errors import DeviceUnavailableError, KernelInputError, QSAKernelError
from qsa_kernels._geometry import BLOCK_TOKENS, check_block_tokens
from qsa_kernels._path import KernelPath
from qsa_kernels._version import __version__

__all__ = (  # noqa: RUF022 (grouped by comment, sorted within each group)
    "__version__",
    # -- Errors --
    "DeviceUnavailableError",
    "KernelInputError",
    "QSAKernelError",
    # -- Shared by every layer: geometry, K/V dtype, which implementation runs --
    "BLOCK_TOKENS",
    "KernelPath",
    "check_block_tokens",
    "kv_torch_dtype",
)
