"""Double sparsity inside SGLang: the ``qsa_ds`` attention backend for ordinary GQA models.

With ``SGLANG_QSA_DS_CHANNEL_CONFIG`` set and ``--attention-backend qsa_ds``, SGLang's attention
registry builds :class:`DoubleSparsityBackend` through :func:`create_backend`. It wraps the
platform's dense backend (``triton`` on CUDA, ``torch_native`` on CPU), which keeps prefill and
every dense decode exactly as upstream, and adds what double sparsity needs:

- a label cache (:class:`qsa_kernels.double_sparsity.LabelCache`) indexed by SGLang's token slots,
  ``[L, N, Hkv, C]`` for the ``N`` slots of the K/V pool, written wherever SGLang writes a key
  (every extend and decode step, at ``out_cache_loc``), so SGLang's ``req_to_token`` addresses the
  labels, the keys and the values alike;
- eager decode: when every row of the batch is dense by :meth:`DSConfig.is_dense` (its context
  is below ``SGLANG_QSA_DS_THRESHOLD`` or fits in the heavy tokens), the dense backend decodes it;
  otherwise every row goes through :func:`qsa_kernels.double_sparsity.ds_decode_split` (label
  scores, the heavy tokens per KV head, attention over them read in place from SGLang's own K and
  V buffers; dense rows there attend every token; the torch references on CPU);
- decode under CUDA graphs: the captured step runs both paths over the whole batch, with no host
  input. The dense backend decodes every row, but before each replay it is given a length of 1 for
  the sparse rows, so they cost it one token; :func:`ds_heavy_decode_split` gives every row its
  heavy tokens (lengths on the device, the slot table gathered once per step), and a device mask
  of the sparse rows, refreshed before each replay, picks each row's output. A batch whose rows
  are all dense answers as the dense backend's own graph, bit for bit.

The label cache costs ``L * Hkv * C`` 16-bit values per token slot (``C / (2 D)`` of the K/V
bytes, 12.5 % at 32 of 128 channels): :func:`._pool_sizing.price_label_cache` adds them to the
price of a token in SGLang's pool sizing, so the pool and the labels together fit the budget
SGLang computed for the pool alone.

**DS-Offload** (``SGLANG_QSA_DS_OFFLOAD=1``): the K/V history lives in pinned host memory, as
``p2-offload`` keeps it for QSA layers, through the same runtime
(:class:`qsa_kernels.offload.OffloadRuntime`: one prompt's staging area, per-request hot caches
and open-block tails, the host arena) and the
same lifecycle (the ``qsa_hisparse`` tree cache); SGLang's K/V pool holds one page
(:mod:`._kv_pool`) and a token costs only its labels in pool sizing. Prefill writes the chunk to
the staging area and the dense backend attends over it (its K/V pool seen as the staging area,
token ``t`` at row ``t``: :class:`_DSOffload`); every decode row, dense or sparse, chooses its
tokens per KV head (:func:`qsa_kernels.double_sparsity.ds_positions`: all of them for a dense
row) and attends them through :meth:`OffloadRuntime.decode_tokens`, which fetches each head's
own records of the blocks that hold them (one record per block and KV head). Eagerly, each
step's token lists are as wide as its longest list (from the host's sequence lengths); under
decode CUDA graphs the step is planned outside the graph as ``p2-offload``'s is, and the captured
layers choose their tokens with the lengths of the step plan on the device and lists of a fixed
width (:func:`qsa_kernels.double_sparsity.ds_positions_fixed`, :meth:`DSConfig.fixed_width`),
whose blocks the hot caches always hold (:meth:`DSConfig.hot_blocks` slots), so nothing is
counted on the host.

Limits of this backend today: no speculative decoding (start-up refuses it). Under tensor
parallelism each rank keeps the labels and channels of its own K/V heads
(:meth:`ChannelConfig.for_tp_rank`).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
from typing import Any

import torch

import qsa_core
from qsa_kernels.offload import OffloadRuntime
from qsa_sglang_plugin._adapters._metrics import RankMetrics
from qsa_sglang_plugin._adapters._offload import (
    plan_decode,
    runtime_of,
    stage_chunk,
)
from qsa_sglang_plugin._config_check import ds_channels, ds_config, ds_geometry
from qsa_sglang_plugin._errors import AdapterError
from qsa_sglang_plugin._switches import (
    ENV_DS_CHANNEL_CONFIG,
    DoubleSparsitySwitches,
    current_switches,
)

__all__ = (
    "DecodePath",
    "StepMode",
    "create_backend",
    "label_bytes_per_token",
    "label_dtype",
)

logger = logging.getLogger(__name__)

#: Prometheus names of this backend's series.
METRIC_PREFIX = "qsa_hisparse_ds"
#: The dense backend the wrapper decodes through, per device type.
DENSE_BACKENDS = {"cuda": "triton", "cpu": "torch_native"}


class DecodePath(enum.StrEnum):
    """How a decode row attended."""

    DENSE = "dense"
    """Every token of its context."""
    SPARSE = "sparse"
    """Its heavy tokens per KV head."""


class StepMode(enum.StrEnum):
    """How a decode step ran."""

    EAGER = "eager"
    """Launched from Python (``init_forward_metadata``)."""
    GRAPH = "graph"
    """Replayed from a captured CUDA graph."""


def label_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The label cache's dtype for a K/V pool of ``kv_dtype``: the same when 16-bit, else bf16."""
    return kv_dtype if kv_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def label_bytes_per_token(
    layers: int, kv_heads: int, switches: DoubleSparsitySwitches, kv_dtype: torch.dtype
) -> int:
    """GPU bytes of one token slot's label rows: ``layers x kv_heads x C`` label values."""
    element = label_dtype(kv_dtype).itemsize
    return qsa_core.label_bytes_per_token(layers, kv_heads, switches.heavy_channel_num, element)


