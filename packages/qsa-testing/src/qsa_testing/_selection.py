"""QSA-shaped selections and SGLang batches for tests that drive the attention paths by hand.

The QSA indexer picks complete 4-token blocks per query and, in prefill, hands attention their
token positions followed by the query's open block (upstream's expansion). Tests that feed the
backends or the sharded kernels by hand draw the same shapes here, from a seeded generator, so
every rank of a gloo scenario draws the same selection. The batches are SGLang's own
``ForwardBatch`` with what the backends read of an extend or a decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ("IndexPoolShape", "decode_batch", "extend_batch", "random_block_selection")


def extend_batch(
    parts: Sequence[tuple[int, int, int]], out_cache_loc: torch.Tensor | None = None
) -> Any:
    """SGLang's ``ForwardBatch`` of requests ``(slot, start, end)`` extended together.

    Args:
        parts: each request's KV slot (``req_pool_indices``) and the token range
            ``[start, end)`` it prefills now (``start`` tokens come before it).
        out_cache_loc: ``[sum(end - start)]`` int64 KV locations of the new tokens; zeros when
            the backend under test does not write SGLang's pool.
    """
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    counts = [end - start for _, start, end in parts]
    ends = [end for _, _, end in parts]
    tokens = sum(counts)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(parts),
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        req_pool_indices=torch.tensor([slot for slot, _, _ in parts]),
        seq_lens=torch.tensor(ends),
        out_cache_loc=(
            torch.zeros(tokens, dtype=torch.int64) if out_cache_loc is None else out_cache_loc
        ),
        seq_lens_sum=sum(ends),
        seq_lens_cpu=torch.tensor(ends),
        extend_seq_lens_cpu=counts,
    )


def decode_batch(
    slots: Sequence[int], seq_lens: Sequence[int], out_cache_loc: torch.Tensor | None = None
) -> Any:
    """SGLang's ``ForwardBatch`` of one decode step of the requests in KV slots ``slots``.

    Args:
        slots: each request's KV slot.
        seq_lens: each request's length with the token this step adds.
        out_cache_loc: ``[len(slots)]`` int64 KV locations of the new tokens; zeros by default.
    """
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(slots),
        input_ids=torch.zeros(len(slots), dtype=torch.int64),
        req_pool_indices=torch.tensor(list(slots)),
        seq_lens=torch.tensor(list(seq_lens)),
        out_cache_loc=(
            torch.zeros(len(slots), dtype=torch.int64) if out_cache_loc is None else out_cache_loc
        ),
        seq_lens_sum=sum(seq_lens),
        seq_lens_cpu=torch.tensor(list(seq_lens)),
    )


def random_block_selection(
    lengths: torch.Tensor, block_topk: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random complete blocks per query, and the same selection as upstream's token positions.

    Args:
        lengths: ``[T]`` tokens each query sees (its position + 1).
        block_topk: blocks per query at most (its complete blocks if fewer).
        generator: the seeded source of the draw.

    Returns:
        ``(blocks [T, block_topk] int32, positions [T, 4 block_topk + 3] int32)``: distinct
        complete block ids, ``-1`` padded; their tokens in the order drawn, then the query's open
        block, ``-1`` padded (``qsa_kernels.expand.expand_blocks_reference``).
    """
    from qsa_kernels import BLOCK_TOKENS
    from qsa_kernels.expand import expand_blocks_reference

    blocks = torch.full((lengths.numel(), block_topk), -1, dtype=torch.int32)
    for row, length in enumerate(lengths.tolist()):
        pick = torch.randperm(length // BLOCK_TOKENS, generator=generator)[:block_topk]
        blocks[row, : pick.numel()] = pick.to(torch.int32)
    positions = expand_blocks_reference(
        blocks, lengths, ratio=BLOCK_TOKENS, token_topk=BLOCK_TOKENS * block_topk
    )
    return blocks, positions


@dataclass(frozen=True, slots=True)
class IndexPoolShape:
    """A small QSA pool for tests that drive SGLang's indexer over it by hand (gloo ranks).

    Attributes:
        layer_ids: SGLang's ids of the QSA (full attention) layers.
        page: tokens a page.
        ratio: tokens an index block (the compress ratio).
        index_dim: the index key's width.
        token_topk: tokens a query selects (``ratio * block_topk``).
        pages: pages of the pool (one is SGLang's padding page).
        head_dim: the raw K/V's head width.
    """

    layer_ids: tuple[int, ...] = (3, 7)
    page: int = 64
    ratio: int = 4
    index_dim: int = 128
    token_topk: int = 2048
    pages: int = 128
    head_dim: int = 64

    @property
    def block_topk(self) -> int:
        """Index blocks a query selects."""
        return self.token_topk // self.ratio

    def pool(self, cls: type) -> Any:
        """SGLang's ``QSATokenToKVPool`` (``cls``: it, or a class built as it) on the CPU."""
        return cls(
            size=(self.pages - 1) * self.page,
            dtype=torch.bfloat16,
            page_size=self.page,
            head_num=1,
            head_dim=self.head_dim,
            full_attention_layer_ids=list(self.layer_ids),
            device="cpu",
            mamba_pool=None,
            qsa_index_kv_heads=1,
            qsa_index_head_dim=self.index_dim,
            qsa_compress_ratio=self.ratio,
            qsa_token_topk=self.token_topk,
            num_request_slots=8,
        )

    def indexer(self, cls: type, layer_id: int, heads: int) -> Any:
        """SGLang's ``QSAIndexer`` (``cls``) of ``heads`` query heads at this shape.

        Built for its selection methods (its configuration); it has no weights to run
        ``forward``.
        """
        from types import SimpleNamespace

        config = SimpleNamespace(
            indexer_n_heads=heads,
            indexer_kv_heads=1,
            indexer_head_dim=self.index_dim,
            indexer_budget=self.token_topk,
            indexer_compress_ratio=self.ratio,
            hidden_size=64,
            rms_norm_eps=1e-6,
        )
        return cls(config, layer_id, rotary_emb=SimpleNamespace(rotary_dim=64))

    def holds_its_share(self, pool: Any, whole: Any, layer: int, placement: Any, rank: int) -> bool:
        """Whether a rank's index shard holds exactly its pages of the whole index.

        ``pool``'s index of ``layer`` (a rank's shard under index sharding) against ``rank``'s
        pages of ``whole``'s (upstream's replicated pool) under ``placement``
        (``qsa_kernels.sharded.shard_index_pages``), bit for bit.
        """
        from qsa_kernels.sharded import shard_index_pages

        blocks = self.page // self.ratio  # index blocks a page
        mine = pool.get_qsa_compressed_k_buffer(layer).view(-1, blocks, self.index_dim)
        everything = whole.get_qsa_compressed_k_buffer(layer).view(-1, blocks, self.index_dim)
        return torch.equal(mine, shard_index_pages(everything, placement, rank))

    def metadata(self, meta_cls: type, pool: Any, **fields: Any) -> Any:
        """SGLang's ``QSAIndexerMetadata`` over ``pool``, with the step's ``fields``."""
        return meta_cls(
            token_to_kv_pool=pool,
            compress_ratio=self.ratio,
            block_topk=self.block_topk,
            out_cache_loc=torch.zeros(0, dtype=torch.int64),
            **fields,
        )
