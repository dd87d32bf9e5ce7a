"""``p2-offload`` inside SGLang: SGLang's objects turned into :class:`OffloadRuntime` calls.

The offload itself is :class:`qsa_kernels.offload.OffloadRuntime` (docs/plugin.md,
"p2-offload"). Here: a ``ForwardBatch`` as a planned decode step (:func:`plan_decode`), an
extend layer (:func:`extend_layer`) or its requests' prefill chunks (:func:`extend_spans`,
:func:`stage_chunk`); SGLang's pools and model config as the runtime's :class:`OffloadLayout`
(:func:`qsa_layout`, priced by :mod:`._pool_sizing`); the model runner's one runtime
(:func:`runtime_of`), whose counts are ``qsa_hisparse_*`` series (:meth:`OffloadCounts.series`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from qsa_core import format_bytes
from qsa_kernels import KernelInputError
from qsa_kernels.context import PrefillKernels, ZigzagEntries
from qsa_kernels.offload import (
    ChunkSpan,
    OffloadCounts,
    OffloadLayout,
    OffloadRuntime,
    chunk_spans,
)
from qsa_sglang_plugin._adapters._metrics import CountsMirror, RankMetrics
from qsa_sglang_plugin._adapters._qsa_common import (
    group_head_layout,
    qsa_profile_of,
    shard_group,
)
from qsa_sglang_plugin._adapters._sharded_index import install_rank_index
from qsa_sglang_plugin._config_check import ds_config, ds_geometry
from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError
from qsa_sglang_plugin._hostmem import meminfo_bytes
from qsa_sglang_plugin._switches import DoubleSparsitySwitches, current_switches

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds

__all__ = (
    "extend_layer",
    "extend_span",
    "extend_spans",
    "offload_read_ends",
    "plan_decode",
    "qsa_layout",
    "runtime_of",
    "stage_chunk",
)

logger = logging.getLogger(__name__)

_PREFIX = "qsa_hisparse"


def _host_slots(forward_batch: Any) -> list[int]:
    """The batch's engine slots (``req_pool_indices``) from SGLang's host copy when it has one.

    Reading the device tensor instead would wait for every forward queued before it: under
    overlap scheduling, the whole of the previous batch.
    """
    slots = getattr(forward_batch, "req_pool_indices_cpu", None)
    if slots is None:
        slots = forward_batch.req_pool_indices
    held: list[int] = slots.tolist()
    return held


def plan_decode(
    runtime: OffloadRuntime, forward_batch: Any, *, graph: bool = False, capture: bool = False
) -> None:
    """:meth:`OffloadRuntime.plan_decode` of a decode ``ForwardBatch``.

    Or of the CUDA graph runner's padded view of one (``graph``: ``batch_size`` rows, the last
    ``num_padding`` padding; ``capture``: every row padding).
    """
    batch = int(forward_batch.batch_size)
    real = 0 if capture else batch - int(getattr(forward_batch, "num_padding", 0) or 0)
    lens = forward_batch.seq_lens_cpu
    runtime.plan_decode(
        _host_slots(forward_batch)[:real],
        (lens if lens is not None else forward_batch.seq_lens)[:real].tolist(),
        pad_to=batch if graph or capture else None,
        capture=capture,
    )


def offload_read_ends(forward_mode: Any) -> SharedReadEnds:
    """Where an offloaded forward's reads of state that the scheduler also changes end.

    SGLang's ``AttentionBackend.shared_read_ends`` of the offload's backends. A decode step reads
    its rows (host arena, hot cache, tail) in every layer, and an overlapped scheduler releases a
    finished request's row (reading its counters and, verified, its bytes) while the next step
    runs: ``POST_REPLAY`` orders that after the whole step, where upstream's default for decode
    would order it after the captured step's metadata only.
    """
    from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds

    return SharedReadEnds.POST_REPLAY if forward_mode.is_decode() else SharedReadEnds.UNKNOWN


def extend_layer(  # noqa: PLR0917 (the attention call's own order)
    runtime: OffloadRuntime,
    layer_id: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    forward_batch: Any,
    *,
    scale: float,
    kernels: PrefillKernels,
    zigzag: ZigzagEntries | None = None,
) -> torch.Tensor:
    """:meth:`OffloadRuntime.extend` of one layer of an extend ``ForwardBatch``: ``[T, Hq, D]``.

    While SGLang's prefill graph runner warms up and captures, its batch is dummy requests
    (``req_pool_indices = arange(bs)``) that hold no host-arena row: nothing is staged and the
    rows attend to zeros, of ``q``'s shape and dtype (a captured segment only needs the output's
    address). A breakable graph runs this call eagerly between its captured segments, so at
    replay it stages the real batch.

    Raises:
        OffloadStateError: as :meth:`OffloadRuntime.extend`, outside a capture.
    """
    from sglang.srt.runtime_context import get_flags

    if get_flags().dp.capturing_prefill_graph:
        return q.new_zeros(q.shape)
    return runtime.extend(
        layer_id, q, k, v, indices, slots=_host_slots(forward_batch),
        extend_lens=forward_batch.extend_seq_lens_cpu, seq_lens=forward_batch.seq_lens_cpu,
        scale=scale, kernels=kernels, zigzag=zigzag,
    )  # fmt: skip


def extend_spans(forward_batch: Any) -> list[ChunkSpan]:
    """Each request's chunk of an extend batch, in the batch's order (:func:`chunk_spans`)."""
    return chunk_spans(
        _host_slots(forward_batch),
        [int(n) for n in forward_batch.seq_lens_cpu],
        [int(n) for n in forward_batch.extend_seq_lens_cpu],
    )


def extend_span(forward_batch: Any) -> tuple[int, int, int]:
    """``(engine slot, start, end)`` of an extend batch's one request: its chunk's tokens.

    Raises:
        OffloadRuntimeError: the batch extends more than one request (a runtime that stages one
            prompt at a time, ``--prefill-max-requests 1``).
    """
    spans = extend_spans(forward_batch)
    if len(spans) != 1:
        msg = (
            f"an extend batch of {len(spans)!r} requests; this offload stages one prompt at a "
            "time (--prefill-max-requests=1)"
        )
        raise OffloadRuntimeError(msg)
    return spans[0].slot, spans[0].start, spans[0].end


def stage_chunk(
    runtime: OffloadRuntime, layer_id: int, k: torch.Tensor, v: torch.Tensor, forward_batch: Any
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:meth:`OffloadRuntime.stage` of an extend batch's chunk: ``(k, v [T, Hkv, D], start)``.

    Raises:
        OffloadRuntimeError: as :func:`extend_span`.
    """
    slot, start, end = extend_span(forward_batch)
    staged_k, staged_v = runtime.stage(layer_id, k, v, slot=slot, start=start, end=end)
    return staged_k, staged_v, start


