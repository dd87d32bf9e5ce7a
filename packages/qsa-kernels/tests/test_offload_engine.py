"""An engine's offloaded layers as an OffloadLayout, and a prefill batch as its requests' chunks."""

from __future__ import annotations

import pytest
import torch

from qsa_core import PoolPrice
from qsa_kernels import KernelInputError
from qsa_kernels.offload import ChunkSpan, OffloadGeometry, OffloadLayout, chunk_spans
from qsa_kernels.sharded import ShardedIndex


def test_qsa_layers_map_in_order_onto_a_block_topk_geometry() -> None:
    """The engine's QSA layer ids take ordinals 0.. in order; the geometry is for_block_topk's."""
    layout = OffloadLayout.qsa(
        [3, 7, 11],
        rows=2,
        context_len=4096,
        block_topk=64,
        hot_blocks=None,
        kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        staged_prompts=2,
    )
    expected = OffloadGeometry.for_block_topk(
        layers=3,
        rows=2,
        context_len=4096,
        block_topk=64,
        hot_blocks=None,
        kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        staged_prompts=2,
    )
    assert layout == OffloadLayout(expected, {3: 0, 7: 1, 11: 2}, 64)


def test_a_qsa_layer_id_given_twice_is_refused() -> None:
    """Two layers cannot share one ordinal; the refusal names the ids."""
    with pytest.raises(KernelInputError, match=r"layer_ids=\[3, 3\]"):
        OffloadLayout.qsa(
            [3, 3],
            rows=1,
            context_len=64,
            block_topk=4,
            hot_blocks=None,
            kv_heads=1,
            head_dim=64,
            dtype=torch.bfloat16,
        )


def test_per_head_layers_are_every_layer_with_no_block_topk() -> None:
    """Double sparsity offloads every layer, layer i at ordinal i, in per-head records."""
    layout = OffloadLayout.per_head(
        layers=3,
        rows=1,
        context_len=400,
        hot_blocks=16,
        kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
    )
    assert layout.geometry.per_head
    assert (dict(layout.layer_ordinal), layout.block_topk) == ({0: 0, 1: 1, 2: 2}, None)


def _qsa_layout(rows: int = 4) -> OffloadLayout:
    return OffloadLayout.qsa(
        [3, 7], rows=rows, context_len=4096, block_topk=64, hot_blocks=None, kv_heads=2,
        head_dim=64, dtype=torch.bfloat16,
    )  # fmt: skip


@pytest.mark.parametrize("verify", [False, True])
def test_the_pool_price_is_qsa_cores_of_the_layouts_sizes(verify: bool) -> None:
    """A token costs its index; the offload's buffers (with ``verify``, the copy too) are fixed."""
    layout = _qsa_layout()
    price = layout.pool_price(resident_token_bytes=576, index_token_bytes=64, verify=verify)
    expected = PoolPrice.offloaded(
        layout.geometry.sizes, resident_token_bytes=576, index_token_bytes=64, verify=verify
    )
    assert price == expected
    assert price.token_bytes == 64
    assert price.fixed_bytes == layout.geometry.sizes.fixed_device_bytes(verify=verify)


def test_an_index_sharded_pool_price_adds_the_candidate_buffers_of_the_layouts_rows() -> None:
    """D2 over 2 ranks: half the index per token, the candidates of the top-k and rows fixed."""
    layout = _qsa_layout(rows=4)
    price = layout.pool_price(resident_token_bytes=576, index_token_bytes=64, index_ranks=2)
    candidates = ShardedIndex.candidate_bytes(world_size=2, block_topk=64, max_running=4)
    assert candidates > 0
    assert price.token_bytes == 32
    assert price.fixed_bytes == layout.geometry.sizes.fixed_device_bytes() + candidates


def test_a_per_head_layout_has_no_index_to_shard() -> None:
    layout = OffloadLayout.per_head(
        layers=1, rows=1, context_len=400, hot_blocks=16, kv_heads=2, head_dim=64,
        dtype=torch.bfloat16,
    )  # fmt: skip
    assert layout.pool_price(resident_token_bytes=1, index_token_bytes=0).token_bytes == 0
    with pytest.raises(KernelInputError, match="index_ranks=2"):
        layout.pool_price(resident_token_bytes=1, index_token_bytes=0, index_ranks=2)


def test_a_prefill_batch_splits_into_each_requests_chunk_and_rows() -> None:
    """Chunks of 3 and 5 tokens: the first starts at 0, the second after a 10-token prefix."""
    assert chunk_spans([4, 9], [3, 15], [3, 5]) == [
        ChunkSpan(4, 0, 3, slice(0, 3)),
        ChunkSpan(9, 10, 15, slice(3, 8)),
    ]


@pytest.mark.parametrize(
    ("slots", "seq_lens", "chunk_lens", "message"),
    [
        ([1, 2], [4], [4], "2 slots, 1 seq_lens"),
        ([1], [4], [5], "a chunk of 5 tokens in a request of 4"),
    ],
)
def test_chunks_that_do_not_fit_their_requests_are_refused(
    slots: list[int], seq_lens: list[int], chunk_lens: list[int], message: str
) -> None:
    """Lists of different lengths, or a chunk longer than its request, are refused by value."""
    with pytest.raises(KernelInputError, match=message):
        chunk_spans(slots, seq_lens, chunk_lens)
