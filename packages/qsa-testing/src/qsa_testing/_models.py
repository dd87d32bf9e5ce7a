"""Tiny dummy checkpoints, written at test time: a ``config.json`` and nothing else.

SGLang builds random weights for them with ``load_format="dummy"``, so no checkpoint is needed.
The QSA rules of the tiny Qwen4Exp (indexer heads and head dim, budget, compress ratio, page size)
are those of Qwen3.8-Flash-Next, taken from :data:`qsa_core.QWEN38_FLASH_NEXT`, so the indexer's
selection is really sparse above ``budget + compress_ratio - 1`` tokens (2,051); only widths and
depths shrink.
"""

from __future__ import annotations

import enum
import json
import random
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from qsa_core import QWEN38_FLASH_NEXT, QWEN38_FLASH_NEXT_TEXT_CONFIG, QSAProfile
from qsa_testing._errors import ModelSpecError
from qsa_testing._vision import merged_patch_pixels, processor_files

__all__ = (
    "FIRST_PROMPT_TOKEN",
    "TinyModel",
    "TinyModelKind",
    "full_depth_qwen4_exp",
    "marlin_qwen4_exp",
    "tiny_llama",
    "tiny_qwen4_exp",
)

#: Token ids below this are special (pad 0, bos 1, eos 2); prompts never contain them.
FIRST_PROMPT_TOKEN: Final = 3
_VOCAB: Final = 512
#: Ids of the vision special tokens; prompts stay below them.
_IMAGE_TOKEN: Final = 500


