"""``p2-offload`` inside SGLang: the QSA layers' decode reads K/V from the host arena only.

Two SGLang objects meet one :class:`OffloadRuntime` per model runner:

- the attention backend, a subclass of upstream's ``QwenSparseAttnBackend`` that the AFTER hook on
  ``attn_backend_wrapper`` puts in the hybrid GDN backend's full-attention place. Prefill runs as
  upstream (the chunk's K/V are written to SGLang's KV pool, which serves as the prompt's staging
  area); decode appends each layer's new token to the row's open-block tail, writes a block that
  closes to the host arena, fetches the indexer's selected blocks that miss the hot cache, and
  attends over hot cache and tail (:class:`qsa_kernels.OffloadedKV`). Decode never writes SGLang's
  KV pool and never reads it after the hand-off.
- the ``qsa_hisparse`` tree cache (:mod:`._lifecycle`), which binds a request's KV slot to its
  lease row when the row is allocated and frees the row when SGLang releases it.

The hand-off (the prompt's complete blocks to the arena, its open block to the tail) happens when
a request's first decode step is planned, whatever path brought it there: every request reaches
decode through ``init_forward_metadata``, and none can decode without it.

Operators see ``qsa_hisparse_host_arena_bytes``, ``qsa_hisparse_offload_rows_in_use``,
``qsa_hisparse_offload_decode_steps_total``, ``qsa_hisparse_selected_blocks_total`` and
``qsa_hisparse_fetched_blocks_total`` (selected blocks that missed the hot cache) on SGLang's
Prometheus endpoint, and a log line with the hot-cache hit rate every :data:`LOG_EVERY_STEPS`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from typing import Any, Final

import torch

from qsa_kernels import BLOCK_TOKENS, OffloadedKV, OffloadGeometry, RowState
from qsa_sglang_plugin._errors import ConfigurationError
from qsa_sglang_plugin._hostmem import format_bytes, meminfo_bytes

__all__ = ("LOG_EVERY_STEPS", "OffloadRuntime", "after_attn_backend_wrapper", "runtime_of")

logger = logging.getLogger(__name__)

#: Decode steps between two log lines (and two reads of the device-side block counters).
LOG_EVERY_STEPS: Final = 256

_KV_DTYPES: Final = (torch.bfloat16, torch.float8_e4m3fn)


class OffloadRuntimeError(RuntimeError):
    """SGLang asked the offload runtime for something its leases do not allow."""


class _Metrics:
    def __init__(self, tp_rank: int) -> None:
        from prometheus_client import Counter, Gauge

        rank = str(tp_rank)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labelnames=("tp_rank",), multiprocess_mode="livesum").labels(
                tp_rank=rank
            )

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labelnames=("tp_rank",)).labels(tp_rank=rank)

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


class OffloadRuntime:
    """The offloaded K/V of one model runner, and SGLang's request slots mapped to its rows.

    Args:
        kv: the rows, hot caches, tails and host arena.
        layer_ordinal: SGLang layer id of each QSA layer -> its index in ``kv`` (``[0, L)``).
        block_topk: width of the indexer's block selection (512 for Qwen3.8-Flash-Next).
        tp_rank: the TP rank, for the metrics' labels.
    """

    def __init__(
        self, kv: OffloadedKV, layer_ordinal: Mapping[int, int], block_topk: int, tp_rank: int
    ) -> None:
        self.kv = kv
        self._ordinal = dict(layer_ordinal)
        self._layer_ids = tuple(sorted(self._ordinal, key=self._ordinal.__getitem__))
        self._block_topk = block_topk
        self._row_of_slot: dict[int, int] = {}
        self._rows: list[int] = []
        self._closed: torch.Tensor | None = None
        self._pending_counts = torch.zeros(2, dtype=torch.int64, device=kv.device)
        self._steps = 0
        self._metrics = _Metrics(tp_rank)
        self._metrics.arena_bytes.set(self.host_arena_bytes)

    @property
    def host_arena_bytes(self) -> int:
        """Bytes of the host arena."""
        arena = self.kv.host_arena
        return arena.numel() * arena.element_size()

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

    def release(self, row: int) -> None:
        """The request of lease row ``row`` gave its KV slot back (finish, abort, retraction)."""
        for slot in [s for s, r in self._row_of_slot.items() if r == row]:
            del self._row_of_slot[slot]
        if self.kv.state(row) is RowState.ACTIVE:
            self.kv.release(row)
        self._metrics.rows_in_use.set(self.rows_in_use)
        self.flush_counters()  # once per request: the one device read outside the log interval

    # ---- the backend's calls ---------------------------------------------------------------------

    def begin_decode(self, forward_batch: Any, pool: Any, req_to_token: torch.Tensor) -> None:
        """Plan one decode step: hand off prompts that start decoding, then count the new tokens.

        Args:
            forward_batch: SGLang's ``ForwardBatch`` of a decode step.
            pool: SGLang's KV pool, read once per request for its prompt's K/V at the hand-off.
            req_to_token: ``[slots, context]`` int32, the KV slots of each request's tokens.
        """
        slots = forward_batch.req_pool_indices.tolist()
        lens = forward_batch.seq_lens_cpu
        seq_lens = (lens if lens is not None else forward_batch.seq_lens).tolist()
        rows = []
        for slot, seq_len in zip(slots, seq_lens, strict=True):
            row = self._row_of_slot.get(slot)
            if row is None:
                msg = f"request slot {slot!r} decodes but holds no lease row"
                raise OffloadRuntimeError(msg)
            held = seq_len - 1  # every token before the one this step adds
            if self.kv.state(row) is RowState.FREE:
                self._hand_off(row, pool, req_to_token[slot, :held])
            elif self.kv.length(row) != held:
                msg = (
                    f"row {row!r} (request slot {slot!r}) holds {self.kv.length(row)!r} tokens; "
                    f"SGLang decodes token {held!r}"
                )
                raise OffloadRuntimeError(msg)
            rows.append(row)
        self.kv.advance(rows)
        self.kv.begin_step()
        self._rows = rows
        self._closed = torch.tensor(
            [n // BLOCK_TOKENS for n in seq_lens], dtype=torch.int32, device=self.kv.device
        )
        self._count_step()

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
        ordinal = self._ordinal.get(layer_id)
        if ordinal is None:
            msg = f"layer {layer_id!r} is not a QSA layer; QSA layers: {list(self._ordinal)!r}"
            raise OffloadRuntimeError(msg)
        g = self.kv.geometry
        batch = len(self._rows)
        self.kv.write_token(
            ordinal,
            self._rows,
            k.view(batch, g.kv_heads, g.head_dim),
            v.view(batch, g.kv_heads, g.head_dim),
        )
        blocks = self._complete_blocks(indices)
        self._count_blocks(ordinal, blocks)
        out, _lse = self.kv.attend(
            ordinal, self._rows, q.reshape(batch, -1, g.head_dim), blocks, scale=scale
        )
        return out.reshape(batch, -1).to(q.dtype)

    # ---- internals -------------------------------------------------------------------------------

    def _complete_blocks(self, indices: torch.Tensor) -> torch.Tensor:
        """``[B, block_topk]`` int32 selected complete blocks (``-1`` padded) from ``indices``."""
        assert self._closed is not None  # set by begin_decode
        closed = self._closed.unsqueeze(1)
        width = indices.shape[1] if indices.dim() == 2 else -1
        if width == self._block_topk:
            blocks = indices.to(torch.int32)
            return torch.where(blocks < closed, blocks, -1)
        if width == BLOCK_TOKENS * self._block_topk + BLOCK_TOKENS - 1:
            # Token positions: a selected block contributes its first token (4 b); the open
            # block's tokens lie at or after 4 * closed and are the tail's.
            tokens = indices.to(torch.int32)
            starts = (tokens >= 0) & (tokens % BLOCK_TOKENS == 0) & (tokens < BLOCK_TOKENS * closed)
            candidates = torch.where(starts, tokens // BLOCK_TOKENS, -1)
            return candidates.sort(dim=1, descending=True).values[:, : self._block_topk]
        msg = (
            f"the offloaded decode takes the indexer's [B, {self._block_topk}] block ids or "
            f"[B, {BLOCK_TOKENS * (self._block_topk + 1) - 1}] token positions; got "
            f"{tuple(indices.shape)!r}"
        )
        raise OffloadRuntimeError(msg)

    def _hand_off(self, row: int, pool: Any, slots: torch.Tensor) -> None:
        """The prompt's K/V of every QSA layer, read from SGLang's pool, into lease row ``row``."""
        index = slots.long()
        dtype = self.kv.geometry.dtype
        k = torch.stack([pool.get_key_buffer(i).index_select(0, index) for i in self._layer_ids])
        v = torch.stack([pool.get_value_buffer(i).index_select(0, index) for i in self._layer_ids])
        self.kv.admit(row, k.to(dtype), v.to(dtype))
        logger.debug("offload: row %d took a %d-token prompt", row, int(index.numel()))

    def _count_blocks(self, ordinal: int, blocks: torch.Tensor) -> None:
        """Add this layer's selected and missing blocks to the device-side counters (no sync)."""
        valid = blocks >= 0
        rows = torch.tensor(self._rows, device=blocks.device).unsqueeze(1)
        resident = self.kv.tables.block_slot[ordinal][rows, blocks.clamp(min=0).long()] >= 0
        self._pending_counts += torch.stack((valid.sum(), (valid & ~resident).sum()))

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


