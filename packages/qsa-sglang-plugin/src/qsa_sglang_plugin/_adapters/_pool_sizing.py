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
from typing import Any

from qsa_core import CapacityError, PoolPrice
from qsa_sglang_plugin._errors import ConfigurationError
from qsa_sglang_plugin._switches import HiSparseMode, current_switches

__all__ = ("after_pool_configurator_init",)

logger = logging.getLogger(__name__)


def after_pool_configurator_init(
    result: object, configurator: Any, kvc: Any, *args: object, **kwargs: object
) -> None:
    """AFTER hook on ``DefaultPoolConfigurator.__init__``: reprice for the requested features.

    Raises:
        ConfigurationError: qsa-core refuses a size of the price (naming it).
    """
    del result, args, kwargs
    switches = current_switches()
    for feature, price_of, on in (
        ("offload", _offloaded_price, switches.hisparse is HiSparseMode.P2_OFFLOAD),
        ("cache sharding", _sharded_price, switches.resident_sharding),
        ("qsa_ds", _label_price, switches.double_sparsity is not None),
    ):
        try:
            price = price_of(configurator, kvc) if on else None
        except CapacityError as exc:
            raise ConfigurationError(f"pool sizing cannot price {feature}: {exc}") from exc
        if price is not None:  # None: the model has no QSA layers
            configurator._cell_size = price.token_bytes
            configurator._fixed_overhead_bytes += price.fixed_bytes
            logger.info("%s: %s", feature, price.detail)


def _qsa_layer_ids(kvc: Any) -> list[int] | None:
    """The QSA (full attention) layers of a hybrid model; None for any other model."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    hybrid = mambaish_config(kvc.model_config)
    return None if hybrid is None else list(hybrid.full_attention_layer_ids)


def _token_bytes(configurator: Any, kvc: Any, layers: int) -> tuple[int, int]:
    """SGLang's price of a token resident, and of its compressed index over ``layers`` layers."""
    hf_config = kvc.model_config.hf_config
    index = configurator._compute_qsa_cell_size(hf_config=hf_config, num_layers=layers)
    return int(configurator._cell_size), int(index)


def _arena_rows(kvc: Any) -> int:
    """``--max-running-requests``: the offload's host-arena rows.

    Raises:
        ConfigurationError: it was not given (start-up refuses it earlier).
    """
    rows = kvc.server_args.max_running_requests
    if rows is None:
        msg = "the offload sizes its host arena by --max-running-requests; give one"
        raise ConfigurationError(msg)
    return int(rows)


def _offloaded_price(configurator: Any, kvc: Any) -> PoolPrice | None:
    from sglang.srt.runtime_context import get_parallel

    from qsa_sglang_plugin._adapters._offload import qsa_layout

    layer_ids = _qsa_layer_ids(kvc)
    if layer_ids is None:
        return None
    model_config = kvc.model_config
    layout = qsa_layout(
        model_config,
        kvc.server_args,
        layer_ids,
        rows=_arena_rows(kvc),
        kv_heads=int(model_config.get_num_kv_heads(get_parallel().attn_tp_size)),
        head_dim=int(model_config.head_dim),
        dtype=kvc.kv_cache_dtype,
    )
    resident, index = _token_bytes(configurator, kvc, len(layer_ids))
    return PoolPrice.offloaded(
        layout.geometry.sizes,
        resident_token_bytes=resident,
        index_token_bytes=index,
        verify=current_switches().verify_offload,
    )


def _sharded_price(configurator: Any, kvc: Any) -> PoolPrice | None:
    from sglang.srt.runtime_context import get_parallel

    from qsa_kernels.sharded import ShardedKVStore
    from qsa_sglang_plugin._adapters._qsa_common import group_head_layout, qsa_profile_of

    layer_ids = _qsa_layer_ids(kvc)
    if layer_ids is None:
        return None
    model_config, switches = kvc.model_config, current_switches()
    rows = kvc.server_args.max_running_requests
    transport = ShardedKVStore.transport_bytes(
        world_size=switches.cache_sharding,
        max_rows=1 if rows is None else int(rows),
        block_topk=int(qsa_profile_of(model_config).block_topk),
        q_heads=int(model_config.get_num_attention_heads(get_parallel().attn_tp_size)),
        head_dim=int(model_config.head_dim),
        layout=group_head_layout(),
        index_sharded=switches.index_sharding,
    )
    resident, index = _token_bytes(configurator, kvc, len(layer_ids))
    return PoolPrice.sharded(
        resident_token_bytes=resident,
        index_token_bytes=index,
        sharding_size=switches.cache_sharding,
        transport_bytes=transport,
        index_sharded=switches.index_sharding,
    )


def _label_price(configurator: Any, kvc: Any) -> PoolPrice | None:
    """Double sparsity's price of a token of SGLang's K/V (``_cell_size``) on this rank."""
    from sglang.srt.runtime_context import get_parallel

    from qsa_sglang_plugin._adapters._capacity import labelled

    switches = current_switches()
    ds, model_config = switches.double_sparsity, kvc.model_config
    assert ds is not None  # the hook prices labels only with double sparsity on
    return labelled(
        model_config.hf_text_config.to_dict(),
        ds,
        kv_heads=int(model_config.get_num_kv_heads(get_parallel().attn_tp_size)),  # this rank's
        dtype=kvc.kv_cache_dtype,
        kv_token_bytes=int(configurator._cell_size),
        rows=_arena_rows(kvc) if ds.offload else None,
        context_len=int(model_config.context_len),
        verify=switches.verify_offload,
    ).price
