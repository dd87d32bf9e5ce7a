"""``p2-offload`` inside SGLang: the QSA layers' K/V off SGLang's pool, history in host memory.

The offload itself is :class:`qsa_kernels.offload.OffloadRuntime` (staging, hand-off, the planned
decode step, rows; engine-neutral). This module translates SGLang's objects to its calls:

- the attention backend (:class:`._backends.HiSparseOffloadBackend`), a subclass of upstream's
  ``QwenSparseAttnBackend`` that the AFTER hook on ``attn_backend_wrapper`` (:mod:`._qsa_backend`)
  puts in the hybrid GDN backend's full-attention place. An extend batch stages its chunk
  (:func:`stage_chunk`) and attends with upstream's kernels over the staged prompt; a decode
  step is planned from the ``ForwardBatch`` (:func:`plan_decode`, outside the captured graph
  under decode CUDA graphs, SGLang's padding rows becoming free rows) and each QSA layer decodes
  through :meth:`OffloadRuntime.decode_layer`;
- the ``qsa_hisparse`` tree cache (:mod:`._lifecycle`), which admits a request's lease with its
  ``req_pool_idx`` (:meth:`OffloadRuntime.admit`) and releases it when SGLang frees the row;
- the geometry pool sizing prices (:func:`offload_geometry`, :func:`qsa_hot_slots`,
  :func:`ds_offload_geometry`; the pricing itself is :mod:`._pool_sizing`'s), and SGLang's
  full-KV pool is a one-page stub (:mod:`._kv_pool`);
- the runtime's construction from the model runner (:func:`runtime_of`): its geometry from the
  model and pools, its shard group under ``SGLANG_QSA_CACHE_SHARDING=N`` (the TP ranks holding
  copies of one K/V head, :func:`._qsa_common.shard_group`), the query-head layout under
  SGLang's prefill CP (``HeadLayout.REPLICATED``: every rank holds every head), and
  ``SGLANG_QSA_HISPARSE_VERIFY=1`` (a resident copy of every row compared byte for byte on
  release: the tests' proof of the bytes on the host).

Under SGLang's QSA prefill CP (``--enable-prefill-cp``, zigzag over the TP group) every rank
stages the whole gathered chunk and attends its own zigzag rows over the staging area
(:func:`._qsa_common.attend_context`), so every rank holds, hands off and offloads the whole
prompt.

Operators see the runtime's counts (:class:`qsa_kernels.offload.OffloadCounts`) as
``qsa_hisparse_host_arena_bytes``, ``qsa_hisparse_offload_rows_in_use``,
``qsa_hisparse_offload_decode_steps_total``, ``qsa_hisparse_selected_blocks_total``,
``qsa_hisparse_fetched_blocks_total`` (selected blocks that missed the hot cache) and, with
verification, ``qsa_hisparse_offload_{verified,differing}_bytes_total`` on SGLang's Prometheus
endpoint, and a log line with the hot-cache hit rate every
:data:`qsa_kernels.offload.LOG_EVERY_STEPS` decode steps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from qsa_core import CapacityError, ds_offload_sizes, format_bytes, hot_cache_slots
from qsa_kernels import BLOCK_TOKENS, KernelInputError
from qsa_kernels.offload import (
    OffloadCounts,
    OffloadedKV,
    OffloadGeometry,
    OffloadRuntime,
    PerHeadOffloadedKV,
)
from qsa_sglang_plugin._adapters._metrics import RankMetrics, advance_counters
from qsa_sglang_plugin._adapters._qsa_common import (
    group_head_layout,
    qsa_profile_of,
    shard_group,
)
from qsa_sglang_plugin._config_check import ds_config, ds_geometry
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError
from qsa_sglang_plugin._hostmem import meminfo_bytes
from qsa_sglang_plugin._switches import DoubleSparsitySwitches, current_switches

__all__ = (
    "OffloadLayout",
    "arena_rows",
    "ds_offload_geometry",
    "offload_geometry",
    "plan_decode",
    "qsa_hot_slots",
    "runtime_of",
    "stage_chunk",
)

logger = logging.getLogger(__name__)


class _Metrics:
    """The runtime's :class:`OffloadCounts` as Prometheus series of one TP rank."""

    def __init__(self, tp_rank: int, arena_bytes: int) -> None:
        make = RankMetrics(tp_rank)
        gauge, counter = make.gauge, make.counter
        gauge(
            "qsa_hisparse_host_arena_bytes", "Bytes of the host arena of the QSA layers' K/V."
        ).set(arena_bytes)
        self._rows_in_use = gauge(
            "qsa_hisparse_offload_rows_in_use", "Host arena rows that hold a request's K/V."
        )
        self._counters = {
            "decode_steps": counter(
                "qsa_hisparse_offload_decode_steps", "Decode steps served from the host arena."
            ),
            "selected_blocks": counter(
                "qsa_hisparse_selected_blocks", "Complete blocks the indexer selected, all layers."
            ),
            "fetched_blocks": counter(
                "qsa_hisparse_fetched_blocks",
                "Selected blocks that missed the hot cache and were read from the host arena.",
            ),
            "verified_bytes": counter(
                "qsa_hisparse_offload_verified_bytes",
                "K/V bytes of released rows compared with their resident copy (verification on).",
            ),
            "differing_bytes": counter(
                "qsa_hisparse_offload_differing_bytes",
                "Compared K/V bytes that differed from their resident copy (verification on).",
            ),
        }
        self._seen = OffloadCounts()

    def update(self, counts: OffloadCounts) -> None:
        """Set the gauge and advance each counter by what ``counts`` added since the last call."""
        self._rows_in_use.set(counts.rows_in_use)
        advance_counters(self._counters, counts, self._seen)
        self._seen = counts


