"""What the plugin's QSA backends share: upstream's prefill kernels, CP entries, profile, groups."""

from __future__ import annotations

from typing import Any

from qsa_core import QSAProfile
from qsa_kernels import KernelInputError, check_block_tokens
from qsa_kernels.context import PrefillKernels, ZigzagEntries
from qsa_kernels.sharded import HeadLayout, ShardGroup
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError

__all__ = (
    "group_head_layout",
    "prefill_kernels",
    "qsa_profile_of",
    "shard_group",
    "zigzag_entries",
)


def prefill_kernels() -> PrefillKernels:
    """Upstream's QSA prefill kernels: its per-row torch path, no-prefix and chunk kernels."""
    from sglang.srt.layers.attention import qwen_sparse_attn_backend as upstream

    return PrefillKernels(
        upstream.qsa_sparse_attention,
        upstream.sparse_gqa_fwd_interface_triton,
        upstream.sparse_gqa_fwd_interface_triton_ck,
    )


def zigzag_entries(cp_metadata: Any) -> ZigzagEntries:
    """This rank's entries from SGLang's ``ZigzagContextParallelMetadata`` of one request.

    Raises:
        OffloadRuntimeError: metadata of a batch of several requests (their contexts are not
            one contiguous context).
    """
    if int(cp_metadata.bs) != 1:
        msg = (
            f"a context-parallel batch of {int(cp_metadata.bs)!r} requests attends over one "
            "request's context here; allowed: 1"
        )
        raise OffloadRuntimeError(msg)
    return ZigzagEntries(
        cp_metadata.cu_seqlens_q_combined_tensor,
        cp_metadata.kv_len_combined_tensor,
        int(cp_metadata.max_seqlen_q_combined),
    )


def qsa_profile_of(model_config: Any) -> Any:
    """SGLang's QSA profile of a model (its indexer's block top-k, budget, compress ratio).

    Raises:
        ConfigurationError: the model has no QSA layers, or its blocks are not the kernels'
            (:func:`qsa_kernels.check_block_tokens`).
    """
    from sglang.srt.layers.attention.qsa.config import parse_qsa_profile

    config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    profile = parse_qsa_profile(config)
    if profile is None:
        msg = (
            f"{type(config).__name__} has no QSA profile; the plugin's QSA backends serve QSA "
            "models only"
        )
        raise ConfigurationError(msg)
    try:
        check_block_tokens(int(profile.compress_ratio))
    except KernelInputError as exc:
        raise ConfigurationError(str(exc)) from exc
    return profile


def shard_group(runner: Any, sharding: int) -> ShardGroup | None:
    """:meth:`ShardGroup.join_tp` over SGLang's TP group (None: ``SGLANG_QSA_CACHE_SHARDING=1``)."""
    if sharding == 1:
        return None
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.runtime_context import get_parallel

    tp = get_tp_group()
    profile = QSAProfile.from_text_config(
        runner.model_config.hf_text_config.to_dict(), page_size=int(runner.server_args.page_size)
    )
    cp = int(get_parallel().attn_cp_size)
    return ShardGroup.join_tp(
        profile, list(tp.ranks), int(tp.rank_in_group), sharding, attn_cp_size=cp
    )


def group_head_layout() -> HeadLayout:
    """SHARDED (heads split over TP), or REPLICATED under attention CP (attention TP is 1)."""
    from sglang.srt.runtime_context import get_parallel

    return HeadLayout.REPLICATED if int(get_parallel().attn_cp_size) > 1 else HeadLayout.SHARDED
