"""SGLang's pool sizing repriced by :class:`qsa_core.PoolPrice` (what ``plan_capacity`` prints).

One AFTER hook on ``DefaultPoolConfigurator.__init__`` (SGLang has no registry for pool sizing)
reads SGLang's own per-token costs from the configurator it just built and writes the feature's
price into its private ``_cell_size`` and ``_fixed_overhead_bytes``. The switches turn on at
most one feature that reprices. The capacity plan (``capacity_plan_from_sglang``) prices its
layouts with the same ``PoolPrice`` methods and the same ``ShardedKVStore.transport_bytes``;
``test_pool_pricing.py`` pins that both agree for every feature.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from qsa_core import PoolPrice, label_bytes_per_token
from qsa_sglang_plugin._switches import (
    DoubleSparsitySwitches,
    HiSparseMode,
    current_switches,
)

if TYPE_CHECKING:
    import torch


__all__ = ("after_pool_configurator_init", "labelled_price")

logger = logging.getLogger(__name__)


def after_pool_configurator_init(
    result: object, configurator: Any, kvc: Any, *args: object, **kwargs: object
) -> None:
    """AFTER hook on ``DefaultPoolConfigurator.__init__``: reprice for the requested features."""
    del result, args, kwargs
    switches = current_switches()
    if switches.hisparse is HiSparseMode.P2_OFFLOAD:
        _charge(configurator, "offload", _offloaded_price(configurator, kvc))
    if switches.resident_sharding:
        _charge(configurator, "cache sharding", _sharded_price(configurator, kvc))
    if switches.double_sparsity is not None:
        price = _label_price(configurator, kvc, switches.double_sparsity)
        _charge(configurator, "qsa_ds", price)


def _charge(configurator: Any, feature: str, price: PoolPrice | None) -> None:
    """Write ``price`` into SGLang's configurator (None: the model has no QSA layers)."""
    if price is None:
        return
    configurator._cell_size = price.token_bytes
    configurator._fixed_overhead_bytes += price.fixed_bytes
    logger.info("%s: %s", feature, price.detail)


def _qsa_layers(kvc: Any) -> int | None:
    """The QSA (full attention) layers of a hybrid model; None for any other model."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    hybrid = mambaish_config(kvc.model_config)
    return None if hybrid is None else len(hybrid.full_attention_layer_ids)


def _index_bytes_per_token(configurator: Any, kvc: Any, layers: int) -> int:
    """SGLang's price of a token's compressed index (its QSA pool), over ``layers`` layers."""
    hf_config = kvc.model_config.hf_config
    return int(configurator._compute_qsa_cell_size(hf_config=hf_config, num_layers=layers))


def _offloaded_price(configurator: Any, kvc: Any) -> PoolPrice | None:
    from sglang.srt.runtime_context import get_parallel

    from qsa_sglang_plugin._adapters._offload import arena_rows, offload_geometry, staged_prompts

    layers = _qsa_layers(kvc)
    if layers is None:
        return None
    model_config = kvc.model_config
    geometry = offload_geometry(
        model_config,
        layers=layers,
        rows=arena_rows(kvc),
        staged_prompts=staged_prompts(kvc.server_args),
        kv_heads=int(model_config.get_num_kv_heads(get_parallel().attn_tp_size)),
        head_dim=int(model_config.head_dim),
        dtype=kvc.kv_cache_dtype,
    )
    return PoolPrice.offloaded(
        geometry.sizes,
        resident_token_bytes=int(configurator._cell_size),
        index_token_bytes=_index_bytes_per_token(configurator, kvc, layers),
        verify=current_switches().verify_offload,
    )


def _sharded_price(configurator: Any, kvc: Any) -> PoolPrice | None:
    from sglang.srt.runtime_context import get_parallel

    from qsa_kernels.sharded import ShardedKVStore
    from qsa_sglang_plugin._adapters._qsa_common import group_head_layout, qsa_profile_of

    layers = _qsa_layers(kvc)
    if layers is None:
        return None
    model_config = kvc.model_config
    sharding = current_switches().cache_sharding
    index_sharded = current_switches().index_sharding
    rows = kvc.server_args.max_running_requests
    transport = ShardedKVStore.transport_bytes(
        world_size=sharding,
        max_rows=1 if rows is None else int(rows),
        block_topk=int(qsa_profile_of(model_config).block_topk),
        q_heads=int(model_config.get_num_attention_heads(get_parallel().attn_tp_size)),
        head_dim=int(model_config.head_dim),
        layout=group_head_layout(),
        index_sharded=index_sharded,
    )
    return PoolPrice.sharded(
        resident_token_bytes=int(configurator._cell_size),
        index_token_bytes=_index_bytes_per_token(configurator, kvc, layers),
        sharding_size=sharding,
        transport_bytes=transport,
        index_sharded=index_sharded,
    )


def labelled_price(
    text_config: Any,
    switches: DoubleSparsitySwitches,
    *,
    kv_token_bytes: int,
    kv_heads: int,
    dtype: torch.dtype,
    rows: int | None,
    context_len: int,
    verify: bool = False,
) -> PoolPrice | None:
    """Double sparsity's pool price on one rank: :meth:`PoolPrice.labelled`.

    A token costs its K/V (``kv_token_bytes``, bytes) and its label rows, or with DS-Offload its
    label rows alone and the offload's buffers for ``rows`` requests of ``context_len`` tokens
    are fixed.

    Args:
        text_config: the model's text config (a mapping).
        switches: the double-sparsity switches.
        kv_token_bytes: a token's K/V on this rank, bytes.
        kv_heads: this rank's KV heads.
        dtype: the K/V cache dtype (the labels' follows it).
        rows: ``--max-running-requests`` (DS-Offload's arena rows); None prices no offload.
        context_len: tokens of one request's context.
        verify: the offload keeps a resident copy of every row.

    Returns:
        The price, or None with DS-Offload and no ``rows``.
    """
    from qsa_kernels.double_sparsity import LabelCache
    from qsa_sglang_plugin._adapters._offload import ds_offload_geometry
    from qsa_sglang_plugin._config_check import ds_geometry

    layers, _, _, _ = ds_geometry(text_config)
    element = LabelCache.dtype_for(dtype).itemsize
    labels = label_bytes_per_token(layers, kv_heads, switches.heavy_channel_num, element)
    offload = None
    if switches.offload:
        if rows is None:
            return None
        offload = ds_offload_geometry(
            text_config,
            switches,
            rows=rows,
            context_len=context_len,
            kv_heads=kv_heads,
            dtype=dtype,
        ).sizes
    return PoolPrice.labelled(
        kv_token_bytes=kv_token_bytes, label_token_bytes=labels, offload=offload, verify=verify
    )


def _label_price(configurator: Any, kvc: Any, switches: DoubleSparsitySwitches) -> PoolPrice | None:
    from sglang.srt.runtime_context import get_parallel

    from qsa_sglang_plugin._adapters._offload import arena_rows

    model_config = kvc.model_config
    return labelled_price(
        model_config.hf_text_config.to_dict(),
        switches,
        kv_token_bytes=int(configurator._cell_size),
        kv_heads=int(model_config.get_num_kv_heads(get_parallel().attn_tp_size)),  # this rank's
        dtype=kvc.kv_cache_dtype,
        rows=arena_rows(kvc) if switches.offload else None,
        context_len=int(model_config.context_len),
        verify=current_switches().verify_offload,
    )
