"""SGLang's pool sizing and the doctor's figures, priced by ``qsa_core`` (one capacity model).

One AFTER hook on ``DefaultPoolConfigurator.__init__`` (SGLang has no registry for pool sizing)
reads SGLang's own per-token costs from the configurator it just built and writes the feature's
:class:`qsa_core.PoolPrice` into its private ``_cell_size`` and ``_fixed_overhead_bytes``; the
switches turn on at most one feature that reprices. The doctor's plan
(:func:`capacity_plan_from_sglang`, ``qsa_core.PlanInputs``) prices its layouts with the same
``PoolPrice`` methods and ``ShardedKVStore.transport_bytes``, and double sparsity's line
(``_config_check.ds_capacity``) with the hook's ``qsa_kernels.double_sparsity.label_capacity``;
``test_pool_pricing.py`` pins that both agree for every feature.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from qsa_core import (
    CapacityError,
    CapacityPlan,
    PlanInputs,
    PoolPrice,
    QSAConfigError,
    index_ranks,
)
from qsa_sglang_plugin._adapters._namespace import resolved_args
from qsa_sglang_plugin._errors import AdapterError, ConfigurationError
from qsa_sglang_plugin._switches import HiSparseMode, current_switches

__all__ = ("after_pool_configurator_init", "capacity_plan_from_sglang")

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
    offload = switches.hisparse is HiSparseMode.P2_OFFLOAD
    for feature, price_of, on in (
        ("offload", _offloaded_price, offload),
        ("cache sharding", _sharded_price, switches.resident_sharding),
        ("index sharding", _index_price, switches.index_sharding_alone and not offload),
        ("qsa_ds", _label_price, switches.double_sparsity is not None),
    ):
        try:
            price = price_of(configurator, kvc) if on else None
        except CapacityError as exc:
            raise ConfigurationError(f"pool sizing cannot price {feature}: {exc}") from exc
        if price is not None:  # None: the model has no QSA layers
            configurator._cell_size = price.token_bytes
            configurator._fixed_overhead_bytes += price.fixed_bytes
            _log_price(feature, price.detail)


@functools.cache
def _log_price(feature: str, detail: str) -> None:
    """Log a price once per process (SGLang builds a configurator twice while it sizes)."""
    logger.info("%s: %s", feature, detail)


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
    switches = current_switches()
    ranks = index_ranks(switches.cache_sharding, int(kvc.server_args.tp_size))
    return layout.pool_price(
        resident_token_bytes=resident,
        index_token_bytes=index,
        verify=switches.verify_offload,
        index_ranks=ranks if switches.index_sharding else 1,  # D2: its candidate buffers too
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


def _index_price(configurator: Any, kvc: Any) -> PoolPrice | None:
    """D2 alone, resident: ``1 / TP`` of the index, the raw K/V whole, the candidates fixed.

    With ``p2-offload`` the offload's price divides the index instead (:func:`_offloaded_price`).
    """
    from qsa_kernels.sharded import ShardedIndex
    from qsa_sglang_plugin._adapters._qsa_common import qsa_profile_of

    layer_ids = _qsa_layer_ids(kvc)
    if layer_ids is None:
        return None
    ranks, rows = int(kvc.server_args.tp_size), kvc.server_args.max_running_requests
    resident, index = _token_bytes(configurator, kvc, len(layer_ids))
    topk = int(qsa_profile_of(kvc.model_config).block_topk)
    candidates = ShardedIndex.candidate_bytes(
        world_size=ranks, block_topk=topk, max_running=rows or 1
    )
    return PoolPrice.index_sharded(
        resident_token_bytes=resident, index_token_bytes=index, index_ranks=ranks,
        index_buffer_bytes=candidates,
    )  # fmt: skip


def _label_price(configurator: Any, kvc: Any) -> PoolPrice | None:
    """Double sparsity's price of a token of SGLang's K/V (``_cell_size``) on this rank."""
    from sglang.srt.runtime_context import get_parallel

    from qsa_kernels.double_sparsity import label_capacity
    from qsa_sglang_plugin._config_check import ds_config, ds_geometry

    switches = current_switches()
    ds, model_config = switches.double_sparsity, kvc.model_config
    assert ds is not None  # the hook prices labels only with double sparsity on
    geometry = ds_geometry(model_config.hf_text_config.to_dict())
    return label_capacity(
        ds_config(ds),
        layers=geometry.layers,
        kv_heads=int(model_config.get_num_kv_heads(get_parallel().attn_tp_size)),  # this rank's
        head_dim=geometry.head_dim,
        kv_dtype=kvc.kv_cache_dtype,
        offload=ds.offload,
        kv_token_bytes=int(configurator._cell_size),
        rows=_arena_rows(kvc) if ds.offload else None,
        context_len=int(model_config.context_len),
        verify=switches.verify_offload,
    ).price


def capacity_plan_from_sglang(
    server_args: Any,
    hf_text_config: Any,
    gpu_budget_bytes: int,
    host_budget_bytes: int,
    *,
    sharding_size: int = 1,
    hot_slots: int | None = None,
    index_sharded: bool = False,
    verify: bool = False,
) -> CapacityPlan:
    """:meth:`qsa_core.PlanInputs.plan` of the operator's flags, with and without host offload.

    ``server_args`` (SGLang's ``ServerArgs``, resolved, or an ``argparse.Namespace``) read by
    :meth:`PlanInputs.from_args`, the profile from ``hf_text_config`` (HF object or mapping).
    ``sharding_size`` is ``SGLANG_QSA_CACHE_SHARDING``, ``hot_slots``
    ``SGLANG_QSA_HISPARSE_HOT_BLOCKS``, ``index_sharded`` ``SGLANG_QSA_INDEX_SHARDING=1``,
    ``verify`` ``SGLANG_QSA_HISPARSE_VERIFY=1``; the budgets are per rank, bytes. With
    ``sharding_size > 1`` the resident layout's fixed transport buffers are
    ``ShardedKVStore.transport_bytes``, and with ``index_sharded`` the offloaded layout's
    candidate buffers ``ShardedIndex.candidate_bytes``: the bytes pool sizing charges.

    Raises:
        AdapterError: a flag or config :meth:`PlanInputs.from_args` refuses (named).
        qsa_core.CapacityError: a budget or size ``plan_capacity`` refuses.
        qsa_core.PlacementError: a ``sharding_size`` that does not fit ``--tp-size``.
    """
    from qsa_kernels.sharded import ShardedIndex, ShardedKVStore

    try:
        inputs = PlanInputs.from_args(hf_text_config, resolved_args(server_args))
    except QSAConfigError as exc:
        raise AdapterError(f"no capacity plan for these flags: {exc}") from exc
    return inputs.plan(
        gpu_budget_bytes,
        host_budget_bytes,
        sharding_size=sharding_size,
        hot_slots=hot_slots,
        index_sharded=index_sharded,
        transport_bytes=ShardedKVStore.transport_bytes,
        verify=verify,
        index_buffer_bytes=ShardedIndex.candidate_bytes,
    )
