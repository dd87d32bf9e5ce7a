"""qsa-hostcache: an engine-agnostic host prefix cache for model-state checkpoints.

Checkpoints of any named segments (K/V, indexes, recurrent state...) taken at page boundaries live
in one byte-budgeted host arena (pinned where CUDA is available, allocated once). Keys chain over
pages and match only on equal key material (namespace, every token id, every page's extra
identity), never on a hash alone. Least-recently-used unpinned checkpoints are evicted; a lease
pins one for restore. A shared tier (e.g. Mooncake Store) below the arena holds checkpoints
other processes wrote. It knows nothing of any serving engine.
"""

from qsa_hostcache._arena import CopyFence
from qsa_hostcache._cache import HostPrefixCache, Lease, Match, PublishTicket, TicketState
from qsa_hostcache._errors import (
    ArenaAllocationError,
    CacheConfigError,
    CheckpointTooLarge,
    CorruptObjectError,
    DeviceError,
    HostCacheError,
    InvalidKeyError,
    LeaseError,
    SegmentError,
    StoreUnavailableError,
    TicketStateError,
)
from qsa_hostcache._keys import (
    DEFAULT_HASHER,
    HASH_SEED,
    CacheNamespace,
    PageHash,
    PageHasher,
    PrefixKey,
    config_digest,
    page_keys,
    token_bytes,
)
from qsa_hostcache._layout import CheckpointLayout, SegmentSpec
from qsa_hostcache._model_config import (
    kv_storage_dtype,
    model_config_digest,
    model_dtype,
    model_namespace,
)
from qsa_hostcache._prompt_cache import PromptCache, PromptCacheNumbers
from qsa_hostcache._prompt_pools import (
    BufferIndex,
    IndexAccess,
    PromptPools,
    TokenSlots,
    admits_host_hit,
    host_hit,
)
from qsa_hostcache._prompts import (
    Admission,
    Agree,
    Claim,
    PromptCheckpoints,
    PromptCounts,
    agree_min,
)
from qsa_hostcache._requests import PromptKeys
from qsa_hostcache._segments import (
    INDEX_SEGMENT,
    StateSegments,
    compressed_slots,
    kv_segments,
    prompt_segment_spec,
    segment_buffer,
)
from qsa_hostcache._shared import SharedCheckpoint, SharedCheckpoints, TierStats
from qsa_hostcache._stats import CacheStats
from qsa_hostcache._tiers import (
    DiskAddress,
    DiskTier,
    MooncakeAddress,
    MooncakeTier,
    ObjectTier,
    StoreAddress,
    TierHealth,
    open_tier,
    parse_store_address,
)
from qsa_hostcache._version import __version__

__all__ = (  # noqa: RUF022 (grouped by topic, as the comments say)
    "__version__",
    # keys
    "CacheNamespace",
    "config_digest",
    "PrefixKey",
    "PageHash",
    "PageHasher",
    "DEFAULT_HASHER",
    "HASH_SEED",
    "page_keys",
    "token_bytes",
    # a model's configuration as a namespace's parts
    "model_dtype",
    "kv_storage_dtype",
    "model_config_digest",
    "model_namespace",
    # checkpoints
    "SegmentSpec",
    "CheckpointLayout",
    # the cache
    "HostPrefixCache",
    "PublishTicket",
    "TicketState",
    "Match",
    "Lease",
    "CopyFence",
    "CacheStats",
    # a serving engine's prompts, agreed by its ranks
    "PromptCheckpoints",
    "Admission",
    "PromptCounts",
    "Claim",
    "Agree",
    "agree_min",
    "PromptKeys",
    "PromptPools",
    "IndexAccess",
    "BufferIndex",
    "TokenSlots",
    "PromptCache",
    "PromptCacheNumbers",
    "host_hit",
    "admits_host_hit",
    # what a prompt's checkpoint holds
    "kv_segments",
    "INDEX_SEGMENT",
    "prompt_segment_spec",
    "compressed_slots",
    "StateSegments",
    "segment_buffer",
    # a shared tier below the arena
    "ObjectTier",
    "MooncakeTier",
    "MooncakeAddress",
    "DiskTier",
    "DiskAddress",
    "StoreAddress",
    "open_tier",
    "parse_store_address",
    "TierHealth",
    "SharedCheckpoints",
    "SharedCheckpoint",
    "TierStats",
    # errors
    "HostCacheError",
    "CacheConfigError",
    "ArenaAllocationError",
    "InvalidKeyError",
    "CheckpointTooLarge",
    "SegmentError",
    "TicketStateError",
    "LeaseError",
    "DeviceError",
    "CorruptObjectError",
    "StoreUnavailableError",
)
