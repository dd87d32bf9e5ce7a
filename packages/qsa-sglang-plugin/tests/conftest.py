"""Shared fixtures: a tiny QSA checkpoint config SGLang can resolve on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# Wall-clock deadlines are meaningless on a shared 2-core CI machine; examples must still pass.
settings.register_profile("qsa", deadline=None)
settings.load_profile("qsa")

#: A small Qwen4-Exp config with the Qwen3.8-Flash-Next QSA geometry (4 layers, 1 QSA layer).
TINY_QWEN4_EXP_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen4ExpForConditionalGeneration"],
    "model_type": "qwen4_exp",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen4_exp_text",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "intermediate_size": 512,
        "vocab_size": 1024,
        "max_position_embeddings": 262144,
        "full_attention_interval": 4,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 128,
        "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    },
    "vision_config": {"depth": 1, "hidden_size": 64, "num_heads": 2, "out_hidden_size": 256},
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only ``config.json`` of a tiny Qwen4-Exp QSA model."""
    path = tmp_path_factory.mktemp("tiny-qwen4-exp")
    (path / "config.json").write_text(json.dumps(TINY_QWEN4_EXP_CONFIG), encoding="utf-8")
    return path
