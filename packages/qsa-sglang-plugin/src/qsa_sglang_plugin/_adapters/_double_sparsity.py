"""Double sparsity inside SGLang: the ``qsa_ds`` attention backend for ordinary GQA models.

:class:`DoubleSparsityBackend` (built by :func:`create_backend`) is the platform's dense backend
(``triton`` on CUDA, ``torch_native`` on CPU) around
:class:`qsa_kernels.double_sparsity.DSDecodeRuntime`; this module maps SGLang's calls onto the
runtime (``docs/architecture.md``, "Each feature's path") and, with DS-Offload, points the dense
backend's prefill at the offload's staging area (:class:`_DSOffload`). Series:
``qsa_hisparse_ds_*`` (:meth:`DSCounts.series`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import torch

from qsa_kernels.double_sparsity import (
    DenseLayer,
    DSCounts,
    DSDecodeRuntime,
    staging_slots,
    staging_token_table,
)
from qsa_kernels.offload import OffloadRuntime
from qsa_sglang_plugin._adapters._metrics import CountsMirror, RankMetrics
from qsa_sglang_plugin._adapters._offload import (
    offload_read_ends,
    plan_decode,
    runtime_of,
    stage_chunk,
)
from qsa_sglang_plugin._config_check import ds_channels, ds_config, ds_geometry
from qsa_sglang_plugin._errors import AdapterError
from qsa_sglang_plugin._switches import ENV_DS_CHANNEL_CONFIG, current_switches

__all__ = ("create_backend",)

logger = logging.getLogger(__name__)

#: Prometheus names of this backend's series.
METRIC_PREFIX = "qsa_hisparse_ds"
#: The dense backend the wrapper decodes through, per device type.
DENSE_BACKENDS = {"cuda": "triton", "cpu": "torch_native"}


def create_backend(runner: Any) -> Any:
    """Factory of SGLang's attention registry under ``qsa_ds``: the wrapped dense backend.

    Raises:
        AdapterError: the device has no dense backend here, or the switch is off (start-up
            checks refuse both earlier).
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.runtime_context import get_parallel

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
    text_config = runner.model_config.hf_text_config.to_dict()
    parallel = get_parallel()
    channels = ds_channels(switches, text_config).for_tp_rank(
        int(parallel.attn_tp_size), int(parallel.attn_tp_rank)
    )  # this rank's K/V heads
    pool = runner.token_to_kv_pool
    offload = _DSOffload(dense, dense_name, runtime_of(runner)) if switches.offload else None
    runtime = DSDecodeRuntime.over_slots(
        channels.channels,
        ds_config(switches),
        slots=int(pool.size) + int(pool.page_size),  # the pool's padding page too
        kv_dtype=pool.dtype,
        device=device,
        offload=offload.runtime if offload is not None else None,
        on_counts=CountsMirror(
            RankMetrics(int(parallel.tp_rank)), METRIC_PREFIX, DSCounts.series()
        ).update,
    )
    logger.info(
        "qsa_ds: %s over %s%s",
        runtime.describe(ds_geometry(text_config).head_dim),
        dense_name,
        "; DS-Offload: K/V in the host arena" if offload is not None else "",
    )
    return DoubleSparsityBackend(dense, runtime, runner, offload=offload)


class _DSOffload:
    """DS-Offload's prefill: the dense backend (``dense_name``) reads the staging area.

    Its K/V pool becomes the staging area's layers; ``torch_native`` reads them through a
    one-row ``req_to_token`` (:func:`staging_token_table`), ``triton`` through its metadata's
    ``kv_indices`` (:func:`staging_slots`).
    """

    def __init__(self, dense: Any, dense_name: str, runtime: OffloadRuntime) -> None:
        self.runtime, self._dense, self._name = runtime, dense, dense_name
        dense.token_to_kv_pool = SimpleNamespace(
            get_kv_buffer=runtime.staging_layer,
            get_key_buffer=lambda layer_id: runtime.staging_layer(layer_id)[0],
            get_value_buffer=lambda layer_id: runtime.staging_layer(layer_id)[1],
            set_kv_buffer=_refuse_pool_write,
        )
        if dense_name == DENSE_BACKENDS["cpu"]:
            table = staging_token_table(runtime.kv.geometry.max_tokens, runtime.kv.device)
            dense.req_to_token_pool = SimpleNamespace(req_to_token=table)

    def init_prefill(self, forward_batch: Any) -> None:
        """The dense backend's metadata of an extend batch, reading the staging area."""
        self._dense.init_forward_metadata(forward_batch)
        if self._name == DENSE_BACKENDS["cuda"]:
            meta = self._dense.forward_metadata
            prefixes = forward_batch.extend_prefix_lens_cpu  # None when SGLang kept them on GPU
            slots = staging_slots(
                int((prefixes or forward_batch.extend_prefix_lens)[0]), meta.kv_indices
            )
            self._dense.forward_metadata = dataclasses.replace(meta, kv_indices=slots)

    def prefill(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any) -> torch.Tensor:
        """Stage one layer's chunk, then attend over the staged prompt with the dense backend."""
        stage_chunk(self.runtime, layer.layer_id, k, v, forward_batch)
        if self._name == DENSE_BACKENDS["cpu"]:  # the one row of the staging table
            forward_batch = copy.copy(forward_batch)
            forward_batch.req_pool_indices = torch.zeros_like(forward_batch.req_pool_indices)
        out: torch.Tensor = self._dense.forward_extend(
            q, k, v, layer, forward_batch, save_kv_cache=False
        )
        return out


