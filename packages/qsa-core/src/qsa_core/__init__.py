"""qsa-core: pure data structures and arithmetic for Qwen Sparse Attention serving.

Model geometry (:class:`QSAProfile`), the request lease state machine, the hot-cache residency
contract every hot-cache implementation follows, sharding placement, context-parallel zigzag
layouts, the exact order of a distributed top-k, and the per-rank capacity plan. Stdlib only; no
device code.
"""

from qsa_core._capacity import (
    HOT_SLOTS_PER_TOPK,
    CapacityPlan,
    MemoryLayout,
    MemoryPart,
    MemoryPartKind,
    MemoryTier,
    hot_cache_slots,
    index_ranks,
    plan_capacity,
)
from qsa_core._cp import MAX_CP_SIZE, MAX_SEQ_LEN, ZigzagLayout
from qsa_core._engine_sizing import (
    IndexBufferBytes,
    LabelledCapacity,
    PlanInputs,
    TransportBytes,
    labelled_capacity,
)
from qsa_core._errors import (
    CapacityError,
    JSONFileError,
    LayoutError,
    LeaseError,
    MergeError,
    PlacementError,
    PromptError,
    QSAConfigError,
    ResidencyError,
)
from qsa_core._jsonfile import (
    CONFIG_JSON_MAX_BYTES,
    JSON_MAX_DEPTH,
    JSON_MAX_INT_DIGITS,
    read_json_file,
)
from qsa_core._lease import (
    LeaseHandle,
    LeaseOutcome,
    LeaseState,
    LeaseTable,
    RequestRows,
    ResidentRows,
    admit_request,
    release_request,
)
from qsa_core._merge import TopKCandidate, candidate_sort_key, merge_topk, topk_reference
from qsa_core._offload_sizes import (
    WINDOW_LAYERS,
    OffloadSizes,
    ds_offload_sizes,
    label_bytes_per_token,
    sharded_token_bytes,
)
from qsa_core._placement import ShardPlacement
from qsa_core._pool_price import PoolPrice
from qsa_core._profile import (
    ALLOWED_BLOCK_TOPK,
    QWEN38_FLASH_NEXT,
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    KVDType,
    QSAProfile,
)
from qsa_core._prompt import check_prompt
from qsa_core._render import render_plan
from qsa_core._residency import (
    HotCacheState,
    ResidencyFill,
    ResidencyPlan,
    plan_residency_batch,
    plan_residency_step,
)
from qsa_core._series import CountSeries, CountsExport
from qsa_core._units import format_bytes
from qsa_core._version import __version__

__all__ = (  # noqa: RUF022 (grouped by topic, as the comments say)
    "__version__",
    # geometry
    "ALLOWED_BLOCK_TOPK",
    "QWEN38_FLASH_NEXT",
    "QWEN38_FLASH_NEXT_TEXT_CONFIG",
    "KVDType",
    "QSAProfile",
    # request lease
    "LeaseHandle",
    "LeaseOutcome",
    "LeaseState",
    "LeaseTable",
    "ResidentRows",
    "RequestRows",
    "admit_request",
    "release_request",
    # hot-cache residency contract
    "HotCacheState",
    "ResidencyFill",
    "ResidencyPlan",
    "plan_residency_batch",
    "plan_residency_step",
    # sharding placement and context-parallel layout
    "ShardPlacement",
    "ZigzagLayout",
    "MAX_CP_SIZE",
    "MAX_SEQ_LEN",
    # distributed top-k order
    "TopKCandidate",
    "candidate_sort_key",
    "merge_topk",
    "topk_reference",
    # capacity plan
    "HOT_SLOTS_PER_TOPK",
    "CapacityPlan",
    "IndexBufferBytes",
    "LabelledCapacity",
    "MemoryLayout",
    "MemoryPart",
    "MemoryPartKind",
    "MemoryTier",
    "OffloadSizes",
    "PlanInputs",
    "WINDOW_LAYERS",
    "PoolPrice",
    "TransportBytes",
    "ds_offload_sizes",
    "format_bytes",
    "hot_cache_slots",
    "index_ranks",
    "label_bytes_per_token",
    "labelled_capacity",
    "plan_capacity",
    "render_plan",
    "sharded_token_bytes",
    # requests
    "check_prompt",
    # counts as metrics
    "CountSeries",
    "CountsExport",
    # files users name
    "CONFIG_JSON_MAX_BYTES",
    "JSON_MAX_DEPTH",
    "JSON_MAX_INT_DIGITS",
    "read_json_file",
    # errors
    "CapacityError",
    "JSONFileError",
    "LayoutError",
    "LeaseError",
    "MergeError",
    "PlacementError",
    "PromptError",
    "QSAConfigError",
    "ResidencyError",
)
