"""Fetch of selected K/V blocks from the pinned host arena into per-request hot caches.

``fetch_selected_blocks`` (Triton) and ``fetch_selected_blocks_reference`` (torch) share one
contract; ``HotCacheTables`` is the device residency state both update. Layouts are documented in
``qsa_kernels.fetch._tables``.
"""

from qsa_kernels.fetch._tables import MAX_HOT_SLOTS, HotCacheTables
from qsa_kernels.fetch.reference import fetch_selected_blocks_reference
from qsa_kernels.fetch.triton import fetch_selected_blocks

__all__ = (
    "MAX_HOT_SLOTS",
    "HotCacheTables",
    "fetch_selected_blocks",
    "fetch_selected_blocks_reference",
)
