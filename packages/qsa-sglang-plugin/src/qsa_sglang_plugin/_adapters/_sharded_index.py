"""The compressed QSA index sharded by page inside SGLang (D2, ``SGLANG_QSA_INDEX_SHARDING=1``).

The shard and its operations are :class:`qsa_kernels.sharded.ShardedIndex` (docs/sharding.md);
here, the hooks on upstream's QSA pool and indexer that route through it. The rank's index is one
per process, installed on the raw K/V's shard group by whichever holds that K/V
(:func:`install_rank_index`): the sharded backend's store, or the offload's runtime; without
cache sharding, on a group of every TP rank by the pool's own hook, beside upstream's backend
or the offload's.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from qsa_core import format_bytes
from qsa_kernels import KernelInputError
from qsa_kernels.sharded import IndexShard, ShardedIndex, ShardGroup, ZerosOnMeta
from qsa_sglang_plugin._adapters._metrics import RankMetrics
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError
from qsa_sglang_plugin._switches import current_switches

__all__ = (
    "after_use_fused_compress",
    "around_get_prefill_mqa_inputs",
    "around_qsa_pool_init",
    "around_select_decode_tokens",
    "around_select_prefill_tokens",
    "around_set_qsa_compressed_k_buffer",
    "index_shard",
    "install_rank_index",
    "install_sharded_index",
    "sharded_index",
)

logger = logging.getLogger(__name__)


class _State:
    index: ShardedIndex | None = None


def install_sharded_index(index: ShardedIndex | None) -> None:
    """Make ``index`` this process's index shard (None: uninstall, for tests)."""
    _State.index = index


def install_rank_index(index: ShardedIndex, pool: Any, tp_rank: int) -> None:
    """Install the rank's ``index`` over ``pool``'s compressed keys; gauge and log its bytes."""
    install_sharded_index(index)
    index_bytes = sum(t.numel() * t.element_size() for t in pool.qsa_compressed_k_buffer_pool)
    RankMetrics(tp_rank).gauge(
        "qsa_hisparse_sharded_index_bytes",
        "Bytes of this rank's share of the QSA layers' compressed index (index sharding).",
    ).set(index_bytes)
    logger.info("index sharding: %s of candidate buffers", format_bytes(index.buffer_bytes))


def sharded_index() -> ShardedIndex:
    """This process's index shard.

    Raises:
        OffloadRuntimeError: none installed (the sharded backend installs it at start-up).
    """
    if _State.index is None:
        msg = (
            "SGLANG_QSA_INDEX_SHARDING=1 but no index shard is installed on this rank; the "
            "sharded or offload QSA backend installs it when SGLang builds the attention backend"
        )
        raise OffloadRuntimeError(msg)
    return _State.index


def index_shard(pool: Any, sharding: int) -> IndexShard:
    """:class:`IndexShard` of ``pool``'s compressed index over ``sharding`` ranks.

    Raises:
        ConfigurationError: pages other than the index kernels' (the library's message).
    """
    try:
        return IndexShard.of(
            sharding,
            blocks_per_page=int(pool.qsa_compressed_page_size),
            compress_ratio=int(pool.qsa_compress_ratio),
            capacity_blocks=int(pool.qsa_compressed_capacity),
        )
    except KernelInputError as error:
        raise ConfigurationError(f"the QSA pool: {error}") from error


def _whole_index(
    original: Callable[..., None], pool: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[int, int], torch.device]:
    """Upstream's buffer shape (:meth:`IndexShard.whole_shape` of its arguments), its device."""
    bound = inspect.signature(original).bind(pool, *args, **kwargs).arguments
    shape = IndexShard.whole_shape(
        layers=len(bound["full_attention_layer_ids"]),
        slots=int(bound["size"]) + int(bound["page_size"]),
        compress_ratio=int(bound["qsa_compress_ratio"]),
        heads=int(bound["qsa_index_kv_heads"]),
        dim=int(bound["qsa_index_head_dim"]),
    )
    return shape, torch.device(bound["device"])


