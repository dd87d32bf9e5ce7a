"""What the plugin's QSA backends share: their base class, the selection's blocks, the groups.

The offload backend (:mod:`._offload`) and the sharded one (:mod:`._sharded_kv`) both subclass
:func:`plugin_backend_base`, read the indexer's selection as complete blocks
(:func:`complete_blocks`), and, with cache sharding, join the shard group of their TP rank
(:func:`shard_group`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from qsa_core import QSAProfile, ShardPlacement
from qsa_kernels import BLOCK_TOKENS
from qsa_kernels.sharded import ShardGroup
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError

__all__ = ("complete_blocks", "plugin_backend_base", "qsa_profile_of", "shard_group")


def complete_blocks(indices: torch.Tensor, closed: torch.Tensor, block_topk: int) -> torch.Tensor:
    """``[B, block_topk]`` int32 selected complete blocks (``-1`` padded) of the QSA indexer.

    Args:
        indices: ``[B, block_topk]`` block ids, or the same blocks expanded to token positions
            followed by the open block's (``[B, 4 block_topk + 3]``, what upstream's indexer
            returns in prefill and where it does not defer the expansion); ``-1`` padded.
        closed: ``[B]`` complete blocks each row may attend (its length // 4); an entry at or
            beyond it is not a complete block.
        block_topk: the indexer's block selection width.

    Raises:
        OffloadRuntimeError: ``indices`` has neither shape.
    """
    limit = closed.to(torch.int32).unsqueeze(1)
    width = indices.shape[1] if indices.dim() == 2 else -1
    if width == block_topk:
        blocks = indices.to(torch.int32)
        return torch.where(blocks < limit, blocks, -1)
    if width == BLOCK_TOKENS * block_topk + BLOCK_TOKENS - 1:
        # Token positions: a selected block contributes its first token (4 b); the open
        # block's tokens lie at or after 4 * closed.
        tokens = indices.to(torch.int32)
        starts = (tokens >= 0) & (tokens % BLOCK_TOKENS == 0) & (tokens < BLOCK_TOKENS * limit)
        candidates = torch.where(starts, tokens // BLOCK_TOKENS, -1)
        return candidates.sort(dim=1, descending=True).values[:, :block_topk].contiguous()
    msg = (
        f"the QSA indexer's selection must be [B, {block_topk}] block ids or "
        f"[B, {BLOCK_TOKENS * (block_topk + 1) - 1}] token positions; got "
        f"{tuple(indices.shape)!r}"
    )
    raise OffloadRuntimeError(msg)


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

    Every TP rank creates every group, in the order :meth:`ShardPlacement.tp_groups` lists them
    (``torch.distributed.new_group`` is collective over the default group), with the default
    group's backend.
    """
    if sharding == 1:
        return None
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    profile = QSAProfile.from_text_config(
        runner.model_config.hf_text_config.to_dict(), page_size=int(runner.server_args.page_size)
    )
    placement = ShardPlacement.for_tp(profile, tp.world_size, sharding)
    mine: ShardGroup | None = None
    for members in ShardPlacement.tp_groups(profile, tp.world_size, sharding):
        group = dist.new_group([tp.ranks[i] for i in members])
        if tp.rank_in_group in members and isinstance(group, dist.ProcessGroup):
            mine = ShardGroup(placement, members.index(tp.rank_in_group), group)
    if mine is None:  # tp_groups covers every rank
        msg = f"TP rank {tp.rank_in_group!r} is in no shard group of {sharding!r} ranks"
        raise OffloadRuntimeError(msg)
    return mine


@functools.cache
def plugin_backend_base() -> type[Any]:
    """The base of the plugin's QSA backends: upstream's, with its attention entries narrowed.

    Decode takes the indexer's block ids as they are (the block expansion is deferred), both
    entries require the indexer's selection, prefill refuses context-parallel batches, and the
    extend output is padded to the query rows as upstream pads it. A subclass implements
    ``_attend_extend(q [T, Hq, D], k, v, layer, forward_batch, topk_indices) -> [T, Hq * D]``
    over the ``T`` rows the indexer selected for, and ``_attend_decode(q, k, v, layer,
    forward_batch, topk_indices) -> [B, Hq * D]``; ``feature`` names it in refusals.
    """
    from sglang.srt.layers.attention import qwen_sparse_attn_backend as upstream

    class PluginQSABackend(upstream.QwenSparseAttnBackend):  # type: ignore[misc]
        feature = "the plugin's QSA backend"

        def _can_defer_block_expansion(self, forward_mode: Any) -> bool:
            return bool(forward_mode.is_decode())

        def forward_extend(  # noqa: PLR0917 (upstream's signature)
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            layer: Any,
            forward_batch: Any,
            save_kv_cache: bool = True,
            topk_indices: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> torch.Tensor:
            del save_kv_cache, kwargs  # the K/V goes to the plugin's store, not the pool
            if topk_indices is None:
                msg = "QSA sparse attention requires topk_indices"
                raise ValueError(msg)
            if getattr(forward_batch, "attn_cp_metadata", None) is not None:
                msg = f"context-parallel prefill is not wired with {self.feature}"
                raise OffloadRuntimeError(msg)
            q = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)
            rows, valid = q.shape[0], topk_indices.shape[0]  # DP attention may pad q
            out = self._attend_extend(q[:valid], k, v, layer, forward_batch, topk_indices)
            return self._pad_extend_output(out, rows)  # type: ignore[no-any-return]

        def forward_decode(  # noqa: PLR0917 (upstream's signature)
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            layer: Any,
            forward_batch: Any,
            save_kv_cache: bool = True,
            topk_indices: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> torch.Tensor:
            del save_kv_cache, kwargs  # the token goes to the plugin's store, not the pool
            if topk_indices is None:
                msg = "QSA sparse attention requires topk_indices"
                raise ValueError(msg)
            return self._attend_decode(q, k, v, layer, forward_batch, topk_indices)  # type: ignore[no-any-return]

    return PluginQSABackend
