"""``p2-offload`` inside SGLang: the QSA layers' K/V off SGLang's pool, history in host memory.

Two SGLang objects meet one :class:`OffloadRuntime` per model runner:

- the attention backend, a subclass of upstream's ``QwenSparseAttnBackend`` that the AFTER hook on
  ``attn_backend_wrapper`` (:mod:`._qsa_backend`) puts in the hybrid GDN backend's full-attention
  place. Prefill writes the
  chunk's K/V to one prompt's GPU staging area and attends with upstream's kernels (with a prefix:
  over the staged prompt); decode appends each layer's new token to the row's open-block tail,
  writes a block that closes to the host arena, fetches the indexer's selected blocks that miss the
  hot cache, and attends over hot cache and tail (:class:`qsa_kernels.offload.OffloadedKV`).
  Nothing reads or writes SGLang's full-KV pool, which the AFTER hook on SGLang's pool-class
  resolution makes a one-page stub (:mod:`._kv_pool`), and the AFTER hook on
  ``DefaultPoolConfigurator.__init__`` sizes the pools for the compressed index alone, with
  staging, hot caches, tails and tables as fixed overhead: SGLang admits as many more tokens as
  the K/V bytes it no longer holds.
- the ``qsa_hisparse`` tree cache (:mod:`._lifecycle`), which binds a request's KV slot to its
  lease row when the row is allocated and frees the row when SGLang releases it.

The hand-off (the staged prompt's complete blocks to the arena, its open block to the tail)
happens when the request's first decode step is planned or when the next prompt needs the
staging area, whichever comes first. One prompt is staged at a time (``--prefill-max-requests
1``).

Decode runs eagerly or in SGLang's decode CUDA graphs. Each step is planned outside the graph
(``init_forward_metadata_out_graph``: the hand-off, the rows, one small host-to-device copy) into
the store's fixed step buffers; the captured layers read only those, and the padding SGLang adds
to reach a captured batch size becomes free rows whose work is masked. Planning reads the batch's
request slots from the device once per step.

With ``SGLANG_QSA_CACHE_SHARDING=N`` (D1: the raw K/V sharded, the compressed index
replicated) the TP ranks that hold copies of one K/V head form shard groups of ``N``
(:meth:`qsa_core.ShardPlacement.tp_groups`, one ``torch.distributed`` group each, created by every
rank in the same order when the runtime is built). Every rank still prefills the whole prompt
into its staging area and selects the same blocks with upstream's indexer; the hand-off and the
decode write-backs keep only the rank's own 16-block pages in its host arena, so host bytes and
fetches divide by ``N``. A decode layer all-gathers the group's queries, attends every head of the
group over its own selected blocks (rank 0 also over the open block), and an all-to-all of the
fp32 partials with an LSE merge gives each rank its own heads (``gather_group_queries`` and
``merge_owner_partials`` of :mod:`qsa_kernels.sharded`, through one set of transport buffers
allocated once and shared by every layer).

Under SGLang's QSA prefill CP (``--enable-prefill-cp``, zigzag over the TP group) each rank
computes its two zigzag blocks of a chunk; the chunk's K/V is gathered in token order as upstream
gathers it, every rank stages the whole chunk and attends its own rows over the staging area
(:func:`._qsa_common.attend_context`), so every rank holds, hands off and offloads the whole
prompt. Attention TP is 1 there: every rank holds every head, a shard group may be any run of TP
ranks, and its decode exchange runs with every head on every rank (``HeadLayout.REPLICATED``).

With ``SGLANG_QSA_HISPARSE_VERIFY=1`` the runtime also keeps a resident copy of every token's K/V
on the GPU (what SGLang's pool would have held) and, when a request gives its row back, compares
the host arena and tail with it byte for byte (``qsa_hisparse_offload_verified_bytes_total``,
``qsa_hisparse_offload_differing_bytes_total``): the tests' proof of the bytes on the host.

Operators see ``qsa_hisparse_host_arena_bytes``, ``qsa_hisparse_offload_rows_in_use``,
``qsa_hisparse_offload_decode_steps_total``, ``qsa_hisparse_selected_blocks_total`` and
``qsa_hisparse_fetched_blocks_total`` (selected blocks that missed the hot cache) on SGLang's
Prometheus endpoint, and a log line with the hot-cache hit rate every :data:`LOG_EVERY_STEPS`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping
from typing import Any, Final, Protocol

import torch

from qsa_core import hot_cache_slots
from qsa_kernels import BLOCK_TOKENS, KernelInputError
from qsa_kernels.offload import OffloadedKV, OffloadGeometry, RowState
from qsa_kernels.sharded import (
    HeadLayout,
    ShardedDecodeBuffers,
    gather_group_queries,
    merge_owner_partials,
)
from qsa_sglang_plugin._adapters._metrics import RankMetrics
from qsa_sglang_plugin._adapters._qsa_common import (
    attend_context,
    complete_blocks,
    group_head_layout,
    plugin_backend_base,
    qsa_profile_of,
    shard_buffers,
    shard_group,
)
from qsa_sglang_plugin._config_check import ds_config, ds_geometry
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError
from qsa_sglang_plugin._hostmem import format_bytes, meminfo_bytes
from qsa_sglang_plugin._switches import DoubleSparsitySwitches, current_switches

__all__ = (
    "LOG_EVERY_STEPS",
    "OffloadLayout",
    "OffloadRuntime",
    "arena_rows",
    "ds_offload_geometry",
    "fixed_device_bytes",
    "offload_backend_class",
    "offload_geometry",
    "price_offloaded_pool",
    "runtime_of",
)

logger = logging.getLogger(__name__)


class _Fence(Protocol):
    """Copies in flight on another stream (``qsa_hostcache.CopyFence``)."""

    def wait(self) -> None:
        """Order the current stream's later work after the copies."""


