"""Block-to-token expansion of a QSA block selection (Triton kernel and torch reference)."""

from qsa_kernels.expand.reference import expand_blocks_reference
from qsa_kernels.expand.triton import expand_blocks

__all__ = ("expand_blocks", "expand_blocks_reference")
