"""The one-page K/V pool SGLang gets when the plugin holds the attention layers' K/V."""

from __future__ import annotations

import warnings

import pytest
import torch

from qsa_sglang_plugin._errors import OffloadRuntimeError


@pytest.fixture(scope="module")
def pool() -> object:
    """SGLang's own MHA pool class with the plugin's storage rule, 4,096 slots of 2 layers."""
    with warnings.catch_warnings():  # SGLang's import warns about CPU-only kernels
        warnings.simplefilter("ignore")
        from qsa_sglang_plugin._adapters._pool import NoRawKVPool
    return NoRawKVPool(
        size=4096,
        page_size=64,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=64,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )


def test_the_pool_keeps_its_slots_and_stores_only_the_padding_page(pool: object) -> None:
    """SGLang still sees 4,096 slots; each layer's buffers hold one 64-token page."""
    assert pool.size == 4096  # type: ignore[attr-defined]
    for layer in range(2):
        assert pool.get_key_buffer(layer).shape[0] == 64  # type: ignore[attr-defined]
        assert pool.get_value_buffer(layer).shape[0] == 64  # type: ignore[attr-defined]


def test_writes_and_slot_moves_are_refused_with_the_reason(pool: object) -> None:
    """Nothing writes the pool or moves its slots: the plugin's stores would not follow."""
    loc = torch.arange(4)
    with pytest.raises(OffloadRuntimeError, match="nothing may write SGLang's K/V pool"):
        pool.set_kv_buffer(None, loc, torch.zeros(4, 2, 64), torch.zeros(4, 2, 64))  # type: ignore[attr-defined]
    with pytest.raises(OffloadRuntimeError, match="cannot move slots"):
        pool.move_kv_cache(loc + 64, loc)  # type: ignore[attr-defined]
