"""The compressed QSA index sharded by page inside SGLang (D2, ``SGLANG_QSA_INDEX_SHARDING=1``).

The index shard and its operations are :class:`qsa_kernels.sharded.ShardedIndex`
(docs/sharding.md). Here, the hooks on upstream's QSA pool and indexer that route through it:

- AROUND ``QSATokenToKVPool.__init__``: the compressed-key buffer of every QSA layer is
  ``ceil(P / N)`` pages (page ``p`` at local page ``p // N`` on rank ``p % N``); upstream's
  whole buffer is built on the meta device, so it never takes memory;
- AROUND ``QSATokenToKVPool.set_qsa_compressed_k_buffer``: a closed block is stored by its page's
  owner only (the pending ring stays replicated, so every rank compresses every group);
- AFTER ``QSAIndexer._use_fused_compress``: False, since the fused JIT compress stores into the
  buffer at logical slots itself;
- AROUND ``QSAIndexerMetadata.get_prefill_mqa_inputs``: the row ranges as upstream computes them,
  without upstream's gather of the batch's keys by logical slot (out of a rank-local buffer),
  and each row's page table handed to the prefill selection;
- AROUND ``QSAIndexer.select_prefill_tokens`` / ``select_decode_tokens``: every rank scores its
  own pages, one candidate all-gather, the exact merge
  (:meth:`~qsa_kernels.sharded.ShardedIndex.select`), then upstream's block expansion.

The rank's :class:`~qsa_kernels.sharded.ShardedIndex` is one per process (SGLang runs one model
runner per scheduler process); the sharded backend installs it with the store of the raw K/V
(:func:`install_sharded_index`), on the same shard group.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement, format_bytes
from qsa_kernels.sharded import ShardedIndex
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError
from qsa_sglang_plugin._switches import current_switches

__all__ = (
    "after_use_fused_compress",
    "around_get_prefill_mqa_inputs",
    "around_qsa_pool_init",
    "around_select_decode_tokens",
    "around_select_prefill_tokens",
    "around_set_qsa_compressed_k_buffer",
    "index_placement",
    "install_sharded_index",
    "sharded_index",
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _PrefillRows:
    """What one layer's prefill selection needs beyond upstream's arguments.

    Attributes:
        row_starts: the tensor ``get_prefill_mqa_inputs`` returned (identifies the call).
        local_index: ``[P_local, 16, Dk]`` the layer's index shard.
        page_table: ``[rows, P]`` int64 logical compressed page ids of each row's request.
        seq_lens: ``[rows]`` int64 tokens each row sees (position + 1).
    """

    row_starts: torch.Tensor
    local_index: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor


class _State:
    index: ShardedIndex | None = None
    pending: _PrefillRows | None = None


def install_sharded_index(index: ShardedIndex | None) -> None:
    """Make ``index`` this process's index shard (None: uninstall, for tests)."""
    _State.index = index
    _State.pending = None


def sharded_index() -> ShardedIndex:
    """This process's index shard.

    Raises:
        OffloadRuntimeError: none installed (the sharded backend installs it at start-up).
    """
    if _State.index is None:
        msg = (
            "SGLANG_QSA_INDEX_SHARDING=1 but no index shard is installed on this rank; the "
            "sharded QSA backend installs it when SGLang builds the attention backend"
        )
        raise OffloadRuntimeError(msg)
    return _State.index


def index_placement(pool: Any, sharding: int) -> ShardPlacement:
    """The page placement of ``pool``'s compressed index over ``sharding`` ranks.

    Raises:
        ConfigurationError: a compressed page that is not the kernels' 16 blocks of 4 tokens.
    """
    # The index kernels' geometry is the model's (qsa_kernels builds it from this profile).
    want = (QWEN38_FLASH_NEXT.blocks_per_page, QWEN38_FLASH_NEXT.compress_ratio)
    page, ratio = int(pool.qsa_compressed_page_size), int(pool.qsa_compress_ratio)
    if (page, ratio) != want:
        msg = (
            f"index sharding needs compressed pages of {want[0]} blocks of {want[1]} tokens; "
            f"the QSA pool has {page!r} blocks of {ratio!r}"
        )
        raise ConfigurationError(msg)
    return ShardPlacement(sharding, page, ratio)