def _build_runtime(runner: Any) -> OffloadRuntime:
    """The runtime of one model runner, sized from its pools and the model's QSA profile."""
    from sglang.srt.layers.attention.qsa.config import parse_qsa_profile
    from sglang.srt.runtime_context import get_parallel

    pool = runner.token_to_kv_pool
    full = pool.full_kv_pool
    layer_ordinal = dict(pool.full_attention_layer_id_mapping)
    model_config = runner.model_config
    config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    profile = parse_qsa_profile(config)
    if profile is None:
        msg = f"{type(config).__name__} has no QSA profile; p2-offload serves QSA models only"
        raise ConfigurationError(msg)
    if profile.compress_ratio != BLOCK_TOKENS:
        msg = (
            f"indexer_compress_ratio={profile.compress_ratio!r}; p2-offload moves blocks of "
            f"{BLOCK_TOKENS} tokens (allowed: {BLOCK_TOKENS})"
        )
        raise ConfigurationError(msg)
    dtype = full.dtype  # the logical dtype (fp8 pools store uint8 and hand out fp8 views)
    if dtype not in _KV_DTYPES:
        msg = f"the KV pool stores {dtype}; p2-offload stores {list(_KV_DTYPES)!r}"
        raise ConfigurationError(msg)
    context_len = int(model_config.context_len)
    rows = int(runner.req_to_token_pool.size)
    geometry = OffloadGeometry(
        layers=len(layer_ordinal),
        rows=rows,
        hot_slots=int(profile.block_topk),
        max_blocks=math.ceil(context_len / BLOCK_TOKENS),
        kv_heads=int(full.head_num),
        head_dim=int(full.head_dim),
        dtype=dtype,
    )
    record = math.prod(geometry.record_shape) * torch.empty((), dtype=dtype).element_size()
    arena = geometry.rows * geometry.layers * geometry.max_blocks * record
    available = meminfo_bytes("MemAvailable")
    if available is not None and arena > available:
        msg = (
            f"the host arena needs {format_bytes(arena)} ({rows} rows x {geometry.layers} QSA "
            f"layers x {geometry.max_blocks} blocks x {record} B) but the host has "
            f"{format_bytes(available)} available; lower --max-running-requests={rows} or "
            f"--context-length={context_len}"
        )
        raise ConfigurationError(msg)
    kv = OffloadedKV(geometry, torch.device(runner.device))
    logger.info(
        "offload: host arena %s (%d rows x %d QSA layers x %d blocks, %s, %s), hot caches %s on "
        "%s, kernels: %s",
        format_bytes(arena),
        rows,
        geometry.layers,
        geometry.max_blocks,
        str(dtype).removeprefix("torch."),
        "pinned" if kv.host_arena.is_pinned() else "pageable",
        format_bytes(kv.hot.numel() * kv.hot.element_size()),
        kv.device,
        kv.path.value,
    )
    return OffloadRuntime(kv, layer_ordinal, int(profile.block_topk), int(get_parallel().tp_rank))


