"""The price of a token in SGLang's pool sizing, under each feature that changes it.

One AFTER hook on ``DefaultPoolConfigurator.__init__`` (SGLang has no registry for pool sizing)
reprices what SGLang computed, with qsa-core's arithmetic (the figures ``qsa_core.plan_capacity``
and the doctor print):

- ``p2-offload`` (:func:`price_offloaded_pool`): a token costs its compressed index only; the
  offload's staging, hot caches, tails and tables are fixed overhead
  (:meth:`qsa_core.OffloadSizes.fixed_device_bytes`);
- cache sharding without an offload (:func:`price_sharded_pool`): a token costs its index and
  ``1 / N`` of its raw K/V (:func:`qsa_core.sharded_token_bytes`), the transport buffers are
  fixed overhead;
- double sparsity (:func:`price_label_cache`): a token also costs its label rows
  (:func:`qsa_core.label_bytes_per_token`); with DS-Offload its label rows alone, and the
  offload's buffers (:func:`qsa_core.ds_offload_sizes`) are fixed overhead.

The switches turn on at most one of them. SGLang's own per-token costs (its index pool, its K/V
pool) are read from the configurator it just built.
"""

from __future__ import annotations

import logging
from typing import Any

from qsa_core import format_bytes, label_bytes_per_token, sharded_token_bytes
from qsa_sglang_plugin._switches import (
    DoubleSparsitySwitches,
    HiSparseMode,
    current_switches,
)

__all__ = (
    "after_pool_configurator_init",
    "price_label_cache",
    "price_offloaded_pool",
    "price_sharded_pool",
)

logger = logging.getLogger(__name__)


def after_pool_configurator_init(
    result: object, configurator: Any, kvc: Any, *args: object, **kwargs: object
) -> None:
    """AFTER hook on ``DefaultPoolConfigurator.__init__``: reprice for the requested features."""
    del result, args, kwargs
    switches = current_switches()
    if switches.hisparse is HiSparseMode.P2_OFFLOAD:
        price_offloaded_pool(configurator, kvc)
    if switches.resident_sharding:
        price_sharded_pool(configurator, kvc)
    if switches.double_sparsity is not None:
        price_label_cache(configurator, kvc, switches.double_sparsity)


