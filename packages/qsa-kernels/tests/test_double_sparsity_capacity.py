"""Double sparsity's price of a token on one rank, from the options and the attention geometry."""

from __future__ import annotations

from typing import Any, Final

import pytest
import torch

from qsa_core import CapacityError, LabelledCapacity, labelled_capacity
from qsa_kernels.double_sparsity import DSConfig, label_capacity

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
