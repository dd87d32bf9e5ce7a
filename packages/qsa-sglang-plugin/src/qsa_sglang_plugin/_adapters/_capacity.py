"""SGLang server arguments and text config -> ``qsa_core.CapacityPlan`` or double sparsity's price.

The figures the doctor prints, priced by the functions pool sizing calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qsa_core import (
    CapacityPlan,
    KVDType,
    PoolPrice,
    QSAConfigError,
    QSAProfile,
    label_bytes_per_token,
    plan_capacity,
)
from qsa_sglang_plugin._adapters._namespace import resolved_args
from qsa_sglang_plugin._adapters._pool_sizing import labelled_price
from qsa_sglang_plugin._errors import AdapterError
from qsa_sglang_plugin._switches import DoubleSparsitySwitches

__all__ = ("LabelledCapacity", "capacity_plan_from_sglang", "ds_capacity")


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
    """:func:`qsa_core.plan_capacity` of the operator's flags, with and without host offload.

    Reads ``--tp-size``, ``--kv-cache-dtype`` (``auto`` = bf16), ``--page-size`` (``None``: 64),
    ``--context-length`` (``None``: :meth:`QSAProfile.config_context_len`),
    ``--max-running-requests`` and ``--prefill-max-requests`` (the prompts the offload stages;
    ``None``: 1, as the offload refuses no limit at start-up) from ``server_args`` (SGLang's
    ``ServerArgs``, resolved, or an ``argparse.Namespace``), the profile from ``hf_text_config``
    (HF object or mapping).
    ``sharding_size`` is ``SGLANG_QSA_CACHE_SHARDING``, ``hot_slots``
    ``SGLANG_QSA_HISPARSE_HOT_BLOCKS``, ``index_sharded`` ``SGLANG_QSA_INDEX_SHARDING=1``,
    ``verify`` ``SGLANG_QSA_HISPARSE_VERIFY=1``; the budgets are per rank. With
    ``sharding_size > 1`` the resident layout's fixed transport buffers are
    ``ShardedKVStore.transport_bytes``, the bytes pool sizing charges (query heads split over TP:
    attention context parallelism off).

    Raises:
        AdapterError: no usable QSA profile, an unsupported KV dtype, no context length, or no
            ``--max-running-requests``; the message names the flag.
        qsa_core.CapacityError: a budget or size ``plan_capacity`` refuses.
        qsa_core.PlacementError: a ``sharding_size`` that does not fit ``--tp-size``.
    """
    view = resolved_args(server_args)
    config = _text_config(hf_text_config)
    page_size = getattr(view, "page_size", None)
    try:
        profile = (
            QSAProfile.from_text_config(config)
            if page_size is None
            else QSAProfile.from_text_config(config, page_size=int(page_size))
        )
        kv_dtype = KVDType.parse(str(getattr(view, "kv_cache_dtype", "auto")))
    except QSAConfigError as exc:
        raise AdapterError(f"no capacity plan for these flags: {exc}") from exc
    context_len: Any = getattr(view, "context_length", None)
    if context_len is None:
        context_len = QSAProfile.config_context_len(config)
    if context_len is None:
        msg = "--context-length=None and the config has no max_position_embeddings; give one"
        raise AdapterError(msg)
    requests = getattr(view, "max_running_requests", None)
    if requests is None:
        msg = (
            "--max-running-requests=None; the plan needs the request count "
            "(allowed: a positive integer)"
        )
        raise AdapterError(msg)
    tp_size = int(view.tp_size)
    transport = 0
    if sharding_size > 1:
        from qsa_kernels.sharded import ShardedKVStore

        transport = ShardedKVStore.transport_bytes(
            world_size=sharding_size,
            max_rows=int(requests),
            block_topk=profile.block_topk,
            q_heads=max(profile.num_attention_heads // tp_size, 1),
            head_dim=profile.head_dim,
            index_sharded=index_sharded,
        )
    return plan_capacity(
        profile,
        tp_size=tp_size,
        kv_dtype=kv_dtype,
        gpu_budget_bytes=gpu_budget_bytes,
        host_budget_bytes=host_budget_bytes,
        context_len=int(context_len),
        num_requests=int(requests),
        sharding_size=sharding_size,
        hot_slots=hot_slots,
        index_sharded=index_sharded,
        staged_prompts=int(getattr(view, "prefill_max_requests", None) or 1),
        transport_bytes=transport,
        verify=verify,
    )


@dataclass(frozen=True, slots=True)
class LabelledCapacity:
    """Double sparsity's bytes of a token on one TP rank, and what pool sizing charges.

    Attributes:
        kv_heads: the rank's KV heads (as the channel file splits them).
        kv_token_bytes: a token's bf16 K/V on the rank, B.
        label_token_bytes: its label rows, B.
        price: the pool price (:func:`labelled_price`, the hook's); None for DS-Offload without
            a request count (its buffers are sized by it).
    """

    kv_heads: int
    kv_token_bytes: int
    label_token_bytes: int
    price: PoolPrice | None


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
    ``SGLANG_QSA_HISPARSE_VERIFY=1`` (DS-Offload keeps a resident copy of every row).

    Raises:
        qsa_kernels.double_sparsity.DSConfigError: the channel file is refused at ``tp_size``.
        ConfigurationError: the config has no GQA geometry.
        AdapterError: DS-Offload with rows but no context length.
    """
    import torch

    from qsa_kernels.double_sparsity import LabelCache
    from qsa_sglang_plugin._config_check import ds_channels, ds_geometry

    layers, _, _, head_dim = ds_geometry(text_config)
    kv_heads = int(ds_channels(switches, text_config).for_tp_rank(tp_size, 0).channels.shape[1])
    dtype = torch.bfloat16
    kv = layers * 2 * kv_heads * head_dim * dtype.itemsize
    element = LabelCache.dtype_for(dtype).itemsize
    labels = label_bytes_per_token(layers, kv_heads, switches.heavy_channel_num, element)
    context: Any = context_len
    if context is None:
        context = QSAProfile.config_context_len(text_config)
    if context is None and switches.offload and rows is not None:
        msg = "DS-Offload sizes its buffers by --context-length; give one"
        raise AdapterError(msg)
    price = labelled_price(
        text_config,
        switches,
        kv_token_bytes=kv,
        kv_heads=kv_heads,
        dtype=dtype,
        rows=rows,
        context_len=int(context or 0),  # read with DS-Offload only
        verify=verify,
    )
    return LabelledCapacity(kv_heads, kv, labels, price)
