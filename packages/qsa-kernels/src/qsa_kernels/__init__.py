"""Triton kernels for QSA HiSparse, each beside the torch reference that defines it.

Every op is a host-side launcher taking documented tensors; its reference (``*_reference``) lives in
the same subpackage, computes the same contract with plain torch, and is what tests and benchmarks
compare against.
"""

from qsa_kernels._checks import kv_torch_dtype
from qsa_kernels._errors import DeviceUnavailableError, KernelInputError, QSAKernelError
from qsa_kernels._version import __version__
from qsa_kernels.cp import (
    CPRowPlan,
    all_gather_global,
    cp_sparse_prefill_reference,
    reduce_scatter_rank_major,
    sparse_prefill_reference,
    zigzag_positions,
    zigzag_shard,
    zigzag_to_rank_major,
    zigzag_unshard,
)
from qsa_kernels.double_sparsity import (
    ChannelConfig,
    ChannelConfigError,
    DSConfig,
    DSConfigError,
    DSDecodeOutput,
    DSOffloadedKV,
    HeavyChannelType,
    LabelCache,
    ds_decode,
    ds_decode_reference,
)
from qsa_kernels.ds_label import LabelTopK, label_keys_reference, label_topk, label_topk_reference
from qsa_kernels.expand import expand_blocks, expand_blocks_reference
from qsa_kernels.fetch import (
    BLOCK_TOKENS,
    HotCacheTables,
    fetch_selected_blocks,
    fetch_selected_blocks_reference,
)
from qsa_kernels.indexer_topk import (
    indexer_scores,
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_reference,
)
from qsa_kernels.lse_merge import lse_merge, lse_merge_reference
from qsa_kernels.offload import OffloadedKV, OffloadGeometry, RowState
from qsa_kernels.sharded import (
    CollectiveBytes,
    HeadLayout,
    KernelPath,
    ShardedDecodeBuffers,
    ShardGroup,
    local_index_table,
    localize_token_slots,
    owner_sparse_decode,
    shard_index_pages,
    shard_raw_kv,
    sharded_indexer_topk,
)
from qsa_kernels.sparse_decode import gather_selected_kv, sparse_decode, sparse_decode_reference
from qsa_kernels.topk_merge import MergedTopK, merge_candidates, merge_candidates_reference
from qsa_kernels.writeback import (
    offload_prompt,
    offload_prompt_reference,
    writeback_blocks,
    writeback_blocks_reference,
)

__all__ = (  # noqa: RUF022 (grouped by comment, sorted within each group)
    "__version__",
    # -- Errors --
    "DeviceUnavailableError",
    "KernelInputError",
    "QSAKernelError",
    # -- Decode data path: fetch, write-back, sparse decode, LSE merge --
    "BLOCK_TOKENS",
    "HotCacheTables",
    "fetch_selected_blocks",
    "fetch_selected_blocks_reference",
    "gather_selected_kv",
    "kv_torch_dtype",
    "lse_merge",
    "lse_merge_reference",
    "offload_prompt",
    "offload_prompt_reference",
    "sparse_decode",
    "sparse_decode_reference",
    "writeback_blocks",
    "writeback_blocks_reference",
    # -- Offloaded K/V of one rank: host arena, hot caches, open-block tails --
    "OffloadGeometry",
    "OffloadedKV",
    "RowState",
    # -- Selection: indexer top-k, block expansion, distributed merge, double sparsity --
    "LabelTopK",
    "MergedTopK",
    "expand_blocks",
    "expand_blocks_reference",
    "indexer_scores",
    "indexer_scores_reference",
    "indexer_topk",
    "indexer_topk_reference",
    "label_keys_reference",
    "label_topk",
    "label_topk_reference",
    "merge_candidates",
    "merge_candidates_reference",
    # -- Context-parallel prefill: zigzag rows, rank-major collectives, attention reference --
    "CPRowPlan",
    "all_gather_global",
    "cp_sparse_prefill_reference",
    "reduce_scatter_rank_major",
    "sparse_prefill_reference",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_to_rank_major",
    "zigzag_unshard",
    # -- Double sparsity: calibrated channels, label cache, DS decode, DS-Offload --
    "ChannelConfig",
    "ChannelConfigError",
    "DSConfig",
    "DSConfigError",
    "DSDecodeOutput",
    "DSOffloadedKV",
    "HeavyChannelType",
    "LabelCache",
    "ds_decode",
    "ds_decode_reference",
    # -- QSA cache sharding: placement adapters, distributed top-k, owner-side attention --
    "CollectiveBytes",
    "HeadLayout",
    "KernelPath",
    "ShardGroup",
    "ShardedDecodeBuffers",
    "local_index_table",
    "localize_token_slots",
    "owner_sparse_decode",
    "shard_index_pages",
    "shard_raw_kv",
    "sharded_indexer_topk",
)