def plan_decode(
    runtime: OffloadRuntime, forward_batch: Any, *, graph: bool = False, capture: bool = False
) -> None:
    """Plan a decode step of SGLang's ``ForwardBatch`` (:meth:`OffloadRuntime.plan_decode`).

    Args:
        runtime: the model runner's runtime.
        forward_batch: a decode step's ``ForwardBatch``, or the CUDA graph runner's padded view
            of one (``batch_size`` rows, the last ``num_padding`` of them padding).
        graph: the step replays a captured CUDA graph of ``batch_size`` rows.
        capture: the step is being captured: every row is padding.
    """
    batch = int(forward_batch.batch_size)
    real = 0 if capture else batch - int(getattr(forward_batch, "num_padding", 0) or 0)
    lens = forward_batch.seq_lens_cpu
    runtime.plan_decode(
        forward_batch.req_pool_indices[:real].tolist(),
        (lens if lens is not None else forward_batch.seq_lens)[:real].tolist(),
        pad_to=batch if graph or capture else None,
        capture=capture,
    )


def stage_chunk(
    runtime: OffloadRuntime, layer_id: int, k: torch.Tensor, v: torch.Tensor, forward_batch: Any
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Stage one layer's chunk of an extend batch (:meth:`OffloadRuntime.stage`).

    Returns:
        ``(k [T, Hkv, D], v [T, Hkv, D], start)``: the staged prompt up to the chunk's end and
        how many tokens came before the chunk.

    Raises:
        OffloadRuntimeError: the batch extends more than one request (the offload stages one
            prompt at a time, ``--prefill-max-requests 1``).
    """
    slots = forward_batch.req_pool_indices
    if int(slots.numel()) != 1:
        msg = (
            f"an extend batch of {int(slots.numel())!r} requests; p2-offload stages one prompt "
            "at a time (--prefill-max-requests=1)"
        )
        raise OffloadRuntimeError(msg)
    end = int(forward_batch.seq_lens_cpu[0])
    start = end - int(forward_batch.extend_seq_lens_cpu[0])
    staged_k, staged_v = runtime.stage(layer_id, k, v, slot=int(slots[0]), start=start, end=end)
    return staged_k, staged_v, start


# ---- construction --------------------------------------------------------------------------------


def _verification_requested() -> bool:
    return current_switches().verify_offload


def _blocks(tokens: int) -> int:
    """4-token blocks that hold ``tokens`` tokens (the last one may be open)."""
    return math.ceil(tokens / BLOCK_TOKENS)


def qsa_hot_slots(block_topk: int, context_len: int) -> int:
    """Hot-cache slots per (request, QSA layer).

    ``SGLANG_QSA_HISPARSE_HOT_BLOCKS`` or qsa-core's default, no more than a context's blocks
    and never fewer than one step's selection (:func:`qsa_core.hot_cache_slots`). Start-up has
    checked the switch against ``block_topk``.
    """
    return hot_cache_slots(block_topk, current_switches().hot_blocks, context_len=context_len)


def arena_rows(kvc: Any) -> int:
    """Host-arena rows an engine's offload allocates: one per running request.

    Args:
        kvc: SGLang's ``KVCacheConfigurator`` input (its ``server_args``).

    Raises:
        ConfigurationError: ``--max-running-requests`` was not given (start-up refuses it
            earlier; pool sizing must not guess).
    """
    rows = kvc.server_args.max_running_requests
    if rows is None:
        msg = "the offload sizes its host arena by --max-running-requests; give one"
        raise ConfigurationError(msg)
    return int(rows)


def offload_geometry(
    *,
    layers: int,
    rows: int,
    context_len: int,
    hot_slots: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    per_head: bool = False,
) -> OffloadGeometry:
    """The arena, hot caches and tails of ``rows`` requests of up to ``context_len`` tokens.

    ``per_head``: one record per (block, KV head), for tokens chosen per head (DS-Offload).

    Raises:
        ConfigurationError: the library refuses a size (naming it).
    """
    try:
        return OffloadGeometry(
            layers=layers,
            rows=rows,
            hot_slots=hot_slots,
            max_blocks=_blocks(context_len),
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            per_head=per_head,
        )
    except KernelInputError as exc:
        raise ConfigurationError(f"the offload cannot hold this KV cache: {exc}") from exc


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadLayout:
    """What one model runner's offload holds, from its model and pools.

    Attributes:
        geometry: the arena, hot caches and tails.
        layer_ordinal: SGLang layer id of each offloaded attention layer -> its index in the
            geometry (``[0, L)``).
        block_topk: the QSA indexer's block selection width; None for double sparsity.
    """

    geometry: OffloadGeometry
    layer_ordinal: Mapping[int, int]
    block_topk: int | None


def _qsa_layout(runner: Any) -> OffloadLayout:
    """The offload of a QSA model's runner: its QSA layers, the indexer's top-k blocks hot."""
    pool = runner.token_to_kv_pool
    full = pool.full_kv_pool
    layer_ordinal = dict(pool.full_attention_layer_id_mapping)
    profile = qsa_profile_of(runner.model_config)
    geometry = offload_geometry(
        layers=len(layer_ordinal),
        rows=int(runner.req_to_token_pool.size),
        context_len=int(runner.model_config.context_len),
        hot_slots=qsa_hot_slots(int(profile.block_topk), int(runner.model_config.context_len)),
        kv_heads=int(full.head_num),
        head_dim=int(full.head_dim),
        dtype=full.dtype,  # the logical dtype (fp8 pools store uint8 and hand out fp8 views)
    )
    return OffloadLayout(geometry, layer_ordinal, int(profile.block_topk))


def ds_offload_geometry(
    text_config: Any,
    switches: DoubleSparsitySwitches,
    *,
    rows: int,
    context_len: int,
    kv_heads: int,
    dtype: torch.dtype,
) -> OffloadGeometry:
    """DS-Offload's ``OffloadGeometry``.

    Every attention layer, one record per (block, KV head), so a head's chosen token moves only
    that head's bytes, and per-head hot caches that hold the blocks one step may read
    (:meth:`DSConfig.hot_blocks`, at most a whole context: :func:`qsa_core.ds_offload_sizes`).

    Raises:
        ConfigurationError: the library refuses a size (naming it).
    """
    layers, _, _, head_dim = ds_geometry(text_config)
    try:
        sizes = ds_offload_sizes(
            layers=layers,
            rows=rows,
            context_len=context_len,
            hot_blocks=ds_config(switches).hot_blocks(),
            kv_heads=kv_heads,
            head_dim=head_dim,
            element_bytes=torch.empty((), dtype=dtype).element_size(),
        )
    except CapacityError as exc:
        raise ConfigurationError(f"the offload cannot hold this KV cache: {exc}") from exc
    return offload_geometry(
        layers=layers,
        rows=rows,
        context_len=context_len,
        hot_slots=sizes.hot_slots,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        per_head=True,
    )


def _ds_layout(runner: Any, switches: DoubleSparsitySwitches) -> OffloadLayout:
    """The offload of a double-sparsity model's runner: every attention layer, by layer id."""
    pool = runner.token_to_kv_pool
    geometry = ds_offload_geometry(
        runner.model_config.hf_text_config.to_dict(),
        switches,
        rows=int(runner.req_to_token_pool.size),
        context_len=int(runner.model_config.context_len),
        kv_heads=int(pool.head_num),
        dtype=pool.dtype,  # the logical dtype
    )
    return OffloadLayout(geometry, {i: i for i in range(geometry.layers)}, None)


def _build_runtime(runner: Any) -> OffloadRuntime:
    """The runtime of one model runner, sized from its pools and its model (QSA or DS)."""
    from sglang.srt.runtime_context import get_parallel

    switches = current_switches()
    ds = switches.double_sparsity
    layout = _qsa_layout(runner) if ds is None else _ds_layout(runner, ds)
    geometry = layout.geometry
    rows, context_len = geometry.rows, int(runner.model_config.context_len)
    shard = shard_group(runner, switches.cache_sharding)
    arena = geometry.arena_bytes(shard)
    available = meminfo_bytes("MemAvailable")
    if available is not None and arena > available:
        msg = (
            f"the host arena needs {format_bytes(arena)} ({rows} rows x "
            f"{geometry.store_layers} record layers x {geometry.arena_blocks(shard)} blocks x "
            f"{geometry.record_bytes} B) but the host has {format_bytes(available)} available; "
            f"lower --max-running-requests={rows} or --context-length={context_len}"
        )
        raise ConfigurationError(msg)
    device = torch.device(runner.device)
    kv = (  # DS-Offload's per-head records take no shard group (its switches refuse one)
        OffloadedKV(geometry, device, shard=shard)
        if ds is None
        else PerHeadOffloadedKV(geometry, device)
    )
    verify = _verification_requested()
    parallel = get_parallel()
    metrics = _Metrics(int(parallel.tp_rank), int(kv.host_arena.nbytes))
    runtime = OffloadRuntime(
        kv,
        layout.layer_ordinal,
        layout.block_topk,
        verify=verify,
        on_counts=metrics.update,
        q_heads=int(runner.model_config.get_num_attention_heads(parallel.attn_tp_size)),
        head_layout=group_head_layout(),
    )
    if shard is not None:
        logger.info(
            "offload: cache sharding over %d ranks (this rank is %d of its group): the host "
            "arena holds every %d-th page of %d blocks, %s of %s per rank",
            shard.world_size,
            shard.rank,
            shard.world_size,
            shard.placement.blocks_per_page,
            format_bytes(arena),
            format_bytes(geometry.host_bytes),
        )
    if verify:
        logger.warning(
            "offload: SGLANG_QSA_HISPARSE_VERIFY=1: a resident copy of every row's K/V (%s) is "
            "kept on %s and checked against the host arena when each request ends",
            format_bytes(geometry.host_bytes),
            kv.device,
        )
    pool = runner.token_to_kv_pool
    full = getattr(pool, "full_kv_pool", pool)  # the QSA pool's MHA leaf, or the MHA pool
    logger.info(
        "offload: host arena %s (%d rows x %d attention layers x %d blocks, %s records, %s, %s); "
        "on %s: staging, hot caches (%d blocks per request, layer and %s), tails and tables %s; "
        "K/V pool %s; kernels: %s",
        format_bytes(arena),
        rows,
        geometry.layers,
        geometry.arena_blocks(shard),
        "per-head" if geometry.per_head else "all-head",
        str(geometry.dtype).removeprefix("torch."),
        "pinned" if kv.host_arena.is_pinned() else "pageable",
        kv.device,
        geometry.hot_slots,
        "KV head" if geometry.per_head else "every KV head",
        format_bytes(OffloadRuntime.fixed_device_bytes(geometry)),
        format_bytes(sum(int(n) for n in full.get_kv_size_bytes())),  # (K bytes, V bytes)
        kv.path.value,
    )
    return runtime


def runtime_of(runner: Any) -> OffloadRuntime:
    """The one runtime of ``runner`` (built on first use, shared by all its backends)."""
    runtime = getattr(runner, "qsa_offload_runtime", None)
    if runtime is None:
        runtime = runner.qsa_offload_runtime = _build_runtime(runner)
    return runtime