#: Decode steps between two log lines (and two reads of the device-side block counters).
LOG_EVERY_STEPS: Final = 256


class _Metrics:
    def __init__(self, tp_rank: int) -> None:
        make = RankMetrics(tp_rank)
        gauge, counter = make.gauge, make.counter
        self.arena_bytes = gauge(
            "qsa_hisparse_host_arena_bytes", "Bytes of the host arena of the QSA layers' K/V."
        )
        self.rows_in_use = gauge(
            "qsa_hisparse_offload_rows_in_use", "Host arena rows that hold a request's K/V."
        )
        self.steps = counter(
            "qsa_hisparse_offload_decode_steps", "Decode steps served from the host arena."
        )
        self.selected = counter(
            "qsa_hisparse_selected_blocks", "Complete blocks the indexer selected, all layers."
        )
        self.fetched = counter(
            "qsa_hisparse_fetched_blocks",
            "Selected blocks that missed the hot cache and were read from the host arena.",
        )
        self.verified = counter(
            "qsa_hisparse_offload_verified_bytes",
            "K/V bytes of released rows compared with their resident copy (verification on).",
        )
        self.differing = counter(
            "qsa_hisparse_offload_differing_bytes",
            "Compared K/V bytes that differed from their resident copy (verification on).",
        )