def create_backend(runner: Any) -> Any:
    """Factory of SGLang's attention registry under ``qsa_ds``: the wrapped dense backend.

    Raises:
        AdapterError: the device has no dense backend here, or the switch is off (start-up
            checks refuse both earlier).
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.runtime_context import get_parallel

    from qsa_kernels.double_sparsity import LabelCache

    switches = current_switches().double_sparsity
    if switches is None:
        msg = f"--attention-backend qsa_ds needs {ENV_DS_CHANNEL_CONFIG}; it is not set"
        raise AdapterError(msg)
    device = torch.device(runner.device)
    dense_name = DENSE_BACKENDS.get(device.type)
    if dense_name is None:
        msg = f"qsa_ds runs on {sorted(DENSE_BACKENDS)!r}; this runner's device is {device!r}"
        raise AdapterError(msg)
    dense = ATTENTION_BACKENDS[dense_name](runner)
    config = ds_config(switches)
    text_config = runner.model_config.hf_text_config.to_dict()
    layers, _, _, head_dim = ds_geometry(text_config)
    parallel = get_parallel()
    channels = ds_channels(switches, text_config).for_tp_rank(
        int(parallel.attn_tp_size), int(parallel.attn_tp_rank)
    )  # this rank's K/V heads
    pool = runner.token_to_kv_pool
    slots = int(pool.size) + int(pool.page_size)  # the pool's token slots, its padding page too
    labels = LabelCache(
        channels.channels,
        rows=1,
        max_tokens=slots,
        dtype=label_dtype(pool.dtype),
        device=device,
    )
    offload = _DSOffload(dense, dense_name, runtime_of(runner)) if switches.offload else None
    logger.info(
        "qsa_ds: %d heavy channels of %d, %d heavy tokens, dense below %d tokens; label cache "
        "%d layers x %d slots (%.1f MiB) over %s%s",
        config.heavy_channel_num,
        head_dim,
        config.heavy_token_num,
        config.sparse_decode_threshold,
        layers,
        labels.max_tokens,
        labels.buffer.numel() * labels.buffer.element_size() / (1 << 20),
        dense_name,
        "; DS-Offload: K/V in the host arena" if offload is not None else "",
    )
    return DoubleSparsityBackend(
        dense, labels, config, runner, tp_rank=int(parallel.tp_rank), offload=offload
    )


class _StagingKV:
    """SGLang's K/V-pool reads over the offload's staging area.

    Token ``t`` of the staged prompt is row ``t`` of every layer's buffers: what the dense
    backend's prefill reads.
    """

    def __init__(self, runtime: OffloadRuntime) -> None:
        self._runtime = runtime

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._runtime.staging_layer(layer_id)[0]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._runtime.staging_layer(layer_id)[1]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._runtime.staging_layer(layer_id)

    def set_kv_buffer(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        msg = "DS-Offload stages a prefill chunk through the offload runtime, not the K/V pool"
        raise AdapterError(msg)


class _DSOffload:
    """DS-Offload's side of the backend: the offload runtime, and prefill over its staging area.

    One prompt at a time is staged. The dense backend's K/V pool becomes :class:`_StagingKV`,
    and where it reads prefix tokens by SGLang's slots, it reads them by position instead.

    ``torch_native`` reads ``req_to_token[req_pool_idx, :seq_len]``: it gets a one-row table of
    positions and the batch's one request at row 0. ``triton`` reads its metadata's
    ``kv_indices``: after SGLang's metadata is built, the prefix's slots become ``0 .. prefix -
    1``. The kernels and their arguments are otherwise upstream's, so a chunk attends exactly as
    in a resident engine.
    """

    def __init__(self, dense: Any, dense_name: str, runtime: OffloadRuntime) -> None:
        if dense_name not in DENSE_BACKENDS.values():
            allowed = sorted(DENSE_BACKENDS.values())
            msg = f"DS-Offload stages prefill for {allowed!r}; got {dense_name!r}"
            raise AdapterError(msg)
        self.runtime = runtime
        self._dense = dense
        self._name = dense_name
        g = runtime.kv.geometry
        dense.token_to_kv_pool = _StagingKV(runtime)
        if dense_name == DENSE_BACKENDS["cpu"]:
            positions = torch.arange(g.max_tokens, dtype=torch.int32, device=runtime.kv.device)
            dense.req_to_token_pool = _PositionTable(positions.unsqueeze(0))

    def init_prefill(self, forward_batch: Any) -> None:
        """The dense backend's metadata of an extend batch, reading the staging area."""
        self._dense.init_forward_metadata(forward_batch)
        if self._name == DENSE_BACKENDS["cuda"]:
            meta = self._dense.forward_metadata
            prefixes = forward_batch.extend_prefix_lens_cpu  # None when SGLang kept them on GPU
            prefix = int((prefixes or forward_batch.extend_prefix_lens)[0])
            slots = meta.kv_indices
            positions = torch.arange(prefix, dtype=slots.dtype, device=slots.device)
            self._dense.forward_metadata = dataclasses.replace(meta, kv_indices=positions)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any
    ) -> torch.Tensor:
        """Stage one layer's chunk, then attend over the staged prompt with the dense backend."""
        stage_chunk(self.runtime, layer.layer_id, k, v, forward_batch)
        if self._name == DENSE_BACKENDS["cpu"]:
            forward_batch = copy.copy(forward_batch)
            forward_batch.req_pool_indices = torch.zeros_like(forward_batch.req_pool_indices)
        out: torch.Tensor = self._dense.forward_extend(
            q, k, v, layer, forward_batch, save_kv_cache=False
        )
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class _PositionTable:
    """A ``ReqToTokenPool`` stand-in whose one row maps each position to itself."""

    req_to_token: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class _SparseStep:
    """A decode step with a sparse row: what every layer's decode reads.

    Attributes:
        lengths: ``B`` host context lengths.
        req_to_token: ``[B, max(lengths)]`` token slots of the batch's rows.
    """

    lengths: list[int]
    req_to_token: torch.Tensor


