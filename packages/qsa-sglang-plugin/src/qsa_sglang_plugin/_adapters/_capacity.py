"""SGLang server arguments and model config -> ``qsa_core.PlanInputs`` or ``labelled_capacity``.

The figures the doctor prints, priced by the library calls pool sizing makes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from qsa_core import (
    CapacityError,
    CapacityPlan,
    LabelledCapacity,
    PlanInputs,
    QSAConfigError,
    QSAProfile,
    labelled_capacity,
)
from qsa_sglang_plugin._adapters._namespace import resolved_args
from qsa_sglang_plugin._errors import AdapterError
from qsa_sglang_plugin._switches import DoubleSparsitySwitches

if TYPE_CHECKING:
    import torch

__all__ = ("capacity_plan_from_sglang", "ds_capacity", "labelled")

#: ``server_args`` fields :meth:`PlanInputs.from_flags` reads as they are (None: its default).
_PLAN_FLAGS = ("page_size", "context_length", "max_running_requests", "prefill_max_requests")


def _text_config(config: Any) -> Mapping[str, object]:
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if isinstance(config, Mapping):
        return config
    msg = f"expected an HF text config or a mapping, got {type(config)!r}"
    raise AdapterError(msg)


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

    ``--tp-size``, ``--kv-cache-dtype`` and :data:`_PLAN_FLAGS` from ``server_args`` (SGLang's
    ``ServerArgs``, resolved, or an ``argparse.Namespace``; an absent one takes
    :meth:`PlanInputs.from_flags`' default), the profile from ``hf_text_config`` (HF object or
    mapping). ``sharding_size`` is ``SGLANG_QSA_CACHE_SHARDING``, ``hot_slots``
    ``SGLANG_QSA_HISPARSE_HOT_BLOCKS``, ``index_sharded`` ``SGLANG_QSA_INDEX_SHARDING=1``,
    ``verify`` ``SGLANG_QSA_HISPARSE_VERIFY=1``; the budgets are per rank, bytes. With
    ``sharding_size > 1`` the resident layout's fixed transport buffers are
    ``ShardedKVStore.transport_bytes``, the bytes pool sizing charges.

    Raises:
        AdapterError: a flag or config :meth:`PlanInputs.from_flags` refuses (named).
        qsa_core.CapacityError: a budget or size ``plan_capacity`` refuses.
        qsa_core.PlacementError: a ``sharding_size`` that does not fit ``--tp-size``.
    """
    view = resolved_args(server_args)
    flags = {name: getattr(view, name, None) for name in _PLAN_FLAGS}
    dtype = str(getattr(view, "kv_cache_dtype", "auto"))
    try:
        inputs = PlanInputs.from_flags(
            _text_config(hf_text_config), tp_size=int(view.tp_size), kv_cache_dtype=dtype, **flags
        )
    except QSAConfigError as exc:
        raise AdapterError(f"no capacity plan for these flags: {exc}") from exc
    transport = 0
    if sharding_size > 1:
        from qsa_kernels.sharded import ShardedKVStore

        transport = ShardedKVStore.transport_bytes(
            world_size=sharding_size,
            max_rows=inputs.num_requests,
            block_topk=inputs.profile.block_topk,
            q_heads=inputs.q_heads_per_rank,
            head_dim=inputs.profile.head_dim,
            index_sharded=index_sharded,
        )
    return inputs.plan(
        gpu_budget_bytes,
        host_budget_bytes,
        sharding_size=sharding_size,
        hot_slots=hot_slots,
        index_sharded=index_sharded,
        transport_bytes=transport,
        verify=verify,
    )


def labelled(
    text_config: Mapping[str, Any],
    switches: DoubleSparsitySwitches,
    *,
    kv_heads: int,
    dtype: torch.dtype,
    **sizes: Any,
) -> LabelledCapacity:
    """:func:`qsa_core.labelled_capacity` of a model config and the double-sparsity switches.

    ``kv_heads`` are one rank's, ``dtype`` the K/V cache's (the labels' follows it); ``sizes``
    are ``labelled_capacity``'s ``kv_token_bytes``, ``rows``, ``context_len`` and ``verify``.

    Raises:
        ConfigurationError: the config has no GQA geometry.
        qsa_core.CapacityError: a size qsa-core refuses.
    """
    from qsa_kernels.double_sparsity import LabelCache
    from qsa_sglang_plugin._config_check import ds_config, ds_geometry

    layers, _, _, head_dim = ds_geometry(text_config)
    return labelled_capacity(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        heavy_channels=switches.heavy_channel_num,
        kv_element_bytes=dtype.itemsize,
        label_element_bytes=LabelCache.dtype_for(dtype).itemsize,
        offload_hot_blocks=ds_config(switches).hot_blocks() if switches.offload else None,
        **sizes,
    )


def ds_capacity(
    text_config: Mapping[str, Any],
    switches: DoubleSparsitySwitches,
    *,
    tp_size: int = 1,
    rows: int | None = None,
    context_len: int | None = None,
    verify: bool = False,
) -> LabelledCapacity:
    """Double sparsity's price on TP rank 0 of ``tp_size``, from the model config (bf16 K/V).

    ``rows`` is ``--max-running-requests`` and ``context_len`` ``--context-length`` (None: the
    config's ``max_position_embeddings``); DS-Offload's buffers need both. ``verify`` is
    ``SGLANG_QSA_HISPARSE_VERIFY=1``.

    Raises:
        qsa_kernels.double_sparsity.DSConfigError: the channel file is refused at ``tp_size``.
        ConfigurationError: the config has no GQA geometry.
        AdapterError: a size qsa-core refuses (DS-Offload with rows but no context length).
    """
    import torch

    from qsa_sglang_plugin._config_check import ds_channels

    channels = ds_channels(switches, text_config).for_tp_rank(tp_size, 0).channels
    context: Any = (
        QSAProfile.config_context_len(text_config) if context_len is None else context_len
    )
    try:
        return labelled(
            text_config,
            switches,
            kv_heads=int(channels.shape[1]),
            dtype=torch.bfloat16,
            rows=rows,
            context_len=context,
            verify=verify,
        )
    except CapacityError as exc:
        raise AdapterError(f"{exc} (--context-length, --max-running-requests)") from exc
