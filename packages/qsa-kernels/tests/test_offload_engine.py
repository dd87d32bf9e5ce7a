"""An engine's offloaded layers as an OffloadLayout, and a prefill batch as its requests' chunks."""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import KernelInputError
from qsa_kernels.offload import ChunkSpan, OffloadGeometry, OffloadLayout, chunk_spans


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
