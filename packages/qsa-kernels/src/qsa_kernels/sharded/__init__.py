"""QSA cache sharding for decode: placement adapters, exact distributed top-k, owner attention.

A shard group of ``N`` ranks (a torch.distributed process group) stores each request's raw K/V
token-interleaved and its compressed index page-interleaved (:class:`qsa_core.ShardPlacement`).
One decode step of one QSA layer is :func:`sharded_indexer_topk` (each rank scores its own
blocks; one all-gather of candidates; an exact merge) then :func:`owner_sparse_decode` (each rank
attends over the selected tokens it stores, compacted to a width that shrinks with ``N``; one
exchange of fp32 partials; an LSE merge). A prefill chunk over a sharded prefix is
:func:`owner_sparse_prefill` (each query token attends as a decode row of its position would).
All transport goes through
:class:`ShardedDecodeBuffers`, allocated once. Writes of new raw K/V rows
and closed index blocks are routed to their owners (``*_write_targets``, ``write_owned_*``).
A host prefix cache reads and writes the whole index by logical row through one rank's shard
(:class:`ShardedIndexAccess`).
"""

from qsa_kernels.sharded._attention import (
    gather_group_queries,
    merge_owner_partials,
    owner_sparse_decode,
    owner_sparse_prefill,
    partial_attention_reference,
)
from qsa_kernels.sharded._buffers import (
    PREFILL_GROUP_ROWS,
    CollectiveBytes,
    HeadLayout,
    ShardedDecodeBuffers,
)
from qsa_kernels.sharded._group import (
    ShardGroup,
    all_gather_flat,
    all_gather_rows,
    all_to_all_flat,
    group_row_counts,
)
from qsa_kernels.sharded._index import IndexRows, IndexShard, ShardedIndex, ZerosOnMeta
from qsa_kernels.sharded._index_access import ShardedIndexAccess
from qsa_kernels.sharded._layout import (
    LocalIndexTable,
    compact_owned_slots,
    local_index_table,
    localize_blocks,
    localize_token_slots,
    owned_token_bound,
    shard_index_pages,
    shard_raw_kv,
    unshard_index_pages,
    unshard_raw_kv,
)
from qsa_kernels.sharded._store import RowExchange, ShardedKVStore
from qsa_kernels.sharded._topk import local_topk_candidates, sharded_indexer_topk
from qsa_kernels.sharded._writes import (
    LocalWriteTargets,
    index_write_targets,
    raw_write_targets,
    route_write_rows,
    write_owned_index_blocks,
    write_owned_raw_kv,
)

__all__ = (  # noqa: RUF022 (grouped by comment, sorted within each group)
    # -- Group, transport --
    "CollectiveBytes",
    "HeadLayout",
    "ShardGroup",
    "ShardedDecodeBuffers",
    "all_gather_flat",
    "all_gather_rows",
    "all_to_all_flat",
    "group_row_counts",
    # -- Placement adapters --
    "LocalIndexTable",
    "compact_owned_slots",
    "local_index_table",
    "localize_blocks",
    "localize_token_slots",
    "owned_token_bound",
    "shard_index_pages",
    "shard_raw_kv",
    "unshard_index_pages",
    "unshard_raw_kv",
    # -- Write routing --
    "LocalWriteTargets",
    "index_write_targets",
    "raw_write_targets",
    "route_write_rows",
    "write_owned_index_blocks",
    "write_owned_raw_kv",
    # -- One rank's store (D1) --
    "PREFILL_GROUP_ROWS",
    "RowExchange",
    "ShardedKVStore",
    # -- One rank's index shard (D2) --
    "IndexRows",
    "IndexShard",
    "ShardedIndex",
    "ShardedIndexAccess",
    "ZerosOnMeta",
    # -- Decode step --
    "gather_group_queries",
    "local_topk_candidates",
    "merge_owner_partials",
    "owner_sparse_decode",
    "owner_sparse_prefill",
    "partial_attention_reference",
    "sharded_indexer_topk",
)
