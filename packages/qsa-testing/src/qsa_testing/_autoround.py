"""A complete tiny Qwen4Exp checkpoint in AutoRound's W4A16 GPTQ packing, and its bf16 twin.

The format is AutoRound's export with ``packing_format="auto_round:auto_gptq"`` (GPTQ v1
packing), as SGLang 0.5.23 reads it (``srt/layers/quantization/auto_round.py``, which hands the
layers to ``gptq/gptq.py``'s Marlin or ExLlama methods and to ``moe_wna16.py``): every quantized
linear ``<prefix>`` of the bf16 checkpoint is stored as

- ``<prefix>.qweight``: int32 ``[in / 8, out]``, eight 4-bit values per word along the input,
  value ``j`` of a word in bits ``4 j .. 4 j + 3``;
- ``<prefix>.scales``: fp16 ``[in / G, out]``, one scale per group of ``G`` inputs and output;
- ``<prefix>.qzeros``: int32 ``[in / G, out / 8]``, packed along the output, GPTQ v1's zero minus
  one: symmetric 4-bit has zero 8, so every word is ``0x77777777``;
- ``<prefix>.g_idx``: int32 ``[in]``, input ``i`` in group ``i // G``;

and the weight is ``w[o, i] = (q[i, o] - 8) * scales[i // G, o]``. ``config.json`` carries the
``quantization_config`` an AutoRound export writes (:func:`autoround_quantization_config`).
What SGLang keeps unquantized stays bf16 ``.weight``: the routers (``mlp.gate``,
``mlp.shared_expert_gate``: ``ReplicatedLinear(quant_config=None)``), embeddings, ``lm_head``,
norms, the GDN ``conv1d``/``A_log``/``dt_bias``, the hyper-connection weights, the PLE table and
the vision tower (built without a quantization config).

The dequantized twin holds the same model as plain bf16 ``.weight`` tensors computed from the very
same 4-bit values, without a ``quantization_config``. Scales are powers of two, so
``(q - 8) * scale`` is exact in fp16, bf16 and fp32 alike: the two checkpoints describe one
model, and an engine serving each differs only in its kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import save_file

from qsa_kernels.int8_rows import checkpoint_shard_rows
from qsa_testing._checkpoints import ple_table_shape
from qsa_testing._errors import ModelSpecError
from qsa_testing._models import TinyModel, TinyModelKind, _frozen, _plain

__all__ = (
    "AUTOROUND_BITS",
    "AUTOROUND_GROUP_SIZE",
    "SYMMETRIC_QZEROS_WORD",
    "AutoRoundCheckpoints",
    "autoround_quantization_config",
    "dequantize_int4",
    "pack_int4_columns",
    "pack_int4_rows",
    "quantize_int4",
    "qwen4_exp_weights",
    "unpack_int4_columns",
    "unpack_int4_rows",
    "write_autoround_checkpoints",
)

#: Bits per quantized weight.
AUTOROUND_BITS: Final = 4
#: Inputs per scale: the production export's group size, and a size Marlin takes.
AUTOROUND_GROUP_SIZE: Final = 128
#: 4-bit values per int32 word.
_PER_WORD: Final = 32 // AUTOROUND_BITS
#: The stored value of weight zero (unsigned 4-bit, symmetric: ``q - 8``).
_ZERO: Final = 1 << (AUTOROUND_BITS - 1)
#: A ``qzeros`` word of a symmetric layer: eight zeros of 8, each stored minus one (GPTQ v1).
SYMMETRIC_QZEROS_WORD: Final = 0x77777777
_MASK: Final = (1 << AUTOROUND_BITS) - 1
#: The smallest scale written (fp16's smallest normal): an all-zero group keeps a finite scale.
_MIN_SCALE_EXPONENT: Final = -14
_WEIGHTS_FILE: Final = "model.safetensors"
#: The range of the seeded random weights: the harness's dummy-weight range (U(-0.2, 0.2)), so
#: logprobs vary per step and per prompt as in every other engine test.
_WEIGHT_RANGE: Final = 0.2

#: Suffixes of the checkpoint's linears that SGLang builds with the quantization config, in
#: Qwen4Exp's text layers (``model.language_model.layers.<l>.``).
_QUANTIZED: Final = (
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    "linear_attn.out_proj",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.indexer.index_qk_proj",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "ple.key_proj",
    "ple.value_proj",
)
_EXPERT_PROJECTIONS: Final = ("gate_proj", "up_proj", "down_proj")


def autoround_quantization_config(group_size: int = AUTOROUND_GROUP_SIZE) -> dict[str, Any]:
    """The ``quantization_config`` of an AutoRound W4A16 export in the GPTQ packing."""
    return {
        "quant_method": "auto-round",
        "packing_format": "auto_round:auto_gptq",
        "bits": AUTOROUND_BITS,
        "group_size": group_size,
        "sym": True,
        "data_type": "int",
    }


def is_quantized(name: str) -> bool:
    """Whether the checkpoint tensor ``<prefix>.weight`` named ``name`` is an AutoRound linear."""
    prefix = name.removesuffix(".weight")
    if prefix == name or not prefix.startswith("model.language_model.layers."):
        return False
    if ".mlp.experts." in prefix:
        return prefix.rsplit(".", 1)[-1] in _EXPERT_PROJECTIONS
    return prefix.endswith(_QUANTIZED)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit values per group of inputs and output column, with power-of-two scales.

    Args:
        weight: ``[out, in]`` float (a checkpoint's ``.weight``), ``in`` a multiple of
            ``group_size``.
        group_size: inputs per scale.

    Returns:
        ``q`` int32 ``[in, out]`` in ``[0, 15]`` (stored values: the weight is ``q - 8`` steps),
        and ``scales`` fp16 ``[in / group_size, out]``: the smallest power of two at least
        ``max|w| / 7`` of the group (at least ``2**-14``).

    Raises:
        ModelSpecError: ``weight`` not 2-D, or ``in`` not a multiple of ``group_size``.
    """
    if weight.dim() != 2 or weight.shape[1] % group_size:
        shape = tuple(weight.shape)
        msg = f"weight of shape {shape!r}: need [out, in], in a multiple of {group_size}"
        raise ModelSpecError(msg)
    columns = weight.float().t()  # [in, out]
    groups = columns.reshape(-1, group_size, columns.shape[1])  # [in / G, G, out]
    largest = groups.abs().amax(dim=1)  # [in / G, out]
    exponent = torch.ceil(torch.log2(largest / (_ZERO - 1))).clamp(min=_MIN_SCALE_EXPONENT)
    scales = torch.exp2(exponent)
    steps = torch.round(groups / scales[:, None, :]).clamp(-_ZERO, _ZERO - 1)
    q = (steps + _ZERO).to(torch.int32).reshape(columns.shape)
    return q, scales.to(torch.float16)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight ``[out, in]`` bf16 of ``q`` int ``[in, out]`` and ``scales`` ``[in / G, out]``."""
    group_size = q.shape[0] // scales.shape[0]
    expanded = scales.float().repeat_interleave(group_size, dim=0)  # [in, out]
    return ((q.float() - _ZERO) * expanded).t().contiguous().to(torch.bfloat16)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[in, out]`` of 4-bit values as int32 ``[in / 8, out]`` (GPTQ's ``qweight``).

    Value ``j`` of word ``w`` comes from row ``8 w + j`` and sits in bits ``4 j .. 4 j + 3``.
    """
    rows = q.to(torch.int64).reshape(-1, _PER_WORD, q.shape[1])
    return _words(rows, dim=1)