def runtime_of(runner: Any) -> OffloadRuntime:
    """The one runtime of ``runner`` (built on first use, shared by all its backends)."""
    runtime = getattr(runner, "qsa_offload_runtime", None)
    if runtime is None:
        runtime = runner.qsa_offload_runtime = _build_runtime(runner)
    return runtime


@functools.cache
def _backend_class() -> type[Any]:
    """The ``QwenSparseAttnBackend`` subclass; built on first use so importing stays cheap."""
    from sglang.srt.layers.attention.qwen_sparse_attn_backend import QwenSparseAttnBackend

    class HiSparseOffloadBackend(QwenSparseAttnBackend):  # type: ignore[misc]
        """Upstream's QSA backend whose decode reads K/V from the host arena (module docstring)."""

        def __init__(self, runner: Any) -> None:
            super().__init__(runner)
            self.qsa_runtime = runtime_of(runner)

        def _can_defer_block_expansion(self, forward_mode: Any) -> bool:
            # Decode takes the indexer's block ids as they are: the hot cache holds blocks.
            return bool(forward_mode.is_decode())

        def init_forward_metadata(self, forward_batch: Any) -> None:
            super().init_forward_metadata(forward_batch)
            if forward_batch.forward_mode.is_decode():
                self.qsa_runtime.begin_decode(
                    forward_batch, self.token_to_kv_pool, self.req_to_token_pool.req_to_token
                )

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
            del forward_batch, save_kv_cache, kwargs  # the token goes to the tail, not the pool
            if topk_indices is None:
                msg = "QSA sparse attention requires topk_indices"
                raise ValueError(msg)
            return self.qsa_runtime.decode_layer(
                layer.layer_id, q, k, v, topk_indices, float(layer.scaling)
            )

    return HiSparseOffloadBackend