class TinyModelKind(enum.StrEnum):
    """The architecture a tiny model instantiates."""

    QWEN4_EXP = "Qwen4ExpForConditionalGeneration"
    LLAMA = "LlamaForCausalLM"


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A tiny model: a name for logs and paths, and its ``config.json``.

    Two models are equal when their names and kinds are (a name is unique per variant).

    Attributes:
        name: a short identifier, unique per variant (used as the directory name).
        kind: the architecture.
        config: the full ``config.json`` content (read-only).
        vision: the model takes images: :meth:`write` adds its tokenizer and processor files, and
            engines load them (``skip_tokenizer_init=False``, ``enable_multimodal=True``).
    """

    name: str
    kind: TinyModelKind
    config: Mapping[str, Any] = field(compare=False)
    vision: bool = field(default=False, compare=False)

    @property
    def text_config(self) -> Mapping[str, Any]:
        """The language model's config (``text_config`` for Qwen4Exp, the top level otherwise)."""
        inner = self.config.get("text_config")
        return inner if isinstance(inner, Mapping) else self.config

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the language model."""
        return int(self.text_config["vocab_size"])

    @property
    def prompt_token_limit(self) -> int:
        """One past the largest token id a prompt uses (specials and vision tokens excluded)."""
        return _IMAGE_TOKEN if self.kind is TinyModelKind.QWEN4_EXP else self.vocab_size

    @property
    def image_placeholder(self) -> tuple[int, int, int]:
        """The ids a prompt holds where one image goes: vision start, image pad, vision end.

        The engine's processor expands the pad into one id per merged patch of the image.
        """
        if not self.vision:
            msg = f"model {self.name!r} takes no images"
            raise ModelSpecError(msg)
        fields = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
        start, pad, end = (int(self.config[f]) for f in fields)
        return start, pad, end

    def image_tokens(self, width: int, height: int) -> int:
        """Image tokens a ``width`` × ``height`` picture becomes in a prompt.

        Raises:
            ModelSpecError: the model takes no images, or a side is not a whole number of
                merged patches.
        """
        _ = self.image_placeholder  # refuses a model without images
        unit = merged_patch_pixels(self.config)
        if width % unit or height % unit:
            msg = (
                f"a {width} x {height} image is not allowed for {self.name!r}; allowed: sides "
                f"that are multiples of {unit} pixels (one merged patch)"
            )
            raise ModelSpecError(msg)
        return (width // unit) * (height // unit)

    def qsa_profile(self) -> QSAProfile:
        """The QSA geometry SGLang will see (raises for a model without QSA layers)."""
        if self.kind is not TinyModelKind.QWEN4_EXP:
            msg = f"model {self.name!r} ({self.kind.value}) has no QSA layers"
            raise ModelSpecError(msg)
        return QSAProfile.from_text_config(self.text_config)

    def prompt(self, length: int, *, seed: int) -> tuple[int, ...]:
        """``length`` token ids drawn with a fixed seed from the model's ordinary tokens."""
        if length < 1:
            msg = f"length={length!r} is not allowed; it must be a positive integer"
            raise ModelSpecError(msg)
        rng = random.Random(seed)
        return tuple(
            rng.randrange(FIRST_PROMPT_TOKEN, self.prompt_token_limit) for _ in range(length)
        )

    def write(self, directory: Path) -> Path:
        """Write the model's files under ``<directory>/<name>/`` (idempotent); return that path.

        ``config.json``, and for a model that takes images its tokenizer and processor files.
        """
        path = directory / self.name
        path.mkdir(parents=True, exist_ok=True)
        files = {"config.json": json.dumps(_plain(self.config), indent=1, sort_keys=True)}
        if self.vision:
            files.update(processor_files(self.config))
        for name, text in files.items():
            target = path / name
            if not target.exists() or target.read_text(encoding="utf-8") != text:
                target.write_text(text, encoding="utf-8")
        return path


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _frozen(value: dict[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(
        {k: _frozen(v) if isinstance(v, dict) else v for k, v in value.items()}
    )


def _mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """Three M-RoPE sections (temporal, height, width) that add up to half the rotary dims."""
    half = int(head_dim * partial_rotary_factor) // 2
    third = (half + 1) // 3
    return [half - 2 * third, third, third]


#: One PLE layer on the second layer, a GDN layer, as Qwen3.8-Flash-Next's ``ple_layer_ids=[2]``
#: (one-indexed), with a small n-gram table (its heads' primes follow 1,000 instead of
#: 20,000,000). Its short-conv window and n-gram history live in the request's Mamba slot, so
#: every engine test of a tiny Qwen4Exp carries them through offload, checkpoints and restores.
_TINY_PLE: Final = {"ple_layer_ids": [2], "ngram_vocab_size_base": 1000}


def tiny_qwen4_exp(
    *,
    kv_heads: int = 2,
    model_shaped: bool = False,
    qsa_layers: int = 1,
    max_position_embeddings: int = 8192,
    vision: bool = False,
) -> TinyModel:
    """A Qwen4Exp whose every fourth layer is a QSA layer (by default 3 GDN layers, 1 QSA layer).

    Its second layer carries a PLE layer (:data:`_TINY_PLE`), as the real model's does.

    Args:
        kv_heads: K/V heads of the QSA layer, 2 (Qwen3.8-Flash-Next) or 1 (one TP2 rank's share).
        model_shaped: the real attention geometry of a QSA layer (24 query heads, head dim 256)
            instead of 4 query heads of dim 64; the width of the rest stays small.
        qsa_layers: QSA layers, each after 3 GDN layers (12, with 36 GDN layers, is
            Qwen3.8-Flash-Next's depth with the GDN and expert layers kept tiny: a decode step
            pays what the real model's attention layers pay and little else).
        max_position_embeddings: the longest context the config allows (262,144 for checks of
            the real model's capacity plan; engines here use 4,096).
        vision: engines take images for it (its tokenizer and processor are written too; the
            weights are the same either way: the config always has its vision tower).

    Raises:
        ModelSpecError: ``kv_heads`` is not 1 or 2, or ``qsa_layers`` is not 1 to 12.
    """
    if kv_heads not in (1, 2):
        msg = f"kv_heads={kv_heads!r} is not supported; allowed: 1, 2"
        raise ModelSpecError(msg)
    real = QWEN38_FLASH_NEXT
    if type(qsa_layers) is not int or not 1 <= qsa_layers <= real.num_qsa_layers:
        msg = f"qsa_layers={qsa_layers!r} is not supported; allowed: 1 to {real.num_qsa_layers}"
        raise ModelSpecError(msg)
    q_heads, head_dim = (real.num_attention_heads, real.head_dim) if model_shaped else (4, 64)
    shape = "shaped" if model_shaped else "small"
    name = f"qwen4exp-{shape}-kv{kv_heads}"
    if qsa_layers != 1:
        name += f"-qsa{qsa_layers}"
    if max_position_embeddings != 8192:
        name += f"-ctx{max_position_embeddings}"
    if vision:
        name += "-vl"
    config = _qwen4_exp_config(
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        widths={"num_hidden_layers": 4 * qsa_layers, **_TINY_PLE},
    )
    return TinyModel(name, TinyModelKind.QWEN4_EXP, _frozen(config), vision=vision)


#: Marlin's shape limits in SGLang 0.5.23 (``marlin_utils.py``): a GPTQ linear's output per
#: TP rank a multiple of ``GPTQ_MARLIN_MIN_THREAD_N`` and its input of ``GPTQ_MARLIN_MIN_THREAD_K``;
#: a routed expert layer (``check_moe_marlin_supports_layer``) gate-up ``n = 2 I`` a multiple of
#: 128 and ``k = H`` of 64, down ``n = H`` of 128 and ``k = I`` of 64.
MARLIN_MIN_N: Final = 64
MARLIN_MIN_K: Final = 128

#: Widths of :func:`marlin_qwen4_exp`: hidden 256; experts and shared expert 128 wide (gate-up
#: ``n = 256``, down ``k = 128``); GDN 16 key and 32 value heads of dim 16 (``in_proj_qkvz``
#: ``n = 1,536``, ``in_proj_ba`` ``n = 2 * 32 = 64``, ``out_proj`` ``k = 512``); attention 4
#: query heads with their output gate and 2 K/V heads of dim 64 (``qkv_proj`` ``n = 768``,
#: ``o_proj`` ``k = 256``); the indexer's ``index_qk_proj`` ``n = 5 * 128``; PLE ``key_proj``
#: ``n = 512`` and ``value_proj`` ``n = 256`` over ``k = 256``.
_MARLIN_WIDTHS: Final = {
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}


def marlin_qwen4_exp() -> TinyModel:
    """The tiny Qwen4Exp (3 GDN + 1 QSA layer, its PLE layer) widened to Marlin's shape limits.

    Every linear SGLang 0.5.23 quantizes under an AutoRound W4A16 config (GDN
    ``in_proj_qkvz``/``in_proj_ba``/``out_proj``, attention ``qkv_proj``/``o_proj``, the QSA
    indexer's ``index_qk_proj``, the shared expert, the routed experts, PLE
    ``key_proj``/``value_proj``) has an input that is a multiple of 128 (:data:`MARLIN_MIN_K`, and
    of the 128-input group) and an output that is a multiple of 64 (:data:`MARLIN_MIN_N`; 128 for
    the experts' gate-up and down), at TP1, so its engines take ``GPTQMarlinLinearMethod`` and
    ``GPTQMarlinMoEMethod`` rather than the fallbacks (:data:`_MARLIN_WIDTHS`). The tiny model's
    64-wide layers are not. For :func:`qsa_testing.write_autoround_checkpoints`.
    """
    config = _qwen4_exp_config(
        q_heads=4,
        kv_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        widths={**_MARLIN_WIDTHS, **_TINY_PLE},
    )
    return TinyModel("qwen4exp-marlin", TinyModelKind.QWEN4_EXP, _frozen(config))


def full_depth_qwen4_exp(
    *, max_position_embeddings: int = 262_144, vision: bool = False
) -> TinyModel:
    """Qwen3.8-Flash-Next's depth and the real width of its attention and GDN layers.

    48 layers of hidden size 2,560, every fourth a QSA layer (12): the QSA layers of the real
    geometry (24 query heads and 2 K/V heads of dim 256, the real indexer), the Gated DeltaNet
    layers of the real widths (16 key and 48 value heads of dim 128). The experts (4 of 512), the
    vocabulary and the vision tower stay small, so a prefill costs what the real model's attention
    and GDN layers cost and less than its experts: a cold prefill timed on it is a lower bound on
    the real model's. About 3.6 B dummy parameters (7 GiB in bf16), for benchmarks on a GPU.

    Args:
        max_position_embeddings: the longest context the config allows.
        vision: engines load its tokenizer and processor (as :func:`tiny_qwen4_exp`'s): a server
            that streams text to a client needs them.
    """
    real = QWEN38_FLASH_NEXT
    text = QWEN38_FLASH_NEXT_TEXT_CONFIG
    widths = {
        key: text[key]
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
    }
    widths |= {
        "num_experts": 4,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    }
    config = _qwen4_exp_config(
        q_heads=real.num_attention_heads,
        kv_heads=int(text["num_key_value_heads"]),  # type: ignore[call-overload]
        head_dim=real.head_dim,
        max_position_embeddings=max_position_embeddings,
        widths=widths,
    )
    name = f"qwen4exp-full-depth-ctx{max_position_embeddings}" + ("-vl" if vision else "")
    return TinyModel(name, TinyModelKind.QWEN4_EXP, _frozen(config), vision=vision)


def _qwen4_exp_config(
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    max_position_embeddings: int,
    widths: Mapping[str, Any],
) -> dict[str, Any]:
    """A Qwen4Exp ``config.json``: the tiny widths and depth, less what ``widths`` sets."""
    real = QWEN38_FLASH_NEXT
    rotary = 0.25
    text: dict[str, Any] = {
        "model_type": "qwen4_exp_text",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "num_attention_heads": q_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "partial_rotary_factor": rotary,
        "rope_theta": 10_000_000.0,
        "max_position_embeddings": max_position_embeddings,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": _mrope_section(head_dim, rotary),
            "mrope_interleaved": True,
        },
        "attn_output_gate": True,
        "rms_norm_eps": 1e-6,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hc_count": 2,
        "hc_lowrank": 8,
        # The QSA rules of the real model.
        "indexer_n_heads": real.index_n_heads,
        "indexer_kv_heads": real.index_kv_heads,
        "indexer_head_dim": real.index_head_dim,
        "indexer_budget": real.budget,
        "indexer_compress_ratio": real.compress_ratio,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "mtp_num_hidden_layers": 0,
    }
    text |= widths
    interval = int(text["full_attention_interval"])
    text["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(int(text["num_hidden_layers"]))
    ]
    config = {
        "architectures": [TinyModelKind.QWEN4_EXP.value],
        "model_type": "qwen4_exp",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "image_token_id": _IMAGE_TOKEN,
        "video_token_id": _IMAGE_TOKEN + 1,
        "vision_start_token_id": _IMAGE_TOKEN + 2,
        "vision_end_token_id": _IMAGE_TOKEN + 3,
        "text_config": text,
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": text["hidden_size"],
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [],
        },
    }
    return config