@dataclasses.dataclass(slots=True)
class _GraphStep:
    """The decode step being captured: what its layers read, all device tensors of fixed address.

    Attributes:
        sparse_rows: ``[bs]`` bool, the rows that attend their heavy tokens (refreshed before
            each replay; DS-Offload decides per row on the device instead).
        req_to_token: ``[bs, S]`` the batch's slot table, gathered inside the captured step.
        lengths: ``[bs]`` int32, DS-Offload's planned row lengths after the new token (padding
            rows at 1), computed inside the captured step once for every layer.
    """

    sparse_rows: torch.Tensor
    req_to_token: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


class DoubleSparsityBackend:
    """SGLang's dense backend plus label writes and double-sparsity decode (module docstring).

    Everything SGLang asks of an attention backend that is not extend or decode (metadata, CUDA
    graph state, capability queries) is the dense backend's.

    Args:
        dense: the platform's dense backend.
        labels: the slot-indexed label cache, one layer per attention layer.
        config: the double-sparsity options.
        runner: SGLang's ``ModelRunner`` (its pools).
        tp_rank: this rank, for the metrics' labels.
        offload: DS-Offload (the K/V in the host arena), or None for resident K/V.
    """

    def __init__(
        self,
        dense: Any,
        labels: Any,
        config: Any,
        runner: Any,
        *,
        tp_rank: int = 0,
        offload: _DSOffload | None = None,
    ) -> None:
        self.dense = dense
        self._offload = offload
        self._labels = labels
        self._config = config
        self._kv_pool = runner.token_to_kv_pool
        self._req_to_token = runner.req_to_token_pool.req_to_token
        self._reference = labels.device.type != "cuda"
        self._step: _SparseStep | None = None
        self._graph: _GraphStep | None = None  # set while a captured step is built
        self._sparse_rows: torch.Tensor | None = None  # [max_bs] bool, from init_cuda_graph_state
        self._rows = RankMetrics(tp_rank).counters_by(
            f"{METRIC_PREFIX}_decode_rows",
            "Decode rows, once per step, by how they attended.",
            "path",
            list(DecodePath),
        )
        self._steps = RankMetrics(tp_rank).counters_by(
            f"{METRIC_PREFIX}_decode_steps",
            "Decode steps with at least one real row, by how they ran.",
            "mode",
            list(StepMode),
        )

    def __getattr__(self, name: str) -> Any:
        # Only for what this class does not define: the dense backend's metadata and graph API.
        dense = self.__dict__.get("dense")
        if dense is None:
            raise AttributeError(name)
        return getattr(dense, name)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """The dense backend's metadata, and once per decode step what every layer shares.

        The host sequence lengths, which rows are dense and, for a batch with a sparse row, its
        ``req_to_token`` rows are the same in every layer: decided here, counted once per step.
        With DS-Offload the step is planned in the offload runtime (a prompt that starts
        decoding moves to the host arena) and every batch takes the double-sparsity path; a
        prefill's metadata is the dense backend's over the staging area.
        """
        self._step = None
        self._graph = None
        decode = forward_batch.forward_mode.is_decode()
        if self._offload is None:
            self.dense.init_forward_metadata(forward_batch)
        elif decode:
            plan_decode(self._offload.runtime, forward_batch)  # every row reads the host arena
        else:
            self._offload.init_prefill(forward_batch)
        if not decode:
            return
        lengths = [int(n) for n in _host_seq_lens(forward_batch)]
        all_dense = self._count(lengths, StepMode.EAGER) == len(lengths)
        if not all_dense or self._offload is not None:
            rows = self._req_to_token[forward_batch.req_pool_indices, : max(lengths)]
            self._step = _SparseStep(lengths, rows)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args: Any) -> None:
        """The dense backend's graph buffers, and the captured steps' mask of sparse rows."""
        self.dense.init_cuda_graph_state(max_bs, max_num_tokens, *args)
        self._sparse_rows = torch.zeros(max_bs, dtype=torch.bool, device=self._labels.device)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Before a capture or a replay: the sparse rows, and the dense metadata without them.

        The dense backend sees the sparse rows at length 1. At capture every row has SGLang's fill
        length (dense), so the dense backend's metadata is its own; the captured step still holds
        both paths (:meth:`forward_decode`). With DS-Offload the offload runtime plans the step
        (the padding SGLang adds becomes free rows) and the dense backend, which decodes no row,
        sees every row at length 1.
        """
        self._step = None
        if not forward_batch.forward_mode.is_decode_or_idle():
            self._graph = None
            self.dense.init_forward_metadata_out_graph(forward_batch, in_capture)
            return
        if self._sparse_rows is None:
            msg = "qsa_ds: a CUDA graph step before init_cuda_graph_state"
            raise AdapterError(msg)
        seq_lens = forward_batch.seq_lens
        sparse = self._config.sparse_rows(seq_lens)
        mask = self._sparse_rows[: sparse.shape[0]]
        mask.copy_(sparse)
        if self._offload is not None and forward_batch.forward_mode.is_decode():
            plan_decode(self._offload.runtime, forward_batch, graph=True, capture=in_capture)
            sparse = torch.ones_like(sparse)  # the dense backend decodes no row
        if in_capture:
            self._graph = _GraphStep(mask)
            self.dense.init_forward_metadata_out_graph(forward_batch, in_capture)
            return
        lengths = [int(n) for n in _host_seq_lens(forward_batch)]
        real = len(lengths) - int(getattr(forward_batch, "num_padding", 0) or 0)
        all_dense = self._count(lengths[:real], StepMode.GRAPH) == real
        if all_dense and self._offload is None:  # the dense backend's own metadata
            self.dense.init_forward_metadata_out_graph(forward_batch, in_capture)
            return
        host = [n if self._offload is None and self._config.is_dense(n) else 1 for n in lengths]
        shrunk = copy.copy(forward_batch)
        shrunk.seq_lens = torch.where(sparse, torch.ones_like(seq_lens), seq_lens)
        if getattr(forward_batch, "seq_lens_cpu", None) is not None:
            shrunk.seq_lens_cpu = torch.tensor(host, dtype=forward_batch.seq_lens_cpu.dtype)
        if getattr(forward_batch, "seq_lens_sum", None) is not None:
            shrunk.seq_lens_sum = sum(host)
        self.dense.init_forward_metadata_out_graph(shrunk, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Inside the captured step: the dense backend's metadata, then what every layer reads.

        The batch's slot table and, with DS-Offload, the plan's row lengths, once per step.
        """
        self.dense.init_forward_metadata_in_graph(forward_batch)
        if self._graph is not None:
            self._graph.req_to_token = self._req_to_token[forward_batch.req_pool_indices]
            if self._offload is not None and forward_batch.forward_mode.is_decode():
                self._graph.lengths = self._offload.runtime.kv.step_lengths

    def glue_draft_metadata(self) -> str:
        """Why SGLang must not capture this backend's replay prep (it counts rows on the host)."""
        return "qsa_ds counts each step's dense and sparse rows on the host"

    def glue_target_verify_metadata(self) -> str:
        """As :meth:`glue_draft_metadata`."""
        return self.glue_draft_metadata()

    def _count(self, lengths: list[int], mode: StepMode) -> int:
        """Count a step and its rows by path in the metrics; return how many rows are dense."""
        if lengths:
            self._steps[mode].inc()
        dense = sum(bool(self._config.is_dense(n)) for n in lengths)
        self._rows[DecodePath.DENSE].inc(dense)
        self._rows[DecodePath.SPARSE].inc(len(lengths) - dense)
        return dense

    def forward(  # noqa: PLR0917
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """SGLang's entry, as its base backend's: idle, decode, or extend (mixed chunks too)."""
        if forward_batch.forward_mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(  # noqa: PLR0917
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Dense prefill as upstream, then the labels of the new keys.

        With DS-Offload the chunk goes to the staging area first and the dense backend attends
        over the staged prompt (:class:`_DSOffload`).
        """
        if self._offload is not None:
            if k is None or v is None:
                msg = "DS-Offload stages every prefill chunk's K/V; the layer gave none"
                raise AdapterError(msg)
            self._write_labels(layer, forward_batch, k)
            return self._offload.prefill(q, k, v, layer, forward_batch)
        out: torch.Tensor = self.dense.forward_extend(
            q, k, v, layer, forward_batch, save_kv_cache, **kwargs
        )
        self._write_labels(layer, forward_batch, k)
        return out

    def forward_decode(  # noqa: PLR0917
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Label of the new key; dense decode when every row is dense, else double sparsity."""
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        from qsa_kernels.double_sparsity import ds_decode_split, ds_decode_split_reference

        self._write_labels(layer, forward_batch, k)
        if self._offload is not None:
            return self._offloaded_decode(q, k, v, layer)
        if self._graph is not None:
            return self._captured_decode(
                self._graph, q, k, v, layer, forward_batch, save_kv_cache, **kwargs
            )
        step = self._step
        if step is None:  # every row dense
            return self.dense.forward_decode(  # type: ignore[no-any-return]
                q, k, v, layer, forward_batch, save_kv_cache, **kwargs
            )
        if save_kv_cache and k is not None and v is not None:
            self._kv_pool.set_kv_buffer(
                layer, KVWriteLoc.for_batch(forward_batch), k, v, layer.k_scale, layer.v_scale
            )
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        decode = ds_decode_split_reference if self._reference else ds_decode_split
        result = decode(
            q.reshape(-1, heads, dim).to(torch.bfloat16),
            self._kv_pool.get_key_buffer(layer.layer_id),
            self._kv_pool.get_value_buffer(layer.layer_id),
            self._labels.layer(layer.layer_id),
            self._labels.channels[layer.layer_id],
            step.req_to_token,
            step.lengths,
            config=self._config,
            scale=float(layer.scaling),
        )
        return result.out.to(q.dtype).reshape(-1, heads * layer.v_head_dim)

    def _offloaded_decode(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any
    ) -> torch.Tensor:
        """DS-Offload: every row's chosen tokens per KV head, attended from the host arena.

        Eagerly the lists are as wide as the step's longest; in a captured step they have the
        fixed width and the lengths come from the step plan on the device (no host input).
        """
        from qsa_kernels.double_sparsity import ds_positions, ds_positions_fixed

        step, graph, offload = self._step, self._graph, self._offload
        if offload is None or k is None or v is None:
            msg = "qsa_ds: an offloaded decode needs the offload runtime and the new token's K/V"
            raise AdapterError(msg)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        queries = q.reshape(-1, heads, dim).to(torch.bfloat16)
        labels = (self._labels.layer(layer.layer_id), self._labels.channels[layer.layer_id])
        if graph is not None and graph.req_to_token is not None and graph.lengths is not None:
            positions = ds_positions_fixed(
                queries, *labels, graph.req_to_token, graph.lengths, config=self._config
            )
        elif graph is None and step is not None:
            positions = ds_positions(
                queries,
                *labels,
                step.req_to_token,
                step.lengths,
                config=self._config,
                reference=self._reference,
            )
        else:
            msg = "qsa_ds: an offloaded decode before its step's metadata"
            raise AdapterError(msg)
        out = offload.runtime.decode_tokens(
            layer.layer_id, queries, k, v, positions, float(layer.scaling), checked=graph is None
        )
        return out.to(q.dtype).reshape(-1, heads * layer.v_head_dim)

    def _captured_decode(  # noqa: PLR0917
        self,
        graph: _GraphStep,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Both paths for every row, no host input; the step's mask picks each row's output."""
        from qsa_kernels.double_sparsity import ds_heavy_decode_split

        if graph.req_to_token is None:
            msg = "qsa_ds: a captured decode before init_forward_metadata_in_graph"
            raise AdapterError(msg)
        dense: torch.Tensor = self.dense.forward_decode(
            q, k, v, layer, forward_batch, save_kv_cache, **kwargs
        )  # writes this step's K/V
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        rows = graph.sparse_rows.shape[0]
        sparse = ds_heavy_decode_split(
            q.reshape(-1, heads, dim)[:rows].to(torch.bfloat16),
            self._kv_pool.get_key_buffer(layer.layer_id),
            self._kv_pool.get_value_buffer(layer.layer_id),
            self._labels.layer(layer.layer_id),
            self._labels.channels[layer.layer_id],
            graph.req_to_token,
            forward_batch.seq_lens[:rows],
            heavy_token_num=self._config.heavy_token_num,
            scale=float(layer.scaling),
        ).out.reshape(rows, heads * layer.v_head_dim)
        pick = graph.sparse_rows[:, None]
        return torch.where(pick, sparse.to(dense.dtype), dense.view(rows, -1)).view_as(dense)

    def _write_labels(self, layer: Any, forward_batch: Any, k: torch.Tensor | None) -> None:
        """The labels of the keys SGLang writes at ``out_cache_loc`` in this forward."""
        if k is None:
            return
        keys = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
        self._labels.write_slots(layer.layer_id, forward_batch.out_cache_loc, keys)


def _host_seq_lens(forward_batch: Any) -> Any:
    """The batch's sequence lengths on the host (SGLang's copy when it made one)."""
    lengths = getattr(forward_batch, "seq_lens_cpu", None)
    return forward_batch.seq_lens.cpu() if lengths is None else lengths
