"""QSA cache sharding without an offload (D1, resident): each rank stores its share of the raw K/V.

With ``SGLANG_QSA_CACHE_SHARDING=N`` and no ``SGLANG_QSA_HISPARSE_V3`` mode, the TP ranks that
hold copies of one K/V head form shard groups of ``N`` (:meth:`qsa_core.ShardPlacement.tp_groups`,
the groups :func:`._qsa_common.shard_group` creates). Every rank still computes the whole K/V of
every token and the same block selection with upstream's indexer (the compressed index stays
replicated in SGLang's QSA pool); the raw K/V of the QSA layers is stored once per group:

- **Storage.** SGLang's full-KV leaf holds one page (the pool class of :mod:`._kv_pool`); each
  rank keeps ``[L, NS_local, 2, 4, Hkv, D]`` records of the logical slots it owns (slot ``g`` on
  rank ``g % N`` at local slot ``g // N``, :mod:`qsa_kernels.sharded`), ``1 / N`` of the raw
  bytes SGLang's pool would hold; pool sizing charges a token ``1 / N`` of its raw bytes.
- **Writes.** Every prefill chunk's and decode token's K/V goes to its owner only
  (:func:`~qsa_kernels.sharded.raw_write_targets`, :func:`~qsa_kernels.sharded.write_owned_raw_kv`:
  fixed shapes, no host read).
- **Prefill.** A chunk with no prefix attends over its own K/V, which every rank has, with
  upstream's no-prefix kernel (the torch path on CPU). A chunk after a prefix (chunked prefill)
  attends owner-side: each query token as a decode row of its position
  (:func:`~qsa_kernels.sharded.owner_sparse_prefill`).
- **Decode.** :func:`~qsa_kernels.sharded.owner_sparse_decode` over the indexer's block ids: the
  group's queries are all-gathered, each rank attends every head of the group over the selected
  tokens it owns (compacted to ``owned_token_bound`` columns), and an all-to-all of the fp32
  partials with an LSE merge gives each rank its own heads. One set of transport buffers,
  allocated once, serves every layer; no host read under CUDA graphs.
- **Prefill CP** (SGLang's zigzag CP over the TP group, :func:`attend_extend_cp`): the
  gathered chunk's owned slots go to the store; one request with no prefix attends this rank's
  rows over the gathered chunk, otherwise the rows are gathered back into token order, attended
  as without CP, and each rank keeps its own. Attention TP is 1 there, so the group's ranks hold
  every head (``HeadLayout.REPLICATED``: the partials all-gathered, every rank merges every head).

Operators see ``qsa_hisparse_sharded_kv_bytes`` (this rank's raw K/V store) on SGLang's
Prometheus endpoint and a start-up log line with the per-rank and unsharded bytes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from qsa_core import format_bytes
from qsa_kernels.sharded import ShardedKVStore
from qsa_sglang_plugin._adapters._metrics import RankMetrics
from qsa_sglang_plugin._adapters._qsa_common import (
    attend_context,
    group_head_layout,
    qsa_profile_of,
    shard_group,
)
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError
from qsa_sglang_plugin._switches import current_switches

__all__ = (
    "attend_extend",
    "attend_extend_cp",
    "sharded_store_of",
)

logger = logging.getLogger(__name__)

#: Query tokens of a prefill chunk after a prefix that attend in one owner-side round.
PREFILL_GROUP_ROWS = 256


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
) -> torch.Tensor:
    """One QSA layer of an extend batch: store the owned rows, attend every query token.

    Requests with no prefix attend over their own chunk, which every rank holds whole, with
    upstream's no-prefix kernel (its torch path on CPU); when any request has a prefix each
    request attends owner-side (:meth:`ShardedKVStore.prefill`), in the batch's order on every
    rank.

    Args:
        store: this rank's store.
        layer_id: SGLang's layer id.
        q: ``[T, Hq * D]`` (or ``[T, Hq, D]``) this rank's query heads, ``T`` valid rows.
        k: ``[T, Hkv * D]`` the chunk's keys.
        v: its values.
        indices: ``[T, 4 block_topk + 3]`` the indexer's token positions per query.
        forward_batch: SGLang's ``ForwardBatch`` (``req_pool_indices``, ``out_cache_loc``,
            the host ``seq_lens_cpu`` and ``extend_seq_lens_cpu``).
        req_to_token: SGLang's ``[R, S]`` slot table.
        scale: softmax scale.

    Returns:
        ``[T, Hq * D]`` attention output of this rank's heads, in ``q``'s dtype.
    """
    tokens = int(indices.shape[0])
    store.write(layer_id, k[:tokens], v[:tokens], forward_batch.out_cache_loc[:tokens])
    extend = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    lengths = [int(n) for n in forward_batch.seq_lens_cpu][: len(extend)]
    heads = q.reshape(tokens, -1, store.head_dim)
    if all(n == e for n, e in zip(lengths, extend, strict=True)):
        out = _chunk_attention(heads, k, v, indices, extend, lengths, scale, store.kv_heads)
        return out.reshape(tokens, -1).to(q.dtype)
    parts, start = [], 0
    for i, (length, count) in enumerate(zip(lengths, extend, strict=True)):
        rows = slice(start, start + count)
        positions = torch.arange(length - count, length, device=q.device)
        slot_row = req_to_token[forward_batch.req_pool_indices[i], :length]
        part = store.prefill(layer_id, heads[rows], indices[rows], positions, slot_row, scale)
        parts.append(part)
        start += count
    return torch.cat(parts).to(q.dtype)


def attend_extend_cp(  # noqa: PLR0917 (the attention call's own order)
    store: ShardedKVStore,
    layer_id: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    forward_batch: Any,
    req_to_token: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One QSA layer of a context-parallel extend batch (SGLang's zigzag CP over the group).

    The gathered chunk's owned rows go to the store. One request with no prefix attends its
    zigzag rows over the chunk, which every rank holds whole (:func:`._qsa_common.
    attend_context`). Otherwise the rows are gathered back into token order and every rank
    attends the whole chunk as without CP (:func:`attend_extend`; owner-side after a prefix, the
    group's ranks then holding the same rows) and keeps its own rows: CP still splits every
    other layer's work, and the raw K/V is still stored once per group.

    Args:
        store: this rank's store.
        layer_id: SGLang's layer id.
        q: ``[T, Hq * D]`` (or ``[T, Hq, D]``) this rank's zigzag rows, every head.
        k: ``[N, Hkv * D]`` (or ``[N, Hkv, D]``) the chunk's gathered keys, token order.
        v: its values.
        indices: ``[T, 4 block_topk + 3]`` the indexer's token positions per row.
        forward_batch: SGLang's ``ForwardBatch`` with its ``attn_cp_metadata``.
        req_to_token: SGLang's ``[R, S]`` slot table.
        scale: softmax scale.

    Returns:
        ``[T, Hq * D]`` in ``q``'s dtype.
    """
    from sglang.srt.layers.cp.utils import get_cp_strategy

    meta = forward_batch.attn_cp_metadata
    rows, tokens = int(indices.shape[0]), int(k.shape[0])
    bs = int(meta.bs)
    lengths = [int(n) for n in forward_batch.seq_lens_cpu[:bs]]
    extend = [int(n) for n in forward_batch.extend_seq_lens_cpu[:bs]]
    if bs == 1 and lengths == extend:
        store.write(layer_id, k, v, forward_batch.out_cache_loc[:tokens])
        shape = (tokens, store.kv_heads, store.head_dim)
        heads = q.reshape(rows, -1, store.head_dim)
        out = attend_context(heads, k.reshape(shape), v.reshape(shape), indices, scale, meta)
        return out.reshape(rows, -1).to(q.dtype)
    strategy = get_cp_strategy()
    if strategy is None:
        msg = "a context-parallel batch without SGLang's CP strategy"
        raise OffloadRuntimeError(msg)
    whole_q = strategy.gather_hidden_states(q.reshape(rows, -1), forward_batch)
    whole_indices = strategy.gather_hidden_states(indices, forward_batch)
    out = attend_extend(
        store, layer_id, whole_q, k, v, whole_indices, forward_batch, req_to_token, scale
    )
    mine: torch.Tensor = strategy.shard_hidden_states(out, forward_batch)[:rows]
    return mine