def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4_rows`: int32 ``[in / 8, out]`` to int32 ``[in, out]``."""
    shifts = torch.arange(0, 32, AUTOROUND_BITS, dtype=torch.int64)
    values = (qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & _MASK
    return values.reshape(-1, qweight.shape[1]).to(torch.int32)


def pack_int4_columns(z: torch.Tensor) -> torch.Tensor:
    """``z`` ``[g, out]`` of 4-bit values as int32 ``[g, out / 8]`` (GPTQ's ``qzeros``).

    Packed along the output: value ``j`` of word ``w`` is column ``8 w + j``, in bits ``4 j ..``.
    """
    columns = z.to(torch.int64).reshape(z.shape[0], -1, _PER_WORD)
    return _words(columns, dim=2)


def unpack_int4_columns(qzeros: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4_columns`: int32 ``[g, out / 8]`` to int32 ``[g, out]``."""
    shifts = torch.arange(0, 32, AUTOROUND_BITS, dtype=torch.int64)
    values = (qzeros.to(torch.int64)[:, :, None] >> shifts[None, None, :]) & _MASK
    return values.reshape(qzeros.shape[0], -1).to(torch.int32)


def _words(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values along ``dim`` (of size 8) in one word, as int32 (two's complement)."""
    shape = [1] * values.dim()
    shape[dim] = _PER_WORD
    shifts = torch.arange(0, 32, AUTOROUND_BITS, dtype=torch.int64).reshape(shape)
    word = (values << shifts).sum(dim=dim)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