# ---- construction --------------------------------------------------------------------------------


def _refused(build: Callable[..., OffloadLayout], *args: Any, **sizes: Any) -> OffloadLayout:
    """``build(*args, **sizes)``; a size the library refuses raises ConfigurationError."""
    try:
        return build(*args, **sizes)
    except KernelInputError as exc:
        raise ConfigurationError(f"the offload cannot hold this KV cache: {exc}") from exc


def qsa_layout(
    model_config: Any,
    server_args: Any,
    layer_ids: Sequence[int],
    *,
    rows: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> OffloadLayout:
    """:meth:`OffloadLayout.qsa` of a QSA model's layers ``layer_ids`` and SGLang's flags.

    The hot-blocks switch, ``--prefill-max-requests`` (start-up refuses none) and the model's
    context length and block top-k; the sizes are this rank's.

    Raises:
        ConfigurationError: the library refuses a size (naming it).
    """
    return _refused(
        OffloadLayout.qsa,
        layer_ids,
        rows=rows,
        context_len=int(model_config.context_len),
        block_topk=int(qsa_profile_of(model_config).block_topk),
        hot_blocks=current_switches().hot_blocks,
        staged_prompts=int(server_args.prefill_max_requests),
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )


def _layout(runner: Any, ds: DoubleSparsitySwitches | None) -> OffloadLayout:
    """The runner's offloaded layers: the QSA layers, or every layer (double sparsity)."""
    pool, config = runner.token_to_kv_pool, runner.model_config
    rows = int(runner.req_to_token_pool.size)
    if ds is None:
        full, ordinal = pool.full_kv_pool, pool.full_attention_layer_id_mapping
        return qsa_layout(
            config,
            runner.server_args,
            sorted(ordinal, key=ordinal.__getitem__),
            rows=rows,
            kv_heads=int(full.head_num),
            head_dim=int(full.head_dim),
            dtype=full.dtype,  # the logical dtype (fp8 pools store uint8 and hand out fp8 views)
        )
    geometry = ds_geometry(config.hf_text_config.to_dict())
    return _refused(
        OffloadLayout.per_head,
        layers=geometry.layers,
        rows=rows,
        context_len=int(config.context_len),
        hot_blocks=ds_config(ds).hot_blocks(),
        windowed_staging=ds.staging_window,
        kv_heads=int(pool.head_num),
        head_dim=geometry.head_dim,
        dtype=pool.dtype,  # the logical dtype
    )


def _build_runtime(runner: Any) -> OffloadRuntime:
    from sglang.srt.runtime_context import get_parallel

    switches = current_switches()
    layout = _layout(runner, switches.double_sparsity)
    geometry = layout.geometry
    shard = shard_group(runner, switches.cache_sharding)
    try:
        geometry.check_host_memory(meminfo_bytes("MemAvailable"), shard)
    except KernelInputError as exc:
        msg = (
            f"{exc}; lower --max-running-requests={geometry.rows} or "
            f"--context-length={int(runner.model_config.context_len)}"
        )
        raise ConfigurationError(msg) from exc
    parallel = get_parallel()
    make = RankMetrics(int(parallel.tp_rank))
    runtime = OffloadRuntime.for_geometry(
        geometry,
        torch.device(runner.device),
        layout.layer_ordinal,
        layout.block_topk,
        shard=shard,
        verify=switches.verify_offload,
        q_heads=int(runner.model_config.get_num_attention_heads(parallel.attn_tp_size)),
        head_layout=group_head_layout(),
        on_counts=CountsMirror(make, _PREFIX, OffloadCounts.series()).update,
    )
    arena_doc = "Bytes of the host arena of the QSA layers' K/V."
    make.gauge(f"{_PREFIX}_host_arena_bytes", arena_doc).set(runtime.host_arena_bytes)
    sharding = runtime.describe_sharding()
    if sharding is not None:
        logger.info("offload: %s", sharding)
    pool = runner.token_to_kv_pool
    if switches.index_sharding and shard is not None:  # D2 on the arenas' group (alone: the pool's)
        install_rank_index(runtime.index(), pool, int(parallel.tp_rank))
    verification = runtime.describe_verification()
    if verification is not None:
        logger.warning("offload: SGLANG_QSA_HISPARSE_VERIFY=1: %s", verification)
    full = getattr(pool, "full_kv_pool", pool)  # the QSA pool's MHA leaf, or the MHA pool
    logger.info(
        "offload: %s; K/V pool %s; kernels: %s",
        runtime.describe(),
        format_bytes(sum(int(n) for n in full.get_kv_size_bytes())),  # (K bytes, V bytes)
        runtime.kv.path.value,
    )
    tokens = getattr(runner, "max_total_num_tokens", None)  # sized before the backends
    context = int(runner.model_config.context_len)
    shortfall = None if tokens is None else geometry.pool_shortfall(int(tokens), context)
    if shortfall is not None:
        logger.warning(
            "offload: %s; raise --mem-fraction-static (or --max-total-tokens) or lower "
            "--context-length",
            shortfall,
        )
    return runtime


def runtime_of(runner: Any) -> OffloadRuntime:
    """The one runtime of ``runner`` (built on first use, shared by all its backends)."""
    runtime = getattr(runner, "qsa_offload_runtime", None)
    if runtime is None:
        runtime = runner.qsa_offload_runtime = _build_runtime(runner)
    return runtime