class _WholeIndexOnMeta(TorchFunctionMode):
    """Upstream's whole compressed-key buffer on the meta device, while its QSA pool is built.

    Only ``torch.zeros`` of ``shape`` is diverted; every other allocation is upstream's own.
    """

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape = shape
        self.diverted = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and _shape_of(args) == self.shape:
            self.diverted += 1
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _shape_of(args: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The shape a factory call's positional arguments give: ``(2, 3)`` or ``2, 3``."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    if all(isinstance(n, int) for n in args):
        return tuple(args)
    return None  # a SymInt or another form: not the buffer this hook knows


def _whole_index(
    original: Callable[..., None], pool: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[int, int], torch.device]:
    """The shape and device upstream's ``__init__`` gives the compressed-key buffer.

    The shape is ``(L, C * H * D)`` with ``C = ceil((size + page_size) / ratio)`` blocks, read
    from the constructor's arguments.
    """
    bound = inspect.signature(original).bind(pool, *args, **kwargs).arguments
    capacity = -(
        -(int(bound["size"]) + int(bound["page_size"])) // int(bound["qsa_compress_ratio"])
    )
    per_layer = capacity * int(bound["qsa_index_kv_heads"]) * int(bound["qsa_index_head_dim"])
    return (len(bound["full_attention_layer_ids"]), per_layer), torch.device(bound["device"])


def around_qsa_pool_init(
    original: Callable[..., None], pool: Any, *args: Any, **kwargs: Any
) -> None:
    """AROUND hook on ``QSATokenToKVPool.__init__``: each layer's compressed keys at ``1 / N``.

    Upstream's constructor runs with its whole buffer (``[L, capacity * H * D]``, one view per
    layer) on the meta device; then one of ``ceil(P / N) * 16`` blocks per layer, ``P`` the
    logical pages, takes its place and SGLang's memory report (``mem_usage``) is recomputed. No
    rank ever holds the whole index.

    Raises:
        ConfigurationError: upstream's constructor no longer allocates the buffer this hook
            knows (one ``torch.zeros`` of the shape its arguments give), or its pages are not the
            kernels'.
    """
    shape, device = _whole_index(original, pool, *args, **kwargs)
    with _WholeIndexOnMeta(shape) as divert:
        original(pool, *args, **kwargs)
    if divert.diverted != 1 or not pool.qsa_compressed_flat.is_meta:
        msg = (
            f"index sharding expected QSATokenToKVPool.__init__ to allocate its compressed keys "
            f"once as torch.zeros{shape!r}; it did {divert.diverted!r} times"
        )
        raise ConfigurationError(msg)
    sharding = current_switches().cache_sharding
    placement = index_placement(pool, sharding)
    page = placement.blocks_per_page
    logical_pages = -(-int(pool.qsa_compressed_capacity) // page)
    local_blocks = placement.local_capacity(logical_pages) * page
    old = pool.qsa_compressed_flat
    layers, heads, dim = old.shape[0], int(pool.qsa_index_kv_heads), int(pool.qsa_index_head_dim)
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    with pool.full_kv_pool.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):  # as upstream's
        flat = torch.zeros((layers, local_blocks * heads * dim), dtype=old.dtype, device=device)
    pool.qsa_compressed_flat = flat
    pool.qsa_compressed_k_buffer_pool = [
        flat[layer].view(local_blocks, heads, dim) for layer in range(layers)
    ]
    del old  # a meta tensor: no memory
    from sglang.srt.mem_cache.memory_pool import GB

    k_size, v_size = pool.get_kv_size_bytes()
    pool.mem_usage = (k_size + v_size) / GB
    logger.info(
        "index sharding: compressed index %s per rank (%d of %d pages of %d blocks, %d layers; "
        "unsharded %s)",
        format_bytes(flat.numel() * flat.element_size()),
        local_blocks // page,
        logical_pages,
        page,
        layers,
        format_bytes(layers * logical_pages * page * heads * dim * flat.element_size()),
    )


def around_set_qsa_compressed_k_buffer(
    original: Any, pool: Any, layer_id: int, loc: torch.Tensor, compressed_k: torch.Tensor
) -> None:
    """AROUND ``set_qsa_compressed_k_buffer``: store the closed blocks of this rank's pages.

    ``loc`` ``[M]`` logical compressed block slots (``0`` the inert dump, owned by rank 0);
    ``compressed_k`` ``[M, H, D]``. Fixed shapes, no host read (CUDA-graph capturable).
    """
    del original
    buffer = pool.get_qsa_compressed_k_buffer(layer_id)
    local = buffer.view(-1, int(pool.qsa_compressed_page_size), buffer.shape[1] * buffer.shape[2])
    rows = compressed_k.reshape(loc.shape[0], -1).to(buffer.dtype)
    sharded_index().write(local, loc, rows)


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
    ``compressed_keys`` empty: the keys stay in each rank's shard, and the prefill selection
    (:func:`around_select_prefill_tokens`, which must come next) reads them there.
    """
    del original
    from sglang.srt.layers.attention.qsa.metadata import build_qsa_row_ranges

    pool = metadata.token_to_kv_pool
    ratio = int(metadata.compress_ratio)
    sequence_lengths = metadata.sequence_lengths.to(torch.int32)
    ids = metadata.token_to_batch_idx if query_sequence_ids is None else query_sequence_ids
    rows = ids.numel()
    if positions.numel() < rows:
        msg = (
            "QSA prefill positions are shorter than the request mapping: "
            f"positions={positions.numel()}, mapping={rows}"
        )
        raise OffloadRuntimeError(msg)
    device = sequence_lengths.device
    positions = positions[:rows].to(device)
    ids = ids.to(device)
    row_starts, row_ends, _ = build_qsa_row_ranges(sequence_lengths, positions, ids, ratio)
    buffer = pool.get_qsa_compressed_k_buffer(layer_id)
    page = int(pool.qsa_compressed_page_size)
    full_page = page * ratio
    pages = metadata.token_slot_table[:, ::full_page].long().clamp_min(0) // full_page
    _State.pending = _PrefillRows(
        row_starts,
        buffer.view(-1, page, buffer.shape[1] * buffer.shape[2]),
        pages.index_select(0, ids.long()),
        positions.long() + 1,
    )
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
    pending = _State.pending
    if pending is None or pending.row_starts is not row_starts:
        msg = (
            "a QSA prefill selection whose row ranges did not come from get_prefill_mqa_inputs "
            "under index sharding; its keys would be read at logical slots of a rank-local shard"
        )
        raise OffloadRuntimeError(msg)
    _State.pending = None
    blocks = sharded_index().select(
        _index_queries(indexer, q),
        pending.local_index,
        pending.page_table,
        pending.seq_lens,
    )
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

    ``compressed_cache`` ``[P_local, 16, 1, D]`` is this rank's shard (the pool's buffer),
    ``compressed_page_table`` ``[B, P]`` logical page ids, ``compressed_lengths`` ``[B]``
    complete blocks. Returns block ids ``[B, block_topk]`` with ``defer_expansion``, else
    upstream's token positions. No host read (CUDA-graph capturable on the Triton path).
    """
    del original, max_model_len
    local = compressed_cache.reshape(compressed_cache.shape[0], compressed_cache.shape[1], -1)
    seq_lens = compressed_lengths.to(torch.int64) * int(indexer.compress_ratio)
    blocks = sharded_index().select(
        _index_queries(indexer, q), local, compressed_page_table, seq_lens
    )
    if defer_expansion:
        return blocks
    return _expand(indexer, blocks, query_positions, sequence_lengths)


def _index_queries(indexer: Any, q: torch.Tensor) -> torch.Tensor:
    """The index queries ``[rows, index_n_heads, D]``, contiguous.

    Upstream pads decode queries to 8 heads on CUDA for its tilelang kernel (zero heads, which
    add nothing to a score).
    """
    return q[:, : int(indexer.index_n_heads)].contiguous()


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