class DoubleSparsityBackend:
    """SGLang's dense backend plus double sparsity's runtime (``offload``: DS-Offload or None).

    What else SGLang asks of an attention backend (metadata, graph state, capabilities) is the
    dense backend's.
    """

    def __init__(
        self,
        dense: Any,
        runtime: DSDecodeRuntime,
        runner: Any,
        *,
        offload: _DSOffload | None = None,
    ) -> None:
        self.dense, self.runtime, self._offload = dense, runtime, offload
        self._kv_pool = runner.token_to_kv_pool
        self._req_to_token = runner.req_to_token_pool.req_to_token

    def __getattr__(self, name: str) -> Any:
        # Only for what this class does not define: the dense backend's metadata and graph API.
        dense = self.__dict__.get("dense")
        if dense is None:
            raise AttributeError(name)
        return getattr(dense, name)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """The dense (DS-Offload: the offload's or staging area's) metadata, then the step plan."""
        self.runtime.clear_step()
        decode = forward_batch.forward_mode.is_decode()
        if self._offload is None:
            self.dense.init_forward_metadata(forward_batch)
        elif decode:
            plan_decode(self._offload.runtime, forward_batch)  # every row reads the host arena
        else:
            self._offload.init_prefill(forward_batch)
        if decode:
            lengths = _host_seq_lens(forward_batch)
            self.runtime.plan_step(lengths, self._req_to_token, forward_batch.req_pool_indices)

    def shared_read_ends(self, fm: Any) -> Any:
        """DS-Offload's reads last the whole step (:func:`offload_read_ends`); else the dense's."""
        if self._offload is not None:
            return offload_read_ends(fm)
        return self.dense.shared_read_ends(fm)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args: Any) -> None:
        """The dense backend's graph buffers, and the captured steps' mask of sparse rows."""
        self.dense.init_cuda_graph_state(max_bs, max_num_tokens, *args)
        self.runtime.init_graph_state(max_bs)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Before a capture or replay: the offload's, the runtime's and the dense backend's plan."""
        mode = forward_batch.forward_mode
        if not mode.is_decode_or_idle():
            self.runtime.clear_step()
            self.dense.init_forward_metadata_out_graph(forward_batch, in_capture)
            return
        if self._offload is not None and mode.is_decode():
            plan_decode(self._offload.runtime, forward_batch, graph=True, capture=in_capture)
        dense = self.runtime.plan_graph_step(
            forward_batch.seq_lens,
            None if in_capture else _host_seq_lens(forward_batch),
            capture=in_capture,
            padding=int(getattr(forward_batch, "num_padding", 0) or 0),
            idle=mode.is_idle(),
        )
        if dense is not None:  # the dense backend sees the rows it does not decode at length 1
            forward_batch = copy.copy(forward_batch)
            forward_batch.seq_lens = dense.seq_lens
            if getattr(forward_batch, "seq_lens_cpu", None) is not None:
                lens_cpu = torch.tensor(dense.host, dtype=forward_batch.seq_lens_cpu.dtype)
                forward_batch.seq_lens_cpu = lens_cpu
            if getattr(forward_batch, "seq_lens_sum", None) is not None:
                forward_batch.seq_lens_sum = sum(dense.host)
        self.dense.init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Inside the captured step: the dense backend's metadata, then the runtime's tables."""
        self.dense.init_forward_metadata_in_graph(forward_batch)
        self.runtime.capture_tables(self._req_to_token, forward_batch.req_pool_indices)

    def glue_draft_metadata(self) -> str:
        """Why SGLang must not capture this backend's replay prep (it counts rows on the host)."""
        return "qsa_ds counts each step's dense and sparse rows on the host"

    def glue_target_verify_metadata(self) -> str:
        """As :meth:`glue_draft_metadata`."""
        return self.glue_draft_metadata()

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """SGLang's own dispatch (``AttentionBackend.forward``): idle, decode, or extend."""
        from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

        out: torch.Tensor = AttentionBackend.forward(self, *args, **kwargs)
        return out

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
        """Dense prefill as upstream (DS-Offload: over the staged prompt), and the new labels."""
        offload, dense, batch = self._offload, self.dense, forward_batch
        if offload is None:
            attend = lambda: dense.forward_extend(q, k, v, layer, batch, save_kv_cache, **kwargs)
        else:
            attend = lambda: offload.prefill(q, k, v, layer, batch)
        return self.runtime.extend_layer(layer.layer_id, batch.out_cache_loc, k, v, attend)

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
        """The layer as the runtime's planned step asks (``DSDecodeRuntime.decode_layer``)."""
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        pool, layer_id = self._kv_pool, layer.layer_id

        def write_kv() -> None:
            if save_kv_cache:
                loc = KVWriteLoc.for_batch(forward_batch)
                pool.set_kv_buffer(layer, loc, k, v, layer.k_scale, layer.v_scale)

        engine = DenseLayer(
            attend=lambda: self.dense.forward_decode(
                q, k, v, layer, forward_batch, save_kv_cache, **kwargs
            ),
            write_kv=write_kv,
            buffers=lambda: (pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)),
        )
        queries = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        loc, lens = forward_batch.out_cache_loc, forward_batch.seq_lens
        return self.runtime.decode_layer(layer_id, queries, k, v, loc, lens, layer.scaling, engine)


def _refuse_pool_write(*args: Any, **kwargs: Any) -> None:
    del args, kwargs
    msg = "DS-Offload stages a prefill chunk through the offload runtime, not the K/V pool"
    raise AdapterError(msg)


def _host_seq_lens(forward_batch: Any) -> list[int]:
    """The batch's sequence lengths on the host (SGLang's copy when it made one)."""
    lengths = getattr(forward_batch, "seq_lens_cpu", None)
    return [int(n) for n in (forward_batch.seq_lens.cpu() if lengths is None else lengths)]
