"""The plugin's QSA attention backends (imported by :mod:`._qsa_backend`'s hook only)."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention import qwen_sparse_attn_backend as upstream
from sglang.srt.layers.cp.utils import ContextParallelStrategyKind, get_cp_strategy, is_cp_active
from sglang.srt.runtime_context import get_stream
from torch import Tensor

from qsa_sglang_plugin._adapters._offload import (
    extend_layer,
    offload_read_ends,
    plan_decode,
    runtime_of,
)
from qsa_sglang_plugin._adapters._qsa_common import prefill_kernels, zigzag_entries
from qsa_sglang_plugin._adapters._sharded_kv import attend_extend, sharded_store_of
from qsa_sglang_plugin._errors import OffloadRuntimeError

__all__ = ("HiSparseOffloadBackend", "HiSparseShardedBackend", "PluginQSABackend")


class PluginQSABackend(upstream.QwenSparseAttnBackend):
    """Upstream's QSA backend, its attention entries narrowed to ``_prefill`` and ``_decode``.

    ``_prefill -> [T, Hq * D]`` (``cp``: ``k``/``v`` the chunk in token order, ``q`` this rank's
    rows), ``_decode -> [B, Hq * D]`` (block ids unexpanded); ``feature`` names it in refusals.
    """

    feature = "the plugin's QSA backend"

    def _can_defer_block_expansion(self, forward_mode: Any) -> bool:
        return bool(forward_mode.is_decode())

    def forward_extend(  # noqa: PLR0917 (upstream's signature)
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        topk_indices: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        del save_kv_cache, kwargs  # the K/V goes to the plugin's store, not the pool
        if topk_indices is None:
            msg = "QSA sparse attention requires topk_indices"
            raise ValueError(msg)
        if getattr(forward_batch, "attn_cp_metadata", None) is not None and is_cp_active(
            forward_batch
        ):
            return self._forward_extend_cp(
                q, k, v, layer, forward_batch, topk_indices, save_kv_cache=False
            )
        q = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)
        rows, valid = q.shape[0], topk_indices.shape[0]  # DP attention may pad q
        out = self._prefill(layer, forward_batch, q[:valid], k, v, topk_indices, cp=False)
        padded: Tensor = self._pad_extend_output(out, rows)
        return padded

    def _forward_extend_cp(  # noqa: PLR0917 (upstream's signature)
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: Any,
        forward_batch: Any,
        topk_indices: Tensor,
        save_kv_cache: bool,
    ) -> Tensor:
        """Zigzag prefill CP: the whole chunk's K/V in token order, this rank's rows attended."""
        del save_kv_cache
        strategy = get_cp_strategy()
        if strategy is None or strategy.kind != ContextParallelStrategyKind.ZIGZAG:
            name = strategy.name if strategy is not None else "none"
            msg = f"--cp-strategy={name!r}; {self.feature} serves QSA prefill CP as zigzag"
            raise OffloadRuntimeError(msg)
        meta = forward_batch.attn_cp_metadata
        q = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)
        rows = q.shape[0]
        local = int(meta.total_q_prev_tokens + meta.total_q_next_tokens)
        pending: tuple[int, Tensor, Tensor] | None = self._cp_kv_pending  # type: ignore[has-type]
        self._cp_kv_pending = None
        if pending is not None:
            torch.cuda.current_stream().wait_stream(get_stream("qsa_cp_kv"))
            layer_id, k_full, v_full = pending
            if layer_id != layer.layer_id:
                msg = (
                    f"layer {layer.layer_id!r} joins the CP K/V gather that layer "
                    f"{layer_id!r} started"
                )
                raise OffloadRuntimeError(msg)
        else:
            k_full, v_full = upstream._gather_cp_kv(layer, k, v, forward_batch)
        out = self._prefill(
            layer, forward_batch, q[:local], k_full, v_full, topk_indices[:local], cp=True
        )
        if pending is not None:  # the gathered K/V's memory is the side stream's
            get_stream("qsa_cp_kv").wait_stream(torch.cuda.current_stream())
        padded: Tensor = self._pad_extend_output(out, rows)
        return padded

    def forward_decode(  # noqa: PLR0917 (upstream's signature)
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        topk_indices: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        del save_kv_cache, kwargs  # the token goes to the plugin's store, not the pool
        if topk_indices is None:
            msg = "QSA sparse attention requires topk_indices"
            raise ValueError(msg)
        return self._decode(layer, forward_batch, q, k, v, topk_indices)

    def _prefill(  # noqa: PLR0917
        self, layer: Any, batch: Any, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, cp: bool
    ) -> Tensor:
        raise NotImplementedError

    def _decode(  # noqa: PLR0917
        self, layer: Any, batch: Any, q: Tensor, k: Tensor, v: Tensor, idx: Tensor
    ) -> Tensor:
        raise NotImplementedError


class HiSparseOffloadBackend(PluginQSABackend):
    """Prefill over the staging area, decode from the host arena (:mod:`._offload`)."""

    feature = "p2-offload"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.qsa_runtime = runtime_of(runner)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        super().init_forward_metadata(forward_batch)
        if forward_batch.forward_mode.is_decode():
            plan_decode(self.qsa_runtime, forward_batch)

    def shared_read_ends(self, fm: Any) -> Any:
        return offload_read_ends(fm)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        # The CUDA graph runner's per-step planning, outside the captured forward.
        super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if forward_batch.forward_mode.is_decode():
            plan_decode(self.qsa_runtime, forward_batch, graph=True, capture=in_capture)

    def _prefill(  # noqa: PLR0917
        self, layer: Any, batch: Any, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, cp: bool
    ) -> Tensor:
        """Each request's chunk staged and attended; under CP one request, this rank's rows."""
        zigzag = zigzag_entries(batch.attn_cp_metadata) if cp else None
        return extend_layer(
            self.qsa_runtime, layer.layer_id, q, k, v, idx, batch,
            scale=float(layer.scaling), kernels=prefill_kernels(), zigzag=zigzag,
        )  # fmt: skip

    def _decode(  # noqa: PLR0917
        self, layer: Any, batch: Any, q: Tensor, k: Tensor, v: Tensor, idx: Tensor
    ) -> Tensor:
        """The token to the tail, then attention from the host arena (the planned step)."""
        return self.qsa_runtime.decode_layer(layer.layer_id, q, k, v, idx, float(layer.scaling))


class HiSparseShardedBackend(PluginQSABackend):
    """The raw K/V in the shard group's stores (:mod:`._sharded_kv`)."""

    feature = "cache sharding"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.qsa_sharded = sharded_store_of(runner)
        # The decode step's slot table: upstream's metadata eagerly, gathered in a graph.
        self._decode_slots: Tensor | None = None

    def init_forward_metadata(self, forward_batch: Any) -> None:
        super().init_forward_metadata(forward_batch)
        self._decode_slots = self.forward_metadata.token_slot_table

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        # Upstream's captured metadata holds a placeholder table; gather the real one.
        super().init_forward_metadata_in_graph(forward_batch)
        indices = forward_batch.req_pool_indices.long()
        self._decode_slots = self.req_to_token[indices]

    def _prefill(  # noqa: PLR0917
        self, layer: Any, batch: Any, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, cp: bool
    ) -> Tensor:
        """The chunk's owned rows to the store, then upstream's or the owners' attention."""
        store, scale = self.qsa_sharded, float(layer.scaling)
        return attend_extend(
            store, layer.layer_id, q, k, v, idx, batch, self.req_to_token, scale, cp=cp
        )

    def _decode(  # noqa: PLR0917
        self, layer: Any, batch: Any, q: Tensor, k: Tensor, v: Tensor, idx: Tensor
    ) -> Tensor:
        """The new token to its owner, then owner-side attention over the selection."""
        if self._decode_slots is None:
            msg = "cache sharding: a decode step before its metadata"
            raise OffloadRuntimeError(msg)
        store, scale = self.qsa_sharded, float(layer.scaling)
        store.write(layer.layer_id, k, v, batch.out_cache_loc)
        return store.decode(layer.layer_id, q, idx, batch.seq_lens, self._decode_slots, scale)
