"""Double sparsity's price of a token on one rank, from the options and the attention geometry."""

from __future__ import annotations

from typing import Any, Final

import pytest
import torch

from qsa_core import CapacityError, LabelledCapacity, labelled_capacity
from qsa_kernels.double_sparsity import (
    ChannelConfig,
    DSConfig,
    DSConfigError,
    label_capacity,
    model_label_capacity,
)

CONFIG = DSConfig(heavy_channel_num=8, heavy_token_num=64, sparse_decode_threshold=512)
#: 4 layers x 2 KV heads x 64 dims.
GEOMETRY: Final[dict[str, Any]] = {"layers": 4, "kv_heads": 2, "head_dim": 64}


def _capacity(kv_dtype: torch.dtype, **options: Any) -> LabelledCapacity:
    """:func:`label_capacity` of :data:`CONFIG` over :data:`GEOMETRY`."""
    return label_capacity(CONFIG, kv_dtype=kv_dtype, **GEOMETRY, **options)


@pytest.mark.parametrize(
    ("kv_dtype", "kv_element", "label_element"),
    [
        (torch.bfloat16, 2, 2),
        (torch.float16, 2, 2),
        (torch.float8_e4m3fn, 1, 2),  # FP8 keys: bf16 labels
    ],
)
def test_resident_labels_follow_the_key_dtype_and_fp8_keys_take_bf16_labels(
    kv_dtype: torch.dtype, kv_element: int, label_element: int
) -> None:
    """Resident K/V: qsa-core's price of the options' channels at the dtypes the cache stores."""
    capacity = _capacity(kv_dtype)
    expected = labelled_capacity(
        heavy_channels=8, kv_element_bytes=kv_element, label_element_bytes=label_element, **GEOMETRY
    )
    assert capacity == expected
    assert capacity.label_token_bytes == 4 * 2 * 8 * label_element
    engine = _capacity(kv_dtype, kv_token_bytes=5000)
    assert engine.price is not None
    assert engine.price.token_bytes == 5000 + capacity.label_token_bytes


@pytest.mark.parametrize("verify", [False, True])
def test_ds_offload_sizes_its_hot_caches_by_the_options_hot_blocks(verify: bool) -> None:
    """DS-Offload: the hot blocks per KV head are ``DSConfig.hot_blocks`` (labels per token)."""
    capacity = _capacity(torch.bfloat16, offload=True, rows=3, context_len=4096, verify=verify)
    expected = labelled_capacity(
        heavy_channels=8,
        kv_element_bytes=2,
        label_element_bytes=2,
        offload_hot_blocks=CONFIG.hot_blocks(),
        rows=3,
        context_len=4096,
        verify=verify,
        **GEOMETRY,
    )
    assert capacity == expected
    assert capacity.price is not None
    assert capacity.price.token_bytes == capacity.label_token_bytes
    assert capacity.price.fixed_bytes > 0


def test_ds_offload_without_rows_is_unpriced_and_with_rows_needs_a_context() -> None:
    """No request rows: no price; rows without a context length: qsa-core refuses."""
    unpriced = _capacity(torch.bfloat16, offload=True)
    assert unpriced.price is None
    with pytest.raises(CapacityError, match="context_len=None"):
        _capacity(torch.bfloat16, offload=True, rows=3)


#: A GQA text config of :data:`GEOMETRY`'s layers and head dim, 4 KV heads of 8 query heads.
TEXT_CONFIG: Final[dict[str, object]] = {
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}


def _file_channels(kv_heads: int = 4) -> ChannelConfig:
    """A channel file of one row per KV head, loaded against :data:`TEXT_CONFIG`."""
    rows = [list(range(64)) for _ in range(kv_heads)]
    data = {f"model.layers.{i}.self_attn.qk_proj": rows for i in range(4)}
    return ChannelConfig.from_mapping(
        data, config=CONFIG, layers=range(4), num_q_heads=8, num_kv_heads=kv_heads, head_dim=64
    )


@pytest.mark.parametrize(("tp_size", "rank_heads"), [(1, 4), (2, 2), (8, 1)])
def test_a_models_price_is_rank_zeros_share_of_its_channel_files_heads(
    tp_size: int, rank_heads: int
) -> None:
    """The config's layers and head dim, rank 0's KV heads of the channel file (bf16 K/V)."""
    capacity = model_label_capacity(TEXT_CONFIG, CONFIG, _file_channels(), tp_size=tp_size)
    expected = label_capacity(
        CONFIG, layers=4, kv_heads=rank_heads, head_dim=64, kv_dtype=torch.bfloat16
    )
    assert capacity == expected


def test_ds_offload_of_a_model_reads_its_context_from_the_config_unless_given() -> None:
    channels = _file_channels()
    options: dict[str, Any] = {"offload": True, "rows": 3}
    from_config = model_label_capacity(TEXT_CONFIG, CONFIG, channels, **options)
    given = model_label_capacity(TEXT_CONFIG, CONFIG, channels, context_len=4096, **options)
    shorter = model_label_capacity(TEXT_CONFIG, CONFIG, channels, context_len=1024, **options)
    expected = label_capacity(
        CONFIG, layers=4, kv_heads=4, head_dim=64, kv_dtype=torch.bfloat16, context_len=4096,
        **options,
    )  # fmt: skip
    assert from_config == given == expected
    assert from_config.price is not None
    assert shorter.price is not None
    assert shorter.price.fixed_bytes < from_config.price.fixed_bytes


def test_a_models_refusals_name_the_value() -> None:
    """A channel file that does not split at the TP size, a context the config does not give."""
    with pytest.raises(DSConfigError, match="tp_size=3 does not split 4 K/V heads"):
        model_label_capacity(TEXT_CONFIG, CONFIG, _file_channels(), tp_size=3)
    no_int = {**TEXT_CONFIG, "max_position_embeddings": "4k"}
    with pytest.raises(CapacityError, match="max_position_embeddings='4k'"):
        model_label_capacity(no_int, CONFIG, _file_channels(), offload=True, rows=3)
    without = {k: v for k, v in TEXT_CONFIG.items() if k != "max_position_embeddings"}
    with pytest.raises(CapacityError, match="context_len=None"):
        model_label_capacity(without, CONFIG, _file_channels(), offload=True, rows=3)
    with pytest.raises(DSConfigError, match="num_hidden_layers is missing"):
        model_label_capacity({"num_attention_heads": 8}, CONFIG, _file_channels())