def around_qsa_pool_init(
    original: Callable[..., None], pool: Any, *args: Any, **kwargs: Any
) -> None:
    """AROUND ``QSATokenToKVPool.__init__``: each layer's compressed keys at ``ceil(P / N)`` pages.

    Upstream's whole buffer is built on the meta device (:class:`ZerosOnMeta`), the rank's shard
    takes its place, and SGLang's memory report (``mem_usage``) is recomputed.

    Raises:
        ConfigurationError: upstream's constructor no longer allocates the buffer this hook
            knows (one ``torch.zeros`` of the shape its arguments give), or its pages are not the
            kernels'.
    """
    shape, device = _whole_index(original, pool, *args, **kwargs)
    with ZerosOnMeta(shape) as divert:
        original(pool, *args, **kwargs)
    if divert.diverted != 1 or not pool.qsa_compressed_flat.is_meta:
        msg = (
            f"index sharding expected QSATokenToKVPool.__init__ to allocate its compressed keys "
            f"once as torch.zeros{shape!r}; it did {divert.diverted!r} times"
        )
        raise ConfigurationError(msg)
    sharding = current_switches().cache_sharding
    group = _index_alone_group(pool) if sharding == 1 else None  # D2 without D1: every TP rank
    shard = index_shard(pool, sharding if group is None else group.world_size)
    layers, heads, dim = shape[0], int(pool.qsa_index_kv_heads), int(pool.qsa_index_head_dim)
    dtype = pool.qsa_compressed_flat.dtype  # the meta buffer's
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.mem_cache.memory_pool import GB

    with pool.full_kv_pool.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):  # as upstream's
        flat, views = shard.allocate(
            layers=layers, heads=heads, dim=dim, dtype=dtype, device=device
        )
    pool.qsa_compressed_flat, pool.qsa_compressed_k_buffer_pool = flat, views
    k_size, v_size = pool.get_kv_size_bytes()
    pool.mem_usage = (k_size + v_size) / GB
    block_bytes = heads * dim * flat.element_size()
    logger.info("index sharding: %s", shard.describe(layers=layers, block_bytes=block_bytes))
    if group is not None:  # D2 alone: no shard group of the raw K/V to install it on
        rows = ShardedIndex.rows_for(int(pool.qsa_num_request_slots))
        index = ShardedIndex(
            group, block_topk=int(pool.qsa_block_topk), max_rows=rows, device=device
        )
        install_rank_index(index, pool, group.rank)


