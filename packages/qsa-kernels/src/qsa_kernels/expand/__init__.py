"""Block-to-token expansion of a QSA block selection, and its inverse.

:func:`expand_blocks` (Triton, beside its torch reference) turns block ids into token positions;
:func:`complete_blocks` (plain torch) reads the complete blocks a selection names.
"""

from qsa_kernels.expand._complete import complete_blocks
from qsa_kernels.expand.reference import expand_blocks_reference
from qsa_kernels.expand.triton import expand_blocks

__all__ = ("complete_blocks", "expand_blocks", "expand_blocks_reference")