class OffloadRuntime:
    """The offloaded K/V of one model runner, and SGLang's request slots mapped to its rows.

    Args:
        kv: the rows, hot caches, tails and host arena.
        layer_ordinal: SGLang layer id of each QSA layer -> its index in ``kv`` (``[0, L)``).
        block_topk: width of the QSA indexer's block selection (512 for Qwen3.8-Flash-Next);
            None where tokens are chosen per KV head instead (double sparsity).
        tp_rank: the TP rank, for the metrics' labels.
        verify: keep a resident copy of every row's K/V and compare the row with it on release.
        q_heads: query heads of this rank's attention layers; with a shard group in ``kv``
            (``kv.shard``), the transport buffers are sized for the group's heads.
        head_layout: how the shard group holds its query heads: SHARDED (the TP head split,
            ``N x q_heads`` in the group) or REPLICATED (SGLang's CP over the TP group: every
            rank all ``q_heads``).
    """

    def __init__(
        self,
        kv: OffloadedKV,
        layer_ordinal: Mapping[int, int],
        block_topk: int | None,
        tp_rank: int,
        *,
        verify: bool = False,
        q_heads: int | None = None,
        head_layout: HeadLayout = HeadLayout.SHARDED,
    ) -> None:
        self.kv = kv
        g = kv.geometry
        self._exchange: ShardedDecodeBuffers | None = None
        if kv.shard is not None:
            if q_heads is None or block_topk is None:
                msg = "a sharded offload needs the rank's query heads and the QSA block top-k"
                raise OffloadRuntimeError(msg)
            self._exchange = shard_buffers(
                kv.shard.world_size,
                head_layout,
                max_rows=g.rows,
                block_topk=block_topk,
                q_heads=q_heads,
                head_dim=g.head_dim,
                device=kv.device,
            )
        # One prompt's K/V of every QSA layer, by token position: [L, T_max, Hkv, D].
        shape = (g.layers, g.max_tokens, g.kv_heads, g.head_dim)
        self.staging_k = torch.zeros(shape, dtype=g.dtype, device=kv.device)
        self.staging_v = torch.zeros(shape, dtype=g.dtype, device=kv.device)
        self._staged_row: int | None = None
        self._staged_tokens = 0
        # Copies still reading the staged prompt (checkpoints on their way to the host).
        self._staging_readers: list[_Fence] = []
        # Copies still writing a staged layer (a restored prefix on its way in), by ordinal.
        self._staging_fills: dict[int, _Fence] = {}
        # The resident copy for verification: [R, L, T_max, Hkv, D] K and V, or None.
        self._resident: tuple[torch.Tensor, torch.Tensor] | None = None
        if verify:
            rows_shape = (g.rows, *shape)
            self._resident = (
                torch.zeros(rows_shape, dtype=g.dtype, device=kv.device),
                torch.zeros(rows_shape, dtype=g.dtype, device=kv.device),
            )
        self._ordinal = dict(layer_ordinal)
        self._block_topk = block_topk
        self._row_of_slot: dict[int, int] = {}
        self._rows: tuple[int, ...] = ()  # the planned step's rows, padding last
        self._pending_counts = torch.zeros(2, dtype=torch.int64, device=kv.device)
        self._steps = 0
        self._metrics = _Metrics(tp_rank)
        self._metrics.arena_bytes.set(self.host_arena_bytes)

    @property
    def host_arena_bytes(self) -> int:
        """Bytes of this rank's host arena."""
        return int(self.kv.host_arena.nbytes)

    @property
    def rows_in_use(self) -> int:
        """Rows bound to a request slot."""
        return len(self._row_of_slot)

    # ---- the lifecycle's calls -------------------------------------------------------------------

    def bind(self, req_pool_idx: int, row: int) -> None:
        """A request got KV slot ``req_pool_idx`` and lease row ``row``."""
        held = self._row_of_slot.get(req_pool_idx)
        if held is not None and held != row:
            msg = f"request slot {req_pool_idx!r} is bound to row {held!r}, not {row!r}"
            raise OffloadRuntimeError(msg)
        self._row_of_slot[req_pool_idx] = row
        self._metrics.rows_in_use.set(self.rows_in_use)

    @property
    def staged_row(self) -> int | None:
        """The row whose prompt is in the staging area, if any."""
        return self._staged_row

    @property
    def staged_tokens(self) -> int:
        """Tokens of :attr:`staged_row`'s prompt in the staging area (0 when none)."""
        return self._staged_tokens

    def staged_layers(self, row: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per QSA layer, ``[tokens, Hkv, D]`` views of ``row``'s first ``tokens`` staged tokens.

        Views, not copies: a reader that outlives the current stream's work registers its copies
        with :meth:`keep_staging_until`.

        Raises:
            OffloadRuntimeError: the staging area does not hold ``tokens`` tokens of ``row``.
        """
        if self._staged_row != row or not 0 < tokens <= self._staged_tokens:
            msg = (
                f"row {row!r} asks for {tokens!r} staged tokens; the staging area holds "
                f"{self._staged_tokens!r} tokens of row {self._staged_row!r}"
            )
            raise OffloadRuntimeError(msg)
        self._filled()
        return self._layer_views(tokens)

    def staging_layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole staging area of one layer: ``[T_max, Hkv, D]`` K and V.

        Row ``t`` holds the staged prompt's token ``t``: what a dense prefill kernel reads as its
        K/V pool.
        """
        ordinal = self._ordinal_of(layer_id)
        self._filled(ordinal)
        return self.staging_k[ordinal], self.staging_v[ordinal]

    def stage_prefix(self, row: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Give the staging area to ``row``, whose first ``tokens`` tokens come from elsewhere.

        For a prefix restored from the host prefix cache: the caller fills the returned views
        (as :meth:`staged_layers`) before the row's first prefill chunk runs, on the current
        stream or by copies it names per layer with :meth:`fill_staging_until`.

        Raises:
            OffloadRuntimeError: the prefix does not fit the staging area.
        """
        g = self.kv.geometry
        if not 0 < tokens <= g.max_tokens:
            msg = (
                f"a restored prefix of {tokens!r} tokens; the staging area holds 1 to "
                f"{g.max_tokens!r}"
            )
            raise OffloadRuntimeError(msg)
        self._claim_staging(row)
        self._staged_tokens = tokens
        return self._layer_views(tokens)

    def keep_staging_until(self, fence: _Fence) -> None:
        """Copies reading the staging area until ``fence``: the next prompt waits for them."""
        self._staging_readers.append(fence)

    def fill_staging_until(self, ordinal: int, fence: _Fence) -> None:
        """Copies write QSA layer ``ordinal``'s staged prefix until ``fence``.

        The first reader of that layer orders the current stream after them, so a restore's
        copies overlap the model's layers before it instead of holding up the whole step.
        """
        self._staging_fills[ordinal] = fence

    def release(self, row: int) -> None:
        """The request of lease row ``row`` gave its KV slot back (finish, abort, retraction)."""
        for slot in [s for s, r in self._row_of_slot.items() if r == row]:
            del self._row_of_slot[slot]
        if self._staged_row == row:
            self._staged_row, self._staged_tokens = None, 0
        if self.kv.state(row) is RowState.ACTIVE:
            if self._resident is not None:
                self._verify(row)
            self.kv.release(row)
        self._metrics.rows_in_use.set(self.rows_in_use)
        self.flush_counters()  # once per request: the one device read outside the log interval

    # ---- the backend's calls ---------------------------------------------------------------------

    def begin_decode(
        self, forward_batch: Any, *, graph: bool = False, capture: bool = False
    ) -> None:
        """Plan one decode step: hand off a prompt that starts decoding, then count the new tokens.

        Args:
            forward_batch: SGLang's ``ForwardBatch`` of a decode step, or the CUDA graph runner's
                padded view of one (``batch_size`` rows, the last ``num_padding`` of them padding).
            graph: the step replays a captured CUDA graph of ``batch_size`` rows.
            capture: the step is being captured: every row is padding.
        """
        batch = int(forward_batch.batch_size)
        real = 0 if capture else batch - int(getattr(forward_batch, "num_padding", 0) or 0)
        slots = forward_batch.req_pool_indices[:real].tolist()
        lens = forward_batch.seq_lens_cpu
        seq_lens = (lens if lens is not None else forward_batch.seq_lens)[:real].tolist()
        rows = []
        for slot, seq_len in zip(slots, seq_lens, strict=True):
            row = self._row_of_slot.get(slot)
            if row is None:
                msg = f"request slot {slot!r} decodes but holds no lease row"
                raise OffloadRuntimeError(msg)
            held = seq_len - 1  # every token before the one this step adds
            if self.kv.state(row) is RowState.FREE:
                self._hand_off(row, held)
            elif self.kv.length(row) != held:
                msg = (
                    f"row {row!r} (request slot {slot!r}) holds {self.kv.length(row)!r} tokens; "
                    f"SGLang decodes token {held!r}"
                )
                raise OffloadRuntimeError(msg)
            rows.append(row)
        try:
            self._rows = self.kv.advance(rows, pad_to=batch if graph or capture else None)
        except KernelInputError as exc:
            raise OffloadRuntimeError(f"cannot plan the decode step: {exc}") from exc
        self.kv.begin_step()
        if not capture:
            self._count_step()

    def stage(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, forward_batch: Any
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Write one QSA layer's prefill chunk to the staging area.

        Args:
            layer_id: SGLang's layer id.
            k: ``[N, Hkv * D]`` (or ``[N, Hkv, D]``) keys of the chunk's ``N`` tokens.
            v: its values, shaped like ``k``.
            forward_batch: SGLang's ``ForwardBatch`` of an extend step with one request.

        Returns:
            ``(k [T, Hkv, D], v [T, Hkv, D], prefix)``: the staged prompt up to the chunk's end
            (``T`` tokens, the geometry's dtype) and how many tokens came before the chunk.
        """
        ordinal = self._ordinal_of(layer_id)
        slots = forward_batch.req_pool_indices
        if int(slots.numel()) != 1:
            msg = (
                f"an extend batch of {int(slots.numel())!r} requests; p2-offload stages one prompt "
                "at a time (--prefill-max-requests=1)"
            )
            raise OffloadRuntimeError(msg)
        slot = int(slots[0])
        row = self._row_of_slot.get(slot)
        if row is None:
            msg = f"request slot {slot!r} prefills but holds no lease row"
            raise OffloadRuntimeError(msg)
        end = int(forward_batch.seq_lens_cpu[0])
        prefix = end - int(forward_batch.extend_seq_lens_cpu[0])
        g = self.kv.geometry
        if end > g.max_tokens:
            msg = f"a prompt of {end!r} tokens exceeds the staging area ({g.max_tokens!r})"
            raise OffloadRuntimeError(msg)
        if self._staged_row != row:
            self._claim_staging(row)
        self._filled(ordinal)
        if prefix > self._staged_tokens:
            msg = (
                f"row {row!r} prefills tokens [{prefix!r}, {end!r}) but the staging area holds "
                f"only its first {self._staged_tokens!r}"
            )
            raise OffloadRuntimeError(msg)
        n = end - prefix
        self.staging_k[ordinal, prefix:end] = k[:n].reshape(n, g.kv_heads, g.head_dim)
        self.staging_v[ordinal, prefix:end] = v[:n].reshape(n, g.kv_heads, g.head_dim)
        self._staged_tokens = end
        return self.staging_k[ordinal, :end], self.staging_v[ordinal, :end], prefix

    def decode_layer(  # noqa: PLR0917 (the attention call's own order)
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        indices: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One QSA layer of the planned decode step.

        Args:
            layer_id: SGLang's layer id.
            q: ``[B, Hq * D]`` (or ``[B, Hq, D]``) bf16 queries.
            k: ``[B, Hkv * D]`` the new token's keys.
            v: ``[B, Hkv * D]`` its values.
            indices: the indexer's selection: ``[B, block_topk]`` block ids, or the same blocks
                expanded to token positions followed by the open block's (``[B, 4 block_topk +
                3]``, what upstream's indexer returns where it does not defer the expansion);
                ``-1`` padded.
            scale: softmax scale.

        Returns:
            ``[B, Hq * D]`` attention output, in ``q``'s dtype.
        """
        ordinal = self._append(layer_id, k, v)
        blocks = self._complete_blocks(indices)
        self._count_blocks(ordinal, blocks)
        rows = self._rows
        q = q.reshape(len(rows), -1, self.kv.geometry.head_dim)
        shard, exchange = self.kv.shard, self._exchange
        if shard is None or exchange is None:
            out, _lse = self.kv.attend(ordinal, rows, q, blocks, scale=scale)
        else:  # every head of the group over this rank's blocks, then each rank its own heads
            group_q = gather_group_queries(q.to(torch.bfloat16), shard=shard, buffers=exchange)
            part, lse = self.kv.attend(
                ordinal, rows, group_q, blocks, scale=scale, out_dtype=torch.float32
            )
            out, _lse = merge_owner_partials(
                part, lse, shard=shard, buffers=exchange, path=self.kv.path
            )
        return out.reshape(len(rows), -1).to(q.dtype)

    def decode_tokens(  # noqa: PLR0917 (decode_layer's order)
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        *,
        checked: bool = True,
    ) -> torch.Tensor:
        """One attention layer of the planned decode step over chosen tokens per KV head.

        Double sparsity's form of :meth:`decode_layer`: the new token goes to the tail (a block it
        closes to the host arena), then each KV head attends the tokens it chose, whose blocks
        are fetched into that head's hot cache (:meth:`OffloadedKV.token_blocks`; no host read
        while the chosen lists fit a hot cache, or with ``checked=False``).

        Args:
            layer_id: SGLang's layer id.
            q: ``[B, Hq * D]`` (or ``[B, Hq, D]``) bf16 queries.
            k: ``[B, Hkv * D]`` the new token's keys.
            v: ``[B, Hkv * D]`` its values.
            positions: ``[B, Hkv, W]`` int32 token positions each (row, KV head) attends, ``-1``
                padded, the new token's among them where chosen.
            scale: softmax scale.
            checked: refuse a head whose blocks overflow its hot cache (a host read for lists
                wider than the hot cache). ``False`` in a captured step, whose hot caches hold
                :meth:`DSConfig.hot_blocks` slots, as many as any list needs.

        Returns:
            ``[B, Hq * D]`` attention output, in ``q``'s dtype.
        """
        ordinal = self._append(layer_id, k, v)
        rows = self._rows
        try:
            blocks = self.kv.token_blocks(rows, positions, checked=checked)
        except KernelInputError as exc:
            raise OffloadRuntimeError(f"layer {layer_id!r}: {exc}") from exc
        self._count_blocks(ordinal, blocks)
        out, _lse = self.kv.attend_tokens(
            ordinal,
            rows,
            q.reshape(len(rows), -1, self.kv.geometry.head_dim),
            positions,
            blocks,
            scale=scale,
        )
        return out.reshape(len(rows), -1).to(q.dtype)

    def _append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write the step's new token of one layer (and a block it closes); its ordinal."""
        ordinal = self._ordinal_of(layer_id)
        g = self.kv.geometry
        batch = len(self._rows)  # padding included under a CUDA graph
        k = k.reshape(batch, g.kv_heads, g.head_dim)
        v = v.reshape(batch, g.kv_heads, g.head_dim)
        self.kv.write_token(ordinal, self._rows, k, v)
        if self._resident is not None:  # where SGLang's pool would have put the token
            rows, positions = self.kv.step_row_ids.long(), self.kv.step_positions.long()
            self._resident[0][rows, ordinal, positions] = k.to(g.dtype)
            self._resident[1][rows, ordinal, positions] = v.to(g.dtype)
        return ordinal

    # ---- internals -------------------------------------------------------------------------------

    def _complete_blocks(self, indices: torch.Tensor) -> torch.Tensor:
        """``[B, block_topk]`` int32 selected complete blocks (``-1`` padded) from ``indices``."""
        if self._block_topk is None:
            msg = "decode_layer takes a QSA indexer's blocks; this runtime chooses tokens"
            raise OffloadRuntimeError(msg)
        # Padding rows have 0 complete blocks: nothing selected.
        return complete_blocks(indices, self.kv.step_closed_blocks, self._block_topk)

    def _ordinal_of(self, layer_id: int) -> int:
        ordinal = self._ordinal.get(layer_id)
        if ordinal is None:
            msg = f"layer {layer_id!r} is not a QSA layer; QSA layers: {list(self._ordinal)!r}"
            raise OffloadRuntimeError(msg)
        return ordinal

    def _layer_views(self, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        layers = range(self.kv.geometry.layers)
        return (
            [self.staging_k[i, :tokens] for i in layers],
            [self.staging_v[i, :tokens] for i in layers],
        )

    def _claim_staging(self, row: int) -> None:
        """Give the staging area to ``row``, first handing off a prompt still waiting in it."""
        held = self._staged_row
        if held is not None and self.kv.state(held) is RowState.FREE:
            self._hand_off(held, self._staged_tokens)
        self._filled()  # the next prompt overwrites what they write and what the readers read
        for fence in self._staging_readers:
            fence.wait()
        self._staging_readers.clear()
        self._staged_row, self._staged_tokens = row, 0

    def _filled(self, ordinal: int | None = None) -> None:
        """Order the current stream after the copies filling one staged layer (None: all)."""
        if ordinal is None:
            fences = list(self._staging_fills.values())
            self._staging_fills.clear()
        else:
            fence = self._staging_fills.pop(ordinal, None)
            fences = [] if fence is None else [fence]
        for fence in fences:
            fence.wait()

    def _hand_off(self, row: int, tokens: int) -> None:
        """The staged prompt of ``row`` (its first ``tokens`` tokens) into the row."""
        if self._staged_row != row or self._staged_tokens != tokens:
            msg = (
                f"row {row!r} starts decoding after {tokens!r} tokens, but the staging area "
                f"holds {self._staged_tokens!r} tokens of row {self._staged_row!r}"
            )
            raise OffloadRuntimeError(msg)
        self._filled()
        self.kv.admit(row, self.staging_k[:, :tokens], self.staging_v[:, :tokens])
        if self._resident is not None:
            self._resident[0][row, :, :tokens] = self.staging_k[:, :tokens]
            self._resident[1][row, :, :tokens] = self.staging_v[:, :tokens]
        self._staged_row, self._staged_tokens = None, 0
        logger.debug("offload: row %d took a %d-token prompt", row, tokens)

    def _verify(self, row: int) -> None:
        """Compare a row's arena and tail with its resident copy (one device sync, diagnostics)."""
        assert self._resident is not None
        tokens = self.kv.length(row)
        k, v = (t[row, :, :tokens] for t in self._resident)
        result = self.kv.compare(row, k, v)
        self._metrics.verified.inc(result.bytes_compared)
        self._metrics.differing.inc(result.bytes_differing)
        if result.bytes_differing:
            logger.error(
                "offload: row %d: %d of %d K/V bytes on the host differ from the resident copy",
                row,
                result.bytes_differing,
                result.bytes_compared,
            )
        else:
            logger.info(
                "offload: row %d: %d tokens, %d K/V bytes on the host equal the resident copy",
                row,
                tokens,
                result.bytes_compared,
            )

    def _count_blocks(self, ordinal: int, blocks: torch.Tensor) -> None:
        """Add this layer's selected and missing blocks to the device-side counters (no sync)."""
        self._pending_counts += self.kv.selection_counts(ordinal, self._rows, blocks)

    def _count_step(self) -> None:
        self._steps += 1
        self._metrics.steps.inc()
        if self._steps % LOG_EVERY_STEPS == 0:
            self.flush_counters(log=True)

    def flush_counters(self, *, log: bool = False) -> tuple[int, int]:
        """Move the device-side block counters to Prometheus; returns (selected, fetched).

        Reads the device (one synchronisation); the decode path calls it every
        :data:`LOG_EVERY_STEPS` steps.
        """
        selected, fetched = (int(x) for x in self._pending_counts.tolist())
        self._pending_counts.zero_()
        self._metrics.selected.inc(selected)
        self._metrics.fetched.inc(fetched)
        if log:
            hit = 1.0 - fetched / selected if selected else 1.0
            logger.info(
                "offload: %d decode steps; last %d: %d blocks selected, %d fetched from host "
                "(hot-cache hit rate %.3f); %d rows in use; host arena %s",
                self._steps,
                LOG_EVERY_STEPS,
                selected,
                fetched,
                hit,
                self.rows_in_use,
                format_bytes(self.host_arena_bytes),
            )
        return selected, fetched


# ---- construction --------------------------------------------------------------------------------


def _verification_requested() -> bool:
    return current_switches().verify_offload


def _blocks(tokens: int) -> int:
    """4-token blocks that hold ``tokens`` tokens (the last one may be open)."""
    return math.ceil(tokens / BLOCK_TOKENS)


def _qsa_hot_slots(block_topk: int, context_len: int) -> int:
    """Hot-cache slots per (request, QSA layer).

    ``SGLANG_QSA_HISPARSE_HOT_BLOCKS`` or qsa-core's default (:func:`qsa_core.hot_cache_slots`),
    but no more than a context's blocks (never fewer than one step's selection). Start-up has
    checked the switch against ``block_topk``.
    """
    slots = hot_cache_slots(block_topk, current_switches().hot_blocks)
    return max(block_topk, min(slots, _blocks(context_len)))


def arena_rows(kvc: Any) -> int:
    """Host-arena rows an engine's offload allocates: one per running request.

    Args:
        kvc: SGLang's ``KVCacheConfigurator`` input (its ``server_args``).

    Raises:
        ConfigurationError: ``--max-running-requests`` was not given (start-up refuses it
            earlier; pool sizing must not guess).
    """
    rows = kvc.server_args.max_running_requests
    if rows is None:
        msg = "the offload sizes its host arena by --max-running-requests; give one"
        raise ConfigurationError(msg)
    return int(rows)


def offload_geometry(
    *,
    layers: int,
    rows: int,
    context_len: int,
    hot_slots: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    per_head: bool = False,
) -> OffloadGeometry:
    """The arena, hot caches and tails of ``rows`` requests of up to ``context_len`` tokens.

    ``per_head``: one record per (block, KV head), for tokens chosen per head (DS-Offload).

    Raises:
        ConfigurationError: the library refuses a size (naming it).
    """
    try:
        return OffloadGeometry(
            layers=layers,
            rows=rows,
            hot_slots=hot_slots,
            max_blocks=_blocks(context_len),
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            per_head=per_head,
        )
    except KernelInputError as exc:
        raise ConfigurationError(f"the offload cannot hold this KV cache: {exc}") from exc


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadLayout:
    """What one model runner's offload holds, from its model and pools.

    Attributes:
        geometry: the arena, hot caches and tails.
        layer_ordinal: SGLang layer id of each offloaded attention layer -> its index in the
            geometry (``[0, L)``).
        block_topk: the QSA indexer's block selection width; None for double sparsity.
    """

    geometry: OffloadGeometry
    layer_ordinal: Mapping[int, int]
    block_topk: int | None


def fixed_device_bytes(geometry: OffloadGeometry, *, verify: bool = False) -> int:
    """GPU bytes the runtime allocates once: staging (one prompt), hot caches, tails, tables.

    With ``verify``, also the resident copy of every row (``R`` prompts' worth of staging).
    """
    staging = geometry.store_layers * geometry.max_blocks * geometry.record_bytes
    resident = geometry.host_bytes if verify else 0  # the arena's size, on the device
    return staging + resident + geometry.device_bytes


def _qsa_layout(runner: Any) -> OffloadLayout:
    """The offload of a QSA model's runner: its QSA layers, the indexer's top-k blocks hot."""
    pool = runner.token_to_kv_pool
    full = pool.full_kv_pool
    layer_ordinal = dict(pool.full_attention_layer_id_mapping)
    profile = qsa_profile_of(runner.model_config)
    geometry = offload_geometry(
        layers=len(layer_ordinal),
        rows=int(runner.req_to_token_pool.size),
        context_len=int(runner.model_config.context_len),
        hot_slots=_qsa_hot_slots(int(profile.block_topk), int(runner.model_config.context_len)),
        kv_heads=int(full.head_num),
        head_dim=int(full.head_dim),
        dtype=full.dtype,  # the logical dtype (fp8 pools store uint8 and hand out fp8 views)
    )
    return OffloadLayout(geometry, layer_ordinal, int(profile.block_topk))


def ds_offload_geometry(
    text_config: Any,
    switches: DoubleSparsitySwitches,
    *,
    rows: int,
    context_len: int,
    kv_heads: int,
    dtype: torch.dtype,
) -> OffloadGeometry:
    """DS-Offload's ``OffloadGeometry``.

    Every attention layer, one record per (block, KV head), so a head's chosen token moves only
    that head's bytes, and per-head hot caches that hold the blocks one step may read
    (:meth:`DSConfig.hot_blocks`, at most a whole context).
    """
    layers, _, _, head_dim = ds_geometry(text_config)
    hot = min(ds_config(switches).hot_blocks(), _blocks(context_len))
    return offload_geometry(
        layers=layers,
        rows=rows,
        context_len=context_len,
        hot_slots=hot,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        per_head=True,
    )


def _ds_layout(runner: Any, switches: DoubleSparsitySwitches) -> OffloadLayout:
    """The offload of a double-sparsity model's runner: every attention layer, by layer id."""
    pool = runner.token_to_kv_pool
    geometry = ds_offload_geometry(
        runner.model_config.hf_text_config.to_dict(),
        switches,
        rows=int(runner.req_to_token_pool.size),
        context_len=int(runner.model_config.context_len),
        kv_heads=int(pool.head_num),
        dtype=pool.dtype,  # the logical dtype
    )
    return OffloadLayout(geometry, {i: i for i in range(geometry.layers)}, None)


def _build_runtime(runner: Any) -> OffloadRuntime:
    """The runtime of one model runner, sized from its pools and its model (QSA or DS)."""
    from sglang.srt.runtime_context import get_parallel

    switches = current_switches()
    ds = switches.double_sparsity
    layout = _qsa_layout(runner) if ds is None else _ds_layout(runner, ds)
    geometry = layout.geometry
    rows, context_len = geometry.rows, int(runner.model_config.context_len)
    shard = shard_group(runner, switches.cache_sharding)
    arena = geometry.arena_bytes(shard)
    available = meminfo_bytes("MemAvailable")
    if available is not None and arena > available:
        msg = (
            f"the host arena needs {format_bytes(arena)} ({rows} rows x "
            f"{geometry.store_layers} record layers x {geometry.arena_blocks(shard)} blocks x "
            f"{geometry.record_bytes} B) but the host has {format_bytes(available)} available; "
            f"lower --max-running-requests={rows} or --context-length={context_len}"
        )
        raise ConfigurationError(msg)
    kv = OffloadedKV(geometry, torch.device(runner.device), shard=shard)
    verify = _verification_requested()
    parallel = get_parallel()
    runtime = OffloadRuntime(
        kv,
        layout.layer_ordinal,
        layout.block_topk,
        int(parallel.tp_rank),
        verify=verify,
        q_heads=int(runner.model_config.get_num_attention_heads(parallel.attn_tp_size)),
        head_layout=group_head_layout(),
    )
    if shard is not None:
        logger.info(
            "offload: cache sharding over %d ranks (this rank is %d of its group): the host "
            "arena holds every %d-th page of %d blocks, %s of %s per rank",
            shard.world_size,
            shard.rank,
            shard.world_size,
            shard.placement.blocks_per_page,
            format_bytes(arena),
            format_bytes(geometry.host_bytes),
        )
    if verify:
        logger.warning(
            "offload: SGLANG_QSA_HISPARSE_VERIFY=1: a resident copy of every row's K/V (%s) is "
            "kept on %s and checked against the host arena when each request ends",
            format_bytes(geometry.host_bytes),
            kv.device,
        )
    pool = runner.token_to_kv_pool
    full = getattr(pool, "full_kv_pool", pool)  # the QSA pool's MHA leaf, or the MHA pool
    logger.info(
        "offload: host arena %s (%d rows x %d attention layers x %d blocks, %s records, %s, %s); "
        "on %s: staging, hot caches (%d blocks per request, layer and %s), tails and tables %s; "
        "K/V pool %s; kernels: %s",
        format_bytes(arena),
        rows,
        geometry.layers,
        geometry.arena_blocks(shard),
        "per-head" if geometry.per_head else "all-head",
        str(geometry.dtype).removeprefix("torch."),
        "pinned" if kv.host_arena.is_pinned() else "pageable",
        kv.device,
        geometry.hot_slots,
        "KV head" if geometry.per_head else "every KV head",
        format_bytes(fixed_device_bytes(geometry)),
        format_bytes(sum(int(n) for n in full.get_kv_size_bytes())),  # (K bytes, V bytes)
        kv.path.value,
    )
    return runtime


def runtime_of(runner: Any) -> OffloadRuntime:
    """The one runtime of ``runner`` (built on first use, shared by all its backends)."""
    runtime = getattr(runner, "qsa_offload_runtime", None)
    if runtime is None:
        runtime = runner.qsa_offload_runtime = _build_runtime(runner)
    return runtime


@functools.cache
def offload_backend_class() -> type[Any]:
    """The offload's ``QwenSparseAttnBackend`` subclass; built on first use (cheap imports)."""
    from sglang.srt.layers.attention import qwen_sparse_attn_backend as upstream

    class HiSparseOffloadBackend(plugin_backend_base()):  # type: ignore[misc]
        """Upstream's QSA backend whose decode reads K/V from the host arena (module docstring)."""

        feature = "p2-offload"

        def __init__(self, runner: Any) -> None:
            super().__init__(runner)
            self.qsa_runtime = runtime_of(runner)

        def init_forward_metadata(self, forward_batch: Any) -> None:
            super().init_forward_metadata(forward_batch)
            if forward_batch.forward_mode.is_decode():
                self.qsa_runtime.begin_decode(forward_batch)

        def init_forward_metadata_out_graph(
            self, forward_batch: Any, in_capture: bool = False
        ) -> None:
            # The CUDA graph runner's per-step planning, outside the captured forward.
            super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
            if forward_batch.forward_mode.is_decode():
                self.qsa_runtime.begin_decode(forward_batch, graph=True, capture=in_capture)

        def _attend_extend(  # noqa: PLR0917
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            layer: Any,
            forward_batch: Any,
            topk_indices: torch.Tensor,
        ) -> torch.Tensor:
            """Upstream's prefill attention, over the staging area instead of the KV pool."""
            staged_k, staged_v, prefix = self.qsa_runtime.stage(layer.layer_id, k, v, forward_batch)
            if prefix == 0 and q.is_cuda:  # the chunk is the whole prompt: the no-prefix kernel
                rows = q.shape[0]
                cu_q = torch.tensor([0, rows], dtype=torch.int32, device=q.device)
                out: torch.Tensor = upstream.sparse_gqa_fwd_interface_triton(
                    q.contiguous(),
                    k[:rows].contiguous(),
                    v[:rows].contiguous(),
                    int(staged_k.shape[0]),
                    topk_indices.to(torch.int32).contiguous(),
                    cu_q,
                    layer.scaling,
                )
                return out
            return attend_context(q, staged_k, staged_v, topk_indices, layer.scaling)

        def _attend_extend_cp(  # noqa: PLR0917
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            layer: Any,
            forward_batch: Any,
            topk_indices: torch.Tensor,
        ) -> torch.Tensor:
            """Prefill CP: stage the whole gathered chunk, attend this rank's zigzag rows.

            Every rank so holds the whole prompt, and the hand-off is the same on every rank.
            """
            staged_k, staged_v, _ = self.qsa_runtime.stage(layer.layer_id, k, v, forward_batch)
            return attend_context(
                q, staged_k, staged_v, topk_indices, layer.scaling, forward_batch.attn_cp_metadata
            )

        def _attend_decode(  # noqa: PLR0917
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            layer: Any,
            forward_batch: Any,
            topk_indices: torch.Tensor,
        ) -> torch.Tensor:
            """The token to the tail, then attention from the host arena (the planned step)."""
            del forward_batch
            return self.qsa_runtime.decode_layer(
                layer.layer_id, q, k, v, topk_indices, float(layer.scaling)
            )

    return HiSparseOffloadBackend


def price_offloaded_pool(configurator: Any, kvc: Any) -> None:
    """Price SGLang's pools with p2-offload (``DefaultPoolConfigurator`` just built them).

    With a QSA model, a token costs only its compressed index (``_compute_qsa_cell_size``);
    staging, hot caches, tails and tables are fixed overhead.
    """
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.runtime_context import get_parallel

    model_config = kvc.model_config
    hybrid = mambaish_config(model_config)
    if hybrid is None:
        return
    layers = len(hybrid.full_attention_layer_ids)
    profile = qsa_profile_of(model_config)
    geometry = offload_geometry(
        layers=layers,
        rows=arena_rows(kvc),
        context_len=int(model_config.context_len),
        hot_slots=_qsa_hot_slots(int(profile.block_topk), int(model_config.context_len)),
        kv_heads=int(model_config.get_num_kv_heads(get_parallel().attn_tp_size)),
        head_dim=int(model_config.head_dim),
        dtype=kvc.kv_cache_dtype,
    )
    resident = int(configurator._cell_size)
    index_only = int(
        configurator._compute_qsa_cell_size(hf_config=model_config.hf_config, num_layers=layers)
    )
    fixed = fixed_device_bytes(geometry, verify=_verification_requested())
    configurator._cell_size = index_only
    configurator._fixed_overhead_bytes += fixed
    logger.info(
        "offload: pool sizing charges %d B per token (was %d B with the QSA layers' K/V) plus "
        "%s fixed (staging, hot caches, tails, tables)",
        index_only,
        resident,
        format_bytes(fixed),
    )