@dataclass(frozen=True, slots=True)
class AutoRoundCheckpoints:
    """The two checkpoints :func:`write_autoround_checkpoints` wrote.

    Attributes:
        autoround_model: the model whose ``config.json`` carries the ``quantization_config``.
        autoround: its directory (``<directory>/<autoround_model.name>``).
        dequantized_model: the same model without it (the model given).
        dequantized: its directory (``<directory>/<dequantized_model.name>``).
        quantized: the bf16 checkpoint's tensor names stored quantized in the export (``.weight``
            names; the export has ``.qweight``, ``.scales``, ``.qzeros``, ``.g_idx`` instead).
        group_size: inputs per scale.
    """

    autoround_model: TinyModel
    autoround: Path
    dequantized_model: TinyModel
    dequantized: Path
    quantized: tuple[str, ...]
    group_size: int


def qwen4_exp_weights(model: TinyModel, *, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of a complete bf16 checkpoint of ``model``, seeded U(-0.2, 0.2) values.

    Names and shapes as Qwen4Exp checkpoints store them and SGLang 0.5.23's
    ``Qwen4ExpForConditionalGeneration.load_weights`` reads them: the text model under
    ``model.language_model.`` (attention under ``self_attn.``; GDN's ``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` apart; routed experts one by one), the vision
    tower under ``model.visual.`` and the PLE n-gram table as its row shards.

    Raises:
        ModelSpecError: ``model`` is not a Qwen4Exp.
    """
    if model.kind is not TinyModelKind.QWEN4_EXP:
        msg = f"model {model.name!r} ({model.kind.value}) is not a Qwen4Exp"
        raise ModelSpecError(msg)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _shapes(model):
        values = torch.rand(shape, generator=generator, dtype=torch.float32)
        tensors[name] = ((values * 2 - 1) * _WEIGHT_RANGE).to(torch.bfloat16)
    return tensors


def _shapes(model: TinyModel) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of ``model``'s checkpoint."""
    text, vision = model.text_config, model.config["vision_config"]
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    hc_hidden = int(text["hc_count"]) * hidden
    lowrank = int(text["hc_lowrank"])
    root = "model.language_model"
    yield f"{root}.embed_tokens.weight", (vocab, hidden)
    yield "lm_head.weight", (vocab, hidden)
    yield f"{root}.hyper_connection_mixer.hc_norm.weight", (hc_hidden,)
    yield f"{root}.hyper_connection_mixer.input_mix_weight_down.weight", (lowrank, hc_hidden)
    yield f"{root}.hyper_connection_mixer.input_mix_weight_up.weight", (hc_hidden, lowrank)
    ple_layers = {int(i) - 1 for i in text.get("ple_layer_ids") or ()}
    for layer, kind in enumerate(text["layer_types"]):
        prefix = f"{root}.layers.{layer}"
        if kind == "linear_attention":
            yield from _gdn_shapes(f"{prefix}.linear_attn", text)
        else:
            yield from _attention_shapes(f"{prefix}.self_attn", text)
        yield from _moe_shapes(f"{prefix}.mlp", text)
        for side in ("attn", "mlp"):
            mix = f"{prefix}.{side}_hyper_connection"
            yield f"{mix}.hc_norm.weight", (hc_hidden,)
            yield f"{mix}.input_mix_weight_down.weight", (lowrank, hc_hidden)
            yield f"{mix}.input_mix_weight_up.weight", (hc_hidden, lowrank)
            yield f"{mix}.block_inject_weight.weight", (int(text["hc_count"]), hc_hidden)
        if layer in ple_layers:
            yield from _ple_shapes(f"{prefix}.ple", model)
    yield from _vision_shapes("model.visual", vision)


def _gdn_shapes(prefix: str, text: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    hidden = int(text["hidden_size"])
    value_heads = int(text["linear_num_value_heads"])
    key_dim = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
    value_dim = value_heads * int(text["linear_value_head_dim"])
    yield f"{prefix}.in_proj_qkv.weight", (2 * key_dim + value_dim, hidden)
    yield f"{prefix}.in_proj_z.weight", (value_dim, hidden)
    yield f"{prefix}.in_proj_b.weight", (value_heads, hidden)
    yield f"{prefix}.in_proj_a.weight", (value_heads, hidden)
    yield (
        f"{prefix}.conv1d.weight",
        (2 * key_dim + value_dim, 1, int(text["linear_conv_kernel_dim"])),
    )
    yield f"{prefix}.A_log", (value_heads,)
    yield f"{prefix}.dt_bias", (value_heads,)
    yield f"{prefix}.norm.weight", (int(text["linear_value_head_dim"]),)
    yield f"{prefix}.out_proj.weight", (hidden, value_dim)


def _attention_shapes(
    prefix: str, text: Mapping[str, Any]
) -> Iterator[tuple[str, tuple[int, ...]]]:
    hidden, head_dim = int(text["hidden_size"]), int(text["head_dim"])
    queries = int(text["num_attention_heads"]) * head_dim
    keys = int(text["num_key_value_heads"]) * head_dim
    gate = 2 if text.get("attn_output_gate") else 1
    yield f"{prefix}.q_proj.weight", (gate * queries, hidden)
    yield f"{prefix}.k_proj.weight", (keys, hidden)
    yield f"{prefix}.v_proj.weight", (keys, hidden)
    yield f"{prefix}.o_proj.weight", (hidden, queries)
    yield f"{prefix}.q_norm.weight", (head_dim,)
    yield f"{prefix}.k_norm.weight", (head_dim,)
    index_dim = int(text["indexer_head_dim"])
    index_heads = int(text["indexer_n_heads"]) + int(text["indexer_kv_heads"])
    yield f"{prefix}.indexer.index_qk_proj.weight", (index_heads * index_dim, hidden)
    yield f"{prefix}.indexer.q_layernorm.weight", (index_dim,)
    yield f"{prefix}.indexer.k_layernorm.weight", (index_dim,)


def _moe_shapes(prefix: str, text: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    hidden, experts = int(text["hidden_size"]), int(text["num_experts"])
    routed, shared = (
        int(text["moe_intermediate_size"]),
        int(text["shared_expert_intermediate_size"]),
    )
    yield f"{prefix}.gate.weight", (experts, hidden)
    for expert in range(experts):
        yield f"{prefix}.experts.{expert}.gate_proj.weight", (routed, hidden)
        yield f"{prefix}.experts.{expert}.up_proj.weight", (routed, hidden)
        yield f"{prefix}.experts.{expert}.down_proj.weight", (hidden, routed)
    yield f"{prefix}.shared_expert.gate_proj.weight", (shared, hidden)
    yield f"{prefix}.shared_expert.up_proj.weight", (shared, hidden)
    yield f"{prefix}.shared_expert.down_proj.weight", (hidden, shared)
    yield f"{prefix}.shared_expert_gate.weight", (1, hidden)


def _ple_shapes(prefix: str, model: TinyModel) -> Iterator[tuple[str, tuple[int, ...]]]:
    text = model.text_config
    hidden = int(text["hidden_size"])
    hc_hidden = int(text["hc_count"]) * hidden
    embed = int(text.get("ple_embed_dim") or hidden)
    yield f"{prefix}.key_proj.weight", (hc_hidden, embed)
    yield f"{prefix}.value_proj.weight", (hidden, embed)
    for norm in ("norm_key", "norm_query", "norm_conv"):
        yield f"{prefix}.{norm}.weight", (hc_hidden,)
    yield f"{prefix}.conv1d.weight", (hc_hidden, 1, int(text.get("ple_conv_kernel_size", 4)))
    table = ple_table_shape(model)
    if not table.prefix.startswith(prefix):
        msg = f"{model.name!r}: PLE table {table.prefix!r} is not under {prefix!r}"
        raise ModelSpecError(msg)
    size = checkpoint_shard_rows(table.rows, table.parts)
    for shard, first in enumerate(range(0, table.rows, size)):
        rows = min(size, table.rows - first)
        yield f"{table.prefix}.shard_{shard}.weight", (rows, table.dim)


def _vision_shapes(prefix: str, vision: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    width, inner = int(vision["hidden_size"]), int(vision["intermediate_size"])
    patch, temporal = int(vision["patch_size"]), int(vision["temporal_patch_size"])
    merged = width * int(vision["spatial_merge_size"]) ** 2
    yield (
        f"{prefix}.patch_embed.proj.weight",
        (width, int(vision["in_channels"]), temporal, patch, patch),
    )
    yield f"{prefix}.patch_embed.proj.bias", (width,)
    yield f"{prefix}.pos_embed.weight", (int(vision["num_position_embeddings"]), width)
    for block in range(int(vision["depth"])):
        at = f"{prefix}.blocks.{block}"
        for norm in ("norm1", "norm2"):
            yield f"{at}.{norm}.weight", (width,)
            yield f"{at}.{norm}.bias", (width,)
        yield f"{at}.attn.qkv.weight", (3 * width, width)
        yield f"{at}.attn.qkv.bias", (3 * width,)
        yield f"{at}.attn.proj.weight", (width, width)
        yield f"{at}.attn.proj.bias", (width,)
        yield f"{at}.mlp.linear_fc1.weight", (inner, width)
        yield f"{at}.mlp.linear_fc1.bias", (inner,)
        yield f"{at}.mlp.linear_fc2.weight", (width, inner)
        yield f"{at}.mlp.linear_fc2.bias", (width,)
    yield f"{prefix}.merger.norm.weight", (width,)
    yield f"{prefix}.merger.norm.bias", (width,)
    yield f"{prefix}.merger.linear_fc1.weight", (merged, merged)
    yield f"{prefix}.merger.linear_fc1.bias", (merged,)
    out = int(vision["out_hidden_size"])
    yield f"{prefix}.merger.linear_fc2.weight", (out, merged)
    yield f"{prefix}.merger.linear_fc2.bias", (out,)


def write_autoround_checkpoints(
    directory: Path,
    model: TinyModel,
    *,
    seed: int = 0,
    group_size: int = AUTOROUND_GROUP_SIZE,
) -> AutoRoundCheckpoints:
    """Write ``model`` (seeded weights) as an AutoRound W4A16 export and dequantized to bf16.

    Every linear SGLang quantizes (:func:`is_quantized`) is quantized symmetric 4-bit per group of
    ``group_size`` inputs and output column (:func:`quantize_int4`); the export holds its packed
    ``qweight``/``scales``/``qzeros``/``g_idx``, the twin its ``(q - 8) * scale`` in bf16; every
    other tensor is the same bf16 tensor in both.

    Args:
        directory: created if absent; the checkpoints go to ``<directory>/<name>/``.
        model: a Qwen4Exp without a ``quantization_config`` (:func:`qsa_testing.marlin_qwen4_exp`
            has every quantized linear within Marlin's shape limits).
        seed: the weights' seed (:func:`qwen4_exp_weights`).
        group_size: inputs per scale.

    Raises:
        ModelSpecError: ``model`` carries a ``quantization_config`` already, or a quantized
            linear's input is not a multiple of ``group_size`` or its output of 8.
    """
    if "quantization_config" in model.config:
        msg = f"model {model.name!r} has a quantization_config already; give its bf16 form"
        raise ModelSpecError(msg)
    config = _plain(model.config)
    config["quantization_config"] = autoround_quantization_config(group_size)
    exported = dataclasses.replace(
        model, name=f"{model.name}-autoround-w4g{group_size}", config=_frozen(config)
    )
    bf16: dict[str, torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    for name, weight in qwen4_exp_weights(model, seed=seed).items():
        if not is_quantized(name):
            bf16[name] = packed[name] = weight
            continue
        out_features, in_features = weight.shape
        if out_features % _PER_WORD:
            msg = f"{name}: output {out_features} is not a multiple of {_PER_WORD}"
            raise ModelSpecError(msg)
        q, scales = quantize_int4(weight, group_size)
        prefix = name.removesuffix(".weight")
        quantized.append(name)
        groups = in_features // group_size
        packed[f"{prefix}.qweight"] = pack_int4_rows(q)
        packed[f"{prefix}.scales"] = scales
        packed[f"{prefix}.qzeros"] = pack_int4_columns(
            torch.full((groups, out_features), _ZERO - 1, dtype=torch.int32)
        )
        packed[f"{prefix}.g_idx"] = torch.arange(in_features, dtype=torch.int32) // group_size
        bf16[name] = dequantize_int4(q, scales)
    autoround_dir = exported.write(directory)
    save_file(packed, str(autoround_dir / _WEIGHTS_FILE))
    dequantized_dir = model.write(directory)
    save_file(bf16, str(dequantized_dir / _WEIGHTS_FILE))
    return AutoRoundCheckpoints(
        autoround_model=exported,
        autoround=autoround_dir,
        dequantized_model=model,
        dequantized=dequantized_dir,
        quantized=tuple(quantized),
        group_size=group_size,
    )