def _index_alone_group(pool: Any) -> ShardGroup:
    """The index's own shard group without cache sharding: every rank of SGLang's TP group."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp, ratio = get_tp_group(), int(pool.qsa_compress_ratio)
    return ShardGroup.join_index_tp(
        list(tp.ranks), int(tp.rank_in_group),
        blocks_per_page=int(pool.qsa_compressed_page_size), compress_ratio=ratio,
    )  # fmt: skip


def around_set_qsa_compressed_k_buffer(
    original: Any, pool: Any, layer_id: int, loc: torch.Tensor, compressed_k: torch.Tensor
) -> None:
    """AROUND ``set_qsa_compressed_k_buffer``: store the closed blocks of this rank's pages.

    ``loc`` ``[M]`` logical block slots, ``compressed_k`` ``[M, H, D]`` (capturable).
    """
    del original
    index = sharded_index()
    index.write(index.local_view(pool.get_qsa_compressed_k_buffer(layer_id)), loc, compressed_k)


def after_use_fused_compress(result: bool, indexer: Any, *args: object, **kwargs: object) -> bool:
    """AFTER ``QSAIndexer._use_fused_compress``: False (the fused store writes logical slots)."""
    del result, indexer, args, kwargs
    return False


def around_get_prefill_mqa_inputs(
    original: Any,
    metadata: Any,
    layer_id: int,
    positions: torch.Tensor,
    query_sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """AROUND ``QSAIndexerMetadata.get_prefill_mqa_inputs``: the row ranges, no logical gather.

    Returns upstream's ``(compressed_keys, row_starts, row_ends, sequence_lengths)`` with
    ``compressed_keys`` empty; the prefill selection, which must come next, reads the shard.
    Upstream passes ``query_sequence_ids`` from its prefill CP only (``forward_cuda_cp``: this
    rank's zigzag rows); the index group then selects for the union of its ranks' rows
    (``own_rows``), and each rank keeps its own.
    """
    del original
    from sglang.srt.layers.attention.qsa.metadata import build_qsa_row_ranges

    sequence_lengths = metadata.sequence_lengths.to(torch.int32)
    ids = metadata.token_to_batch_idx if query_sequence_ids is None else query_sequence_ids
    ratio = int(metadata.compress_ratio)

    def row_ranges(at: torch.Tensor, requests: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts, ends, _ = build_qsa_row_ranges(sequence_lengths, at, requests, ratio)
        return starts, ends

    buffer = metadata.token_to_kv_pool.get_qsa_compressed_k_buffer(layer_id)
    try:
        row_starts, row_ends = sharded_index().prefill_inputs(
            buffer, metadata.token_slot_table, positions, ids.to(sequence_lengths.device),
            row_ranges=row_ranges, own_rows=query_sequence_ids is not None,
        )  # fmt: skip
    except KernelInputError as exc:
        raise OffloadRuntimeError(f"QSA prefill under index sharding: {exc}") from exc
    return buffer[:0], row_starts, row_ends, sequence_lengths


def around_select_prefill_tokens(  # noqa: PLR0917 (upstream's signature)
    original: Any,
    indexer: Any,
    q: torch.Tensor,
    compressed_keys: torch.Tensor,
    row_starts: torch.Tensor,
    row_ends: torch.Tensor,
    query_positions: torch.Tensor,
    sequence_lengths_for_rows: torch.Tensor,
    max_row_keys: int | None = None,
) -> torch.Tensor:
    """AROUND ``QSAIndexer.select_prefill_tokens``: each row's top-k over the shard group.

    Returns upstream's ``[rows, token_topk + ratio - 1]`` int32 token positions.

    Raises:
        OffloadRuntimeError: the row ranges did not come from this layer's
            ``get_prefill_mqa_inputs`` (the index would be read at logical slots).
    """
    del original, compressed_keys, row_ends, max_row_keys
    index, heads = sharded_index(), int(indexer.index_n_heads)
    try:
        blocks = index.select_prefill(row_starts, q, heads=heads)
    except KernelInputError as exc:
        msg = f"QSA prefill row ranges that did not come from get_prefill_mqa_inputs: {exc}"
        raise OffloadRuntimeError(msg) from exc
    return _expand(indexer, blocks, query_positions, sequence_lengths_for_rows)


def around_select_decode_tokens(  # noqa: PLR0917 (upstream's signature)
    original: Any,
    indexer: Any,
    q: torch.Tensor,
    compressed_cache: torch.Tensor,
    compressed_page_table: torch.Tensor,
    compressed_lengths: torch.Tensor,
    max_model_len: int,
    query_positions: torch.Tensor,
    sequence_lengths: torch.Tensor,
    defer_expansion: bool = False,
) -> torch.Tensor:
    """AROUND ``QSAIndexer.select_decode_tokens``: each row's top-k over the shard group.

    ``compressed_cache`` ``[P_local, 16, 1, D]`` this rank's shard, ``compressed_page_table``
    ``[B, P]`` logical page ids, ``compressed_lengths`` ``[B]`` complete blocks. Returns block ids
    ``[B, block_topk]`` with ``defer_expansion``, else upstream's token positions (capturable).
    """
    del original, max_model_len
    blocks = sharded_index().select_decode(
        q, compressed_cache, compressed_page_table, compressed_lengths,
        heads=int(indexer.index_n_heads),
    )  # fmt: skip
    if defer_expansion:
        return blocks
    return _expand(indexer, blocks, query_positions, sequence_lengths)


def _expand(
    indexer: Any, blocks: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Upstream's expansion of block ids into token positions (as its selection ends)."""
    from sglang.srt.layers.attention.qsa.kernel import expand_qsa_block_indices

    out: torch.Tensor = expand_qsa_block_indices(
        blocks,
        positions,
        lengths,
        compress_ratio=int(indexer.compress_ratio),
        token_topk=int(indexer.token_topk),
    )
    return out
