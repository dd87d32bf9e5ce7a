"""Tiny models keep the real QSA rules and write a config SGLang reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qsa_core import QWEN38_FLASH_NEXT, QWEN38_FLASH_NEXT_TEXT_CONFIG
from qsa_testing import (
    ModelSpecError,
    TinyModelKind,
    full_depth_qwen4_exp,
    llama_8b_shaped,
    tiny_llama,
    tiny_qwen4_exp,
)
from qsa_testing._models import FIRST_PROMPT_TOKEN, LLAMA_8B_WIDTHS


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("model_shaped", [False, True])
def test_tiny_qwen4_exp_keeps_the_real_qsa_rules(kv_heads: int, model_shaped: bool) -> None:
    model = tiny_qwen4_exp(kv_heads=kv_heads, model_shaped=model_shaped)
    profile = model.qsa_profile()
    real = QWEN38_FLASH_NEXT
    assert (profile.index_n_heads, profile.index_kv_heads, profile.index_head_dim) == (
        real.index_n_heads,
        real.index_kv_heads,
        real.index_head_dim,
    )
    assert (profile.budget, profile.compress_ratio, profile.page_size) == (2048, 4, 64)
    assert profile.qsa_layer_ids == (3,)
    assert profile.num_kv_heads == kv_heads
    if model_shaped:
        assert (profile.num_attention_heads, profile.head_dim) == (24, 256)


def test_the_model_shaped_stack_has_the_real_qsa_layer_ids() -> None:
    model = tiny_qwen4_exp(model_shaped=True, qsa_layers=QWEN38_FLASH_NEXT.num_qsa_layers)
    profile = model.qsa_profile()
    assert profile.qsa_layer_ids == QWEN38_FLASH_NEXT.qsa_layer_ids
    assert profile.num_hidden_layers == QWEN38_FLASH_NEXT.num_hidden_layers
    assert (profile.num_attention_heads, profile.head_dim) == (24, 256)
    assert model.text_config["hidden_size"] == tiny_qwen4_exp().text_config["hidden_size"]
    assert model.name != tiny_qwen4_exp(model_shaped=True).name


@pytest.mark.parametrize("qsa_layers", [0, 13, True, 2.0])
def test_qsa_layers_outside_one_to_twelve_are_refused(qsa_layers: object) -> None:
    with pytest.raises(ModelSpecError, match=rf"qsa_layers={qsa_layers!r} .* allowed: 1 to 12"):
        tiny_qwen4_exp(qsa_layers=qsa_layers)  # type: ignore[arg-type]


def test_the_full_depth_model_has_the_real_layers_and_widths() -> None:
    model = full_depth_qwen4_exp(max_position_embeddings=131_072)
    profile = model.qsa_profile()
    real = QWEN38_FLASH_NEXT
    for name in (
        "num_hidden_layers",
        "hidden_size",
        "qsa_layer_ids",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "budget",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    ):
        assert getattr(profile, name) == getattr(real, name), name
    assert model.text_config["max_position_embeddings"] == 131_072
    assert model.text_config["num_experts"] < 8  # the experts stay small
    assert (
        model.config["vision_config"]["out_hidden_size"]
        == QWEN38_FLASH_NEXT_TEXT_CONFIG["hidden_size"]
    )


def test_mrope_sections_cover_half_the_rotary_dims() -> None:
    for shaped in (False, True):
        text = tiny_qwen4_exp(model_shaped=shaped).text_config
        rotary = int(text["head_dim"] * text["partial_rotary_factor"])
        assert sum(text["rope_scaling"]["mrope_section"]) == rotary // 2


def test_variants_have_distinct_names_and_compare_by_name() -> None:
    models = [tiny_qwen4_exp(kv_heads=k, model_shaped=s) for k in (1, 2) for s in (False, True)]
    assert len({m.name for m in models}) == 4
    assert tiny_qwen4_exp() == tiny_qwen4_exp()
    assert hash(tiny_qwen4_exp()) == hash(tiny_qwen4_exp())
    assert tiny_llama().kind is TinyModelKind.LLAMA


def test_kv_heads_outside_the_supported_values_are_refused() -> None:
    with pytest.raises(ModelSpecError, match=r"kv_heads=3 .* allowed: 1, 2"):
        tiny_qwen4_exp(kv_heads=3)


def test_llama_has_no_qsa_profile() -> None:
    with pytest.raises(ModelSpecError, match="has no QSA layers"):
        tiny_llama().qsa_profile()


def test_prompts_are_seeded_and_avoid_special_and_vision_tokens() -> None:
    model = tiny_qwen4_exp()
    prompt = model.prompt(5000, seed=7)
    assert prompt == model.prompt(5000, seed=7)
    assert prompt != model.prompt(5000, seed=8)
    assert min(prompt) >= FIRST_PROMPT_TOKEN
    assert max(prompt) < model.config["image_token_id"]
    with pytest.raises(ModelSpecError, match="length=0"):
        model.prompt(0, seed=1)


def test_write_creates_one_config_and_is_idempotent(tmp_path: Path) -> None:
    model = tiny_qwen4_exp()
    path = model.write(tmp_path)
    assert path == tmp_path / model.name
    written = json.loads((path / "config.json").read_text())
    assert written["architectures"] == ["Qwen4ExpForConditionalGeneration"]
    assert written["text_config"]["indexer_budget"] == 2048
    mtime = (path / "config.json").stat().st_mtime_ns
    assert model.write(tmp_path) == path
    assert (path / "config.json").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]


def test_the_llama_8b_shaped_model_has_its_layers_and_widths_and_a_small_vocabulary() -> None:
    model = llama_8b_shaped(max_position_embeddings=40_000)
    for name, value in LLAMA_8B_WIDTHS.items():
        assert model.text_config[name] == value, name
    assert model.text_config["max_position_embeddings"] == 40_000
    assert model.vocab_size == tiny_llama().vocab_size
    assert model.kind is TinyModelKind.LLAMA
    assert model.name != llama_8b_shaped().name  # the context is in the name


def test_sglang_reads_the_tiny_configs(tmp_path: Path) -> None:
    from sglang.srt.configs.model_config import ModelConfig

    models = (
        tiny_qwen4_exp(),
        tiny_qwen4_exp(kv_heads=1, model_shaped=True),
        full_depth_qwen4_exp(),
        tiny_llama(),
        llama_8b_shaped(),
    )
    for model in models:
        config = ModelConfig(str(model.write(tmp_path)))
        assert config.hf_config.architectures == [model.kind.value]
        assert config.num_hidden_layers == model.text_config["num_hidden_layers"]
