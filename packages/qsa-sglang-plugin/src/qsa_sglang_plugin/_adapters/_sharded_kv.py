"""Resident cache sharding (``SGLANG_QSA_CACHE_SHARDING=N``, no offload) inside SGLang.

SGLang's batches as :class:`qsa_kernels.sharded.ShardedKVStore` calls, the runner's store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from qsa_kernels.sharded import ShardedKVStore
from qsa_sglang_plugin._adapters._metrics import RankMetrics
from qsa_sglang_plugin._adapters._qsa_common import (
    group_head_layout,
    prefill_kernels,
    qsa_profile_of,
    shard_group,
    zigzag_entries,
)
from qsa_sglang_plugin._adapters._sharded_index import install_rank_index
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError
from qsa_sglang_plugin._switches import current_switches

__all__ = ("attend_extend", "sharded_store_of")

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _CPRows:
    """SGLang's CP strategy as the store's :class:`~qsa_kernels.sharded.RowExchange`."""

    strategy: Any
    forward_batch: Any

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.strategy.gather_hidden_states(rows, self.forward_batch)
        return out

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.strategy.shard_hidden_states(rows, self.forward_batch)
        return out


def attend_extend(  # noqa: PLR0917 (the attention call's own order)
    store: ShardedKVStore,
    layer_id: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    forward_batch: Any,
    req_to_token: torch.Tensor,
    scale: float,
    *,
    cp: bool = False,
) -> torch.Tensor:
    """One QSA layer of an extend batch (:meth:`ShardedKVStore.extend`): ``[T, Hq * D]``."""
    from sglang.srt.layers.cp.utils import get_cp_strategy

    exchange, zigzag = None, None
    if cp:
        strategy, meta = get_cp_strategy(), forward_batch.attn_cp_metadata
        if strategy is None:
            msg = "a context-parallel batch without SGLang's CP strategy"
            raise OffloadRuntimeError(msg)
        exchange = _CPRows(strategy, forward_batch)
        zigzag = zigzag_entries(meta) if int(meta.bs) == 1 else None
    return store.extend(
        layer_id, q, k, v, indices, slots=forward_batch.out_cache_loc,
        extend_lens=[int(n) for n in forward_batch.extend_seq_lens_cpu],
        seq_lens=[int(n) for n in forward_batch.seq_lens_cpu], slot_table=req_to_token,
        table_rows=forward_batch.req_pool_indices, scale=scale, kernels=prefill_kernels(),
        exchange=exchange, zigzag=zigzag,
    )  # fmt: skip


def _build_store(runner: Any) -> ShardedKVStore:
    from sglang.srt.runtime_context import get_parallel

    sharding = current_switches().cache_sharding
    shard = shard_group(runner, sharding)
    if shard is None:
        msg = f"cache sharding over {sharding!r} rank builds no shard group"
        raise ConfigurationError(msg)
    pool = runner.token_to_kv_pool
    full = pool.full_kv_pool
    parallel = get_parallel()
    device = torch.device(runner.device)
    runtime = ShardedKVStore(
        shard,
        dict(pool.full_attention_layer_id_mapping),
        slots=int(full.size) + int(full.page_size),
        kv_heads=int(full.head_num),
        head_dim=int(full.head_dim),
        dtype=full.dtype,  # the logical dtype (fp8 pools hand out fp8 views)
        q_heads=int(runner.model_config.get_num_attention_heads(parallel.attn_tp_size)),
        block_topk=int(qsa_profile_of(runner.model_config).block_topk),
        max_rows=int(runner.req_to_token_pool.size),
        device=device,
        head_layout=group_head_layout(),
    )
    RankMetrics(int(parallel.tp_rank)).gauge(
        "qsa_hisparse_sharded_kv_bytes",
        "Bytes of this rank's share of the QSA layers' raw K/V (cache sharding).",
    ).set(runtime.nbytes)
    logger.info("cache sharding (resident): %s", runtime.describe())
    if current_switches().index_sharding:  # D2 on the store's group
        index = runtime.index(int(runner.req_to_token_pool.size))
        install_rank_index(index, pool, int(parallel.tp_rank))
    return runtime


def sharded_store_of(runner: Any) -> ShardedKVStore:
    """The one sharded store of ``runner`` (built on first use)."""
    store = getattr(runner, "qsa_sharded_kv", None)
    if store is None:
        store = runner.qsa_sharded_kv = _build_store(runner)
    return store
