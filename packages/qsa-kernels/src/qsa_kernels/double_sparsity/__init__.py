"""Double sparsity for attention layers without an indexer, resident and host-offloaded.

Double Sparsity (arXiv 2408.07092; the original SGLang ``--enable-double-sparsity`` options) keeps
``C`` calibrated heavy channels of every key in a small label cache, scores every context token
with ``q[channels] · k_label``, keeps the ``heavy_token_num`` best tokens per (request, KV head)
and attends exactly over those. This subpackage holds:

* the options (:class:`DSConfig`), a GQA model's attention geometry read from its text config
  (:class:`AttentionGeometry`), the calibration pass that writes a channel file
  (:func:`calibrate_channels`) and its loader (:class:`ChannelConfig`);
* the label cache (:class:`LabelCache`), preallocated per request row, and what its labels (and
  DS-Offload's buffers) add to a token's price on one rank (:func:`label_capacity`; from a
  model's text config and channel file: :func:`model_label_capacity`);
* one layer's decode over a resident K/V store (:func:`ds_decode`, reference beside it), built on
  :func:`qsa_kernels.sparse_decode.sparse_decode` with one token list per KV head, and over
  SGLang's split K and V buffers (:func:`ds_decode_split`, on
  :func:`qsa_kernels.sparse_decode.sparse_decode_split`; reference beside it), and its
  CUDA-graph form with the lengths on the device (:func:`ds_heavy_decode_split`; the token
  choice alone: :func:`ds_positions_fixed`);
* DS-Offload (:class:`DSOffloadedKV`): the K/V history in the host arena, the label cache on the
  device, the selected tokens' blocks fetched into the hot cache;
* the decode runtime of an engine's attention backend (:class:`DSDecodeRuntime`): each step's
  dense and sparse rows, the eager, captured and offloaded decode of each layer over the engine's
  token slots, label writes, which engine call each step's layers take (:class:`DenseLayer`),
  DS-Offload's prefill over the staging area (:func:`staging_token_table`), and the counts
  (:class:`DSCounts`).
"""

from qsa_kernels.double_sparsity._attention import AttentionGeometry
from qsa_kernels.double_sparsity._calibrate import calibrate_channels
from qsa_kernels.double_sparsity._capacity import label_capacity, model_label_capacity
from qsa_kernels.double_sparsity._config import (
    CHANNEL_CONFIG_MAX_BYTES,
    ChannelConfig,
    DSConfig,
    HeavyChannelType,
    layer_key,
    reduce_group_channels,
)
from qsa_kernels.double_sparsity._decode import (
    DSDecodeOutput,
    ds_decode,
    ds_decode_reference,
    ds_decode_split,
    ds_decode_split_reference,
    ds_heavy_decode_split,
    ds_heavy_decode_split_reference,
    ds_positions,
    ds_positions_fixed,
)
from qsa_kernels.double_sparsity._errors import ChannelConfigError, DSConfigError, DSStateError
from qsa_kernels.double_sparsity._label_cache import LabelCache
from qsa_kernels.double_sparsity._offload import DSOffloadedKV
from qsa_kernels.double_sparsity._runtime import (
    DecodePath,
    DenseLayer,
    DenseLengths,
    DSCounts,
    DSDecodeRuntime,
    StepKind,
    StepMode,
    staging_slots,
    staging_token_table,
)

__all__ = (  # noqa: RUF022 (grouped by comment, sorted within each group)
    # -- Errors --
    "ChannelConfigError",
    "DSConfigError",
    "DSStateError",
    # -- Options and calibration --
    "CHANNEL_CONFIG_MAX_BYTES",
    "AttentionGeometry",
    "ChannelConfig",
    "DSConfig",
    "HeavyChannelType",
    "calibrate_channels",
    "layer_key",
    "reduce_group_channels",
    # -- Label cache and decode --
    "DSDecodeOutput",
    "LabelCache",
    "ds_decode",
    "ds_decode_reference",
    "ds_decode_split",
    "ds_decode_split_reference",
    "ds_heavy_decode_split",
    "ds_heavy_decode_split_reference",
    "ds_positions",
    "ds_positions_fixed",
    "label_capacity",
    "model_label_capacity",
    # -- Offload --
    "DSOffloadedKV",
    # -- Decode runtime --
    "DSCounts",
    "DSDecodeRuntime",
    "DecodePath",
    "DenseLayer",
    "DenseLengths",
    "StepKind",
    "StepMode",
    "staging_slots",
    "staging_token_table",
)
