"""What the plugin's QSA backends share: prefill over one context, the profile, the groups.

The offload backend and the sharded one (:mod:`._backends`) attend prefill rows over one
request's contiguous context with upstream's kernels (:func:`attend_context`, also for
context-parallel rows), read the model's QSA profile (:func:`qsa_profile_of`) and, with cache
sharding, join the shard group of their TP rank (:func:`shard_group`).
"""

from __future__ import annotations

from typing import Any

import torch

from qsa_core import QSAProfile
from qsa_kernels import BLOCK_TOKENS
from qsa_kernels.sharded import HeadLayout, ShardGroup
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError

__all__ = (
    "attend_context",
    "group_head_layout",
    "qsa_profile_of",
    "shard_group",
)


def attend_context(  # noqa: PLR0917 (upstream's kernel order)
    q: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    cp_metadata: Any = None,
) -> torch.Tensor:
    """Prefill rows of one request over its context, with upstream's QSA prefill kernels.

    Args:
        q: ``[T, Hq, D]`` query rows. Without ``cp_metadata`` they are the context's last ``T``
            tokens; with it, this rank's two zigzag blocks of the chunk, in that order.
        context_k: ``[S, Hkv, D]`` keys of the request's first ``S`` tokens, row ``t`` token
            ``t`` (the offload's staging area, or a whole prompt gathered over CP ranks).
        context_v: its values.
        indices: ``[T, W]`` the indexer's selection per row: token positions, ``-1`` padded.
        scale: softmax scale.
        cp_metadata: SGLang's ``ZigzagContextParallelMetadata`` of a one-request chunk, or None.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.

    Raises:
        OffloadRuntimeError: ``cp_metadata`` of a batch of several requests (their contexts are
            not one contiguous context).
    """
    if cp_metadata is not None and int(cp_metadata.bs) != 1:
        msg = (
            f"a context-parallel batch of {int(cp_metadata.bs)!r} requests attends over one "
            "request's context here; allowed: 1"
        )
        raise OffloadRuntimeError(msg)
    from sglang.srt.layers.attention import qwen_sparse_attn_backend as upstream

    tokens = int(context_k.shape[0])
    if not q.is_cuda:  # upstream's CPU branch, with the context as the pool: slot = position
        inside = (indices >= 0) & (indices < tokens)
        slots = torch.where(inside, indices, -1).to(torch.int32)
        out: torch.Tensor = upstream.qsa_sparse_attention(q, context_k, context_v, slots, scale)
        return out
    topk = indices.to(torch.int32).contiguous()
    if cp_metadata is None:  # one entry: the last T rows, causal from the bottom right
        device = q.device
        cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        ends = torch.tensor([tokens], dtype=torch.int32, device=device)
        max_q = None
    else:  # one entry per zigzag block; the kernel reads cu_k[e] as the request's base row
        cu_q = cp_metadata.cu_seqlens_q_combined_tensor
        cu_k = torch.zeros(2, dtype=torch.int32, device=q.device)
        ends = cp_metadata.kv_len_combined_tensor
        max_q = int(cp_metadata.max_seqlen_q_combined)
    out = upstream.sparse_gqa_fwd_interface_triton_ck(
        q.contiguous(),
        context_k.to(q.dtype),
        context_v.to(q.dtype),
        topk,
        cu_q,
        cu_k,
        ends,
        scale,
        max_q=max_q,
    )
    return out


def qsa_profile_of(model_config: Any) -> Any:
    """SGLang's QSA profile of a model (its indexer's block top-k, budget, compress ratio).

    Raises:
        ConfigurationError: the model has no QSA layers, or blocks other than 4 tokens.
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
    if profile.compress_ratio != BLOCK_TOKENS:
        msg = (
            f"indexer_compress_ratio={profile.compress_ratio!r}; the plugin's QSA backends move "
            f"blocks of {BLOCK_TOKENS} tokens (allowed: {BLOCK_TOKENS})"
        )
        raise ConfigurationError(msg)
    return profile


def shard_group(runner: Any, sharding: int) -> ShardGroup | None:
    """This rank's shard group (``SGLANG_QSA_CACHE_SHARDING``), or None when it is off.

    :meth:`ShardGroup.join_tp` over SGLang's TP group, every rank alike. Under SGLang's prefill
    CP over the TP group every rank holds every K/V head, so the groups are runs of any TP ranks
    (:func:`group_head_layout`).
    """
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
    """How a shard group's ranks hold the query heads of their K/V heads, in this process.

    SHARDED with the heads split over TP (each rank its share of the group's heads);
    REPLICATED under SGLang's attention CP over the TP group, where attention TP is 1 and every
    rank holds every head of every row in decode (``--enable-cp-decode-attn-tp`` is refused).
    """
    from sglang.srt.runtime_context import get_parallel

    return HeadLayout.REPLICATED if int(get_parallel().attn_cp_size) > 1 else HeadLayout.SHARDED
