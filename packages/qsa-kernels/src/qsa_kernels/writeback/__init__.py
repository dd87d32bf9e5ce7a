"""Device-to-host write-back: closed blocks of the hot cache, and a whole prompt after prefill.

Both copies run on a side stream and hand back a completion event; their torch references
(``*_reference``) are synchronous.
"""

from qsa_kernels.writeback.reference import offload_prompt_reference, writeback_blocks_reference
from qsa_kernels.writeback.triton import offload_prompt, writeback_blocks

__all__ = (
    "offload_prompt",
    "offload_prompt_reference",
    "writeback_blocks",
    "writeback_blocks_reference",
)
