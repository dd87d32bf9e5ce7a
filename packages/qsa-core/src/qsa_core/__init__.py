"""qsa-core: pure data structures and arithmetic for Qwen Sparse Attention serving.

Model geometry (:class:`QSAProfile`), the hot-cache residency contract every hot-cache
implementation follows, and the exact order of a distributed top-k. Stdlib only; no device code.
"""

from importlib.metadata import version as _version

from qsa_core._errors import (
    CapacityError,
    LayoutError,
    LeaseError,
    MergeError,
    PlacementError,
    QSAConfigError,
    ResidencyError,
)
from qsa_core._merge import TopKCandidate, candidate_sort_key, merge_topk, topk_reference
from qsa_core._profile import (
    ALLOWED_BLOCK_TOPK,
    QWEN38_FLASH_NEXT,
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    KVDType,
    QSAProfile,
)
from qsa_core._residency import (
    HotCacheState,
    ResidencyFill,
    ResidencyPlan,
    plan_residency_batch,
    plan_residency_step,
)

__version__: str = _version("qsa-core")

__all__ = (  # noqa: RUF022 (grouped by topic, as the comments say)
    "__version__",
    # geometry
    "ALLOWED_BLOCK_TOPK",
    "QWEN38_FLASH_NEXT",
    "QWEN38_FLASH_NEXT_TEXT_CONFIG",
    "KVDType",
    "QSAProfile",
    # hot-cache residency contract
    "HotCacheState",
    "ResidencyFill",
    "ResidencyPlan",
    "plan_residency_batch",
    "plan_residency_step",
    # distributed top-k order
    "TopKCandidate",
    "candidate_sort_key",
    "merge_topk",
    "topk_reference",
    # errors
    "CapacityError",
    "LayoutError",
    "LeaseError",
    "MergeError",
    "PlacementError",
    "QSAConfigError",
    "ResidencyError",
)
