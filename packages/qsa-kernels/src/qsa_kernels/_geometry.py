"""The QSA geometry the kernels are built for, taken from qsa-core's Qwen3.8-Flash-Next profile.

Every kernel and composed path reads these names from here; nothing else in the package spells
the numbers. A model whose profile differs (another compress ratio, page or index shape) is
refused where it meets the kernels (the plugin checks the profile at start-up).
"""

from __future__ import annotations

from typing import Final

from qsa_core import QWEN38_FLASH_NEXT
from qsa_kernels._errors import KernelInputError

__all__ = (
    "BLOCKS_PER_PAGE",
    "BLOCK_TOKENS",
    "INDEX_HEADS",
    "INDEX_HEAD_DIM",
    "RECORD_ROWS",
    "TAIL_TOKENS",
    "check_block_tokens",
)

#: Tokens per QSA block (the compress ratio): an arena, hot-cache or tail record holds one block.
BLOCK_TOKENS: Final = QWEN38_FLASH_NEXT.compress_ratio
#: Rows of ``D`` elements in one per-head record (DS-Offload): its 4 K rows, then its 4 V rows.
RECORD_ROWS: Final = 2 * BLOCK_TOKENS
#: Tokens of a row's open block that a decode step may read from its tail (a fourth closes it).
TAIL_TOKENS: Final = BLOCK_TOKENS - 1
#: Compressed blocks per page of the index-key cache (``page_size // compress_ratio``).
BLOCKS_PER_PAGE: Final = QWEN38_FLASH_NEXT.blocks_per_page
#: Index query heads of the decode indexer.
INDEX_HEADS: Final = QWEN38_FLASH_NEXT.index_n_heads
#: Head dimension of the index queries and keys.
INDEX_HEAD_DIM: Final = QWEN38_FLASH_NEXT.index_head_dim


def check_block_tokens(compress_ratio: int) -> None:
    """Refuse a model whose indexer blocks are not :data:`BLOCK_TOKENS` tokens.

    Raises:
        KernelInputError: ``compress_ratio`` (``indexer_compress_ratio``) is another value.
    """
    if compress_ratio != BLOCK_TOKENS:
        msg = (
            f"indexer_compress_ratio={compress_ratio!r}; the QSA kernels move blocks of "
            f"{BLOCK_TOKENS} tokens (allowed: {BLOCK_TOKENS})"
        )
        raise KernelInputError(msg)