def after_attn_backend_wrapper(
    result: Any, runner: Any, full_attn_backend: Any, *args: object, **kwargs: object
) -> None:
    """AFTER hook on ``attention_registry.attn_backend_wrapper``: install the offload backend.

    With ``SGLANG_QSA_HISPARSE_V3=p2-offload``, the hybrid GDN backend's full-attention side (its
    ``full_attn_backend`` and the first entry of ``attn_backend_list``, the only two references)
    becomes the offload backend. Any other mode leaves upstream's backend in place.

    Raises:
        ConfigurationError: ``p2-offload`` on a model whose wrapper did not build upstream's
            ``QwenSparseAttnBackend``.
    """
    del full_attn_backend, args, kwargs
    from qsa_sglang_plugin._switches import HiSparseMode, current_switches

    if current_switches().hisparse is not HiSparseMode.P2_OFFLOAD:
        return
    from sglang.srt.layers.attention.qwen_sparse_attn_backend import QwenSparseAttnBackend

    upstream = getattr(result, "full_attn_backend", None)
    if type(upstream) is not QwenSparseAttnBackend:
        msg = (
            f"SGLANG_QSA_HISPARSE_V3=p2-offload needs the hybrid GDN backend with upstream's "
            f"QwenSparseAttnBackend; attn_backend_wrapper built {type(result).__name__} with "
            f"{type(upstream).__name__}"
        )
        raise ConfigurationError(msg)
    backend = _backend_class()(runner)
    result.full_attn_backend = backend
    result.attn_backend_list[0] = backend
    logger.info("offload: the QSA layers attend through %s", type(backend).__name__)