def _qsa_layers(kvc: Any) -> int | None:
    """The QSA (full attention) layers of a hybrid model; None for any other model."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    hybrid = mambaish_config(kvc.model_config)
    return None if hybrid is None else len(hybrid.full_attention_layer_ids)


def _index_bytes_per_token(configurator: Any, kvc: Any, layers: int) -> int:
    """SGLang's price of a token's compressed index (its QSA pool), over ``layers`` layers."""
    hf_config = kvc.model_config.hf_config
    return int(configurator._compute_qsa_cell_size(hf_config=hf_config, num_layers=layers))


def price_offloaded_pool(configurator: Any, kvc: Any) -> None:
    """Price SGLang's pools with p2-offload (``DefaultPoolConfigurator`` just built them).

    With a QSA model, a token costs only its compressed index (``_compute_qsa_cell_size``);
    staging, hot caches, tails and tables are fixed overhead.
    """
    from sglang.srt.runtime_context import get_parallel

    from qsa_sglang_plugin._adapters._offload import arena_rows, offload_geometry, qsa_hot_slots
    from qsa_sglang_plugin._adapters._qsa_common import qsa_profile_of

    layers = _qsa_layers(kvc)
    if layers is None:
        return
    model_config = kvc.model_config
    context_len = int(model_config.context_len)
    geometry = offload_geometry(
        layers=layers,
        rows=arena_rows(kvc),
        context_len=context_len,
        hot_slots=qsa_hot_slots(int(qsa_profile_of(model_config).block_topk), context_len),
        kv_heads=int(model_config.get_num_kv_heads(get_parallel().attn_tp_size)),
        head_dim=int(model_config.head_dim),
        dtype=kvc.kv_cache_dtype,
    )
    resident = int(configurator._cell_size)
    index_only = _index_bytes_per_token(configurator, kvc, layers)
    fixed = geometry.sizes.fixed_device_bytes(verify=current_switches().verify_offload)
    configurator._cell_size = index_only
    configurator._fixed_overhead_bytes += fixed
    logger.info(
        "offload: pool sizing charges %d B per token (was %d B with the QSA layers' K/V) plus "
        "%s fixed (staging, hot caches, tails, tables)",
        index_only,
        resident,
        format_bytes(fixed),
    )


def price_sharded_pool(configurator: Any, kvc: Any) -> None:
    """Price SGLang's pools with resident cache sharding (``DefaultPoolConfigurator`` built them).

    A token costs its compressed index and ``1 / N`` of its raw K/V; the transport buffers are
    fixed overhead.
    """
    from sglang.srt.runtime_context import get_parallel

    from qsa_kernels.sharded import ShardedKVStore
    from qsa_sglang_plugin._adapters._qsa_common import group_head_layout, qsa_profile_of

    layers = _qsa_layers(kvc)
    if layers is None:
        return
    model_config = kvc.model_config
    sharding = current_switches().cache_sharding
    resident = int(configurator._cell_size)
    index_only = _index_bytes_per_token(configurator, kvc, layers)
    raw = resident - index_only
    cell = sharded_token_bytes(raw, index_only, sharding)
    rows = kvc.server_args.max_running_requests
    fixed = ShardedKVStore.transport_bytes(
        world_size=sharding,
        max_rows=int(rows) if rows is not None else 1,
        block_topk=int(qsa_profile_of(model_config).block_topk),
        q_heads=int(model_config.get_num_attention_heads(get_parallel().attn_tp_size)),
        head_dim=int(model_config.head_dim),
        layout=group_head_layout(),
    )
    configurator._cell_size = cell
    configurator._fixed_overhead_bytes += fixed
    logger.info(
        "cache sharding: pool sizing charges %d B per token (was %d B: %d B of raw K/V over %d "
        "ranks, %d B of index and state) plus %s of transport buffers",
        cell,
        resident,
        raw,
        sharding,
        index_only,
        format_bytes(fixed),
    )


def price_label_cache(configurator: Any, kvc: Any, switches: DoubleSparsitySwitches) -> None:
    """Price a token slot in SGLang's pool sizing (``DefaultPoolConfigurator``).

    Its label rows beside its K/V; with DS-Offload its label rows alone, and the offload's device
    buffers (staging, hot caches, tails, tables) as fixed overhead.
    """
    from sglang.srt.runtime_context import get_parallel

    from qsa_kernels.double_sparsity import LabelCache
    from qsa_sglang_plugin._adapters._offload import arena_rows, ds_offload_geometry
    from qsa_sglang_plugin._config_check import ds_geometry

    model_config = kvc.model_config
    text_config = model_config.hf_text_config.to_dict()
    layers, _, _, _ = ds_geometry(text_config)
    kv_heads = int(model_config.get_num_kv_heads(get_parallel().attn_tp_size))  # this rank's
    element = LabelCache.dtype_for(kvc.kv_cache_dtype).itemsize
    labels = label_bytes_per_token(layers, kv_heads, switches.heavy_channel_num, element)
    kv = int(configurator._cell_size)
    if not switches.offload:
        configurator._cell_size = kv + labels
        logger.info(
            "qsa_ds: pool sizing charges %d B per token (%d B of K/V and %d B of labels)",
            kv + labels,
            kv,
            labels,
        )
        return
    geometry = ds_offload_geometry(
        text_config,
        switches,
        rows=arena_rows(kvc),
        context_len=int(model_config.context_len),
        kv_heads=kv_heads,
        dtype=kvc.kv_cache_dtype,
    )
    fixed = geometry.sizes.fixed_device_bytes(verify=current_switches().verify_offload)
    configurator._cell_size = labels
    configurator._fixed_overhead_bytes += fixed
    logger.info(
        "qsa_ds: DS-Offload: pool sizing charges %d B per token of labels (was %d B of K/V and "
        "%d B of labels) plus %.1f MiB fixed (staging, hot caches, tails, tables)",
        labels,
        kv,
        labels,
        fixed / (1 << 20),
    )