def tiny_llama() -> TinyModel:
    """A 2-layer Llama with grouped-query attention (4 query heads, 2 K/V heads of dim 16)."""
    config = {
        "architectures": [TinyModelKind.LLAMA.value],
        "model_type": "llama",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10_000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    return TinyModel("llama-2l", TinyModelKind.LLAMA, _frozen(config))


#: Llama-3.1-8B's shape (Meta's published config): every width but the vocabulary.
LLAMA_8B_WIDTHS: Final[Mapping[str, int]] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def llama_8b_shaped(*, max_position_embeddings: int = 131_072) -> TinyModel:
    """Llama-3.1-8B's layers and widths with a small vocabulary, for benchmarks on a GPU.

    32 layers, 32 query and 8 K/V heads of dim 128, MLP 14,336: the attention, K/V bytes and MLP
    of the real model, dummy weights (about 7 B parameters, 14 GiB in bf16).

    Args:
        max_position_embeddings: the longest context the config allows.
    """
    config = dict(tiny_llama().config) | dict(LLAMA_8B_WIDTHS)
    config |= {"max_position_embeddings": max_position_embeddings, "rope_theta": 500_000.0}
    return TinyModel(
        f"llama-8b-shaped-ctx{max_position_embeddings}", TinyModelKind.LLAMA, _frozen(config)
    )
