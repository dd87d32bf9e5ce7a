"""Per-head token lists of the offload's per-head records (DS-Offload's decode step).

Each KV head chooses its own tokens (``[B, Hkv, W]`` positions, ``-1`` padded). Two ops turn
that choice into what the store's fetch and decode read: :func:`head_blocks`, the distinct
complete blocks each head's tokens lie in (what the fetch makes resident), and
:func:`head_tokens`, each chosen token's row in the hot cache or in the open-block tail (what
the sparse decode reads). Each is one Triton launch for a whole layer; the references are the
torch operations they replace.
"""

from qsa_kernels.head_tokens.reference import head_blocks_reference, head_tokens_reference
from qsa_kernels.head_tokens.triton import head_blocks, head_tokens

__all__ = ("head_blocks", "head_blocks_reference", "head_tokens", "head_tokens_reference")