def _chunk_attention(  # noqa: PLR0917
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    extend: list[int],
    lengths: list[int],
    scale: float,
    kv_heads: int,
) -> torch.Tensor:
    """Upstream's no-prefix QSA prefill: each request's queries over its own chunk's K/V.

    ``q [T, Hq, D]``; ``k``, ``v`` ``[T, Hkv * D]``; ``indices [T, W]`` positions in each
    request. Returns ``[T, Hq, D]``.
    """
    from sglang.srt.layers.attention import qwen_sparse_attn_backend as upstream

    tokens, d = q.shape[0], q.shape[2]
    k = k[:tokens].reshape(tokens, kv_heads, d)
    v = v[:tokens].reshape(tokens, kv_heads, d)
    starts = torch.tensor([0, *extend], device=q.device).cumsum(0)[:-1]
    if not q.is_cuda:  # the CPU branch of upstream's forward_extend, over the chunk
        owner = torch.repeat_interleave(
            torch.arange(len(extend), device=q.device), torch.tensor(extend, device=q.device)
        )
        bound = torch.tensor(lengths, device=q.device)[owner].unsqueeze(1)
        inside = (indices >= 0) & (indices < bound)
        rows = torch.where(inside, indices + starts[owner].unsqueeze(1), -1).to(torch.int32)
        out: torch.Tensor = upstream.qsa_sparse_attention(q, k, v, rows, scale)
        return out
    cu_q = torch.nn.functional.pad(starts.new_tensor(extend).cumsum(0), (1, 0)).to(torch.int32)
    out = upstream.sparse_gqa_fwd_interface_triton(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        max(lengths, default=1),
        indices.to(torch.int32).contiguous(),
        cu_q,
        scale,
    )
    return out


# ---- construction and SGLang's side --------------------------------------------------------------


def _build_store(runner: Any) -> ShardedKVStore:
    """The sharded store of one model runner, sized from its pools and its QSA profile."""
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
    logger.info(
        "cache sharding (resident): rank %d of a group of %d stores %s of the QSA layers' raw "
        "K/V on %s (%s unsharded); transport buffers %s; kernels: %s",
        shard.rank,
        shard.world_size,
        format_bytes(runtime.nbytes),
        device,
        format_bytes(runtime.nbytes * shard.world_size),
        format_bytes(runtime.buffer_bytes),
        runtime.path.resolve(device).value,
    )
    return runtime


def sharded_store_of(runner: Any) -> ShardedKVStore:
    """The one sharded store of ``runner`` (built on first use)."""
    store = getattr(runner, "qsa_sharded_kv", None)
    if store is None:
        store = runner.qsa_sharded_kv = _build_store(runner)
    return store
