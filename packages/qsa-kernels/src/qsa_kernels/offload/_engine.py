"""What an engine hands an :class:`OffloadRuntime`, in plain numbers.

:class:`OffloadLayout`: which of the engine's attention layers the offload holds, in which record
layout, and the geometry of their K/V (QSA's blocks of every KV head, or double sparsity's
per-head records), and what the offload adds to a token's price in the engine's pool sizing
(:meth:`OffloadLayout.pool_price`). :func:`chunk_spans`: a prefill batch's requests as the chunks
:meth:`OffloadRuntime.stage` and :meth:`OffloadRuntime.prefill` take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from qsa_core import PoolPrice
from qsa_kernels._errors import KernelInputError
from qsa_kernels.offload._store import OffloadGeometry
from qsa_kernels.sharded import ShardedIndex

__all__ = ("ChunkSpan", "OffloadLayout", "chunk_spans")


@dataclass(frozen=True, slots=True)
class OffloadLayout:
    """An engine's offloaded layers and their geometry (:meth:`OffloadRuntime.for_geometry`).

    Attributes:
        geometry: the offloaded K/V's sizes.
        layer_ordinal: the engine's layer id -> the offloaded layer's ordinal.
        block_topk: the indexer's block top-k (QSA's records); None for per-head records.
    """

    geometry: OffloadGeometry
    layer_ordinal: Mapping[int, int]
    block_topk: int | None

    @classmethod
    def qsa(
        cls,
        layer_ids: Sequence[int],
        *,
        rows: int,
        context_len: int,
        block_topk: int,
        hot_blocks: int | None,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        staged_prompts: int = 1,
    ) -> OffloadLayout:
        """QSA's layers ``layer_ids`` in order, as :meth:`OffloadGeometry.for_block_topk`.

        Args:
            layer_ids: the engine's ids of the QSA (full attention) layers.
            rows: request rows (the engine's running-request limit).
            context_len: tokens of one request's context.
            block_topk: blocks the indexer selects.
            hot_blocks: hot-cache slots asked for (None: qsa-core's default).
            kv_heads: KV heads of this rank.
            head_dim: ``D``.
            dtype: the K/V's logical dtype.
            staged_prompts: prompts the staging area holds at once.

        Raises:
            KernelInputError: a size the geometry refuses, or a layer id given twice.
        """
        ordinal = {int(layer): i for i, layer in enumerate(layer_ids)}
        if len(ordinal) != len(layer_ids):
            msg = f"layer_ids={list(layer_ids)!r} is not allowed; each layer id must appear once"
            raise KernelInputError(msg)
        geometry = OffloadGeometry.for_block_topk(
            layers=len(ordinal),
            rows=rows,
            context_len=context_len,
            block_topk=block_topk,
            hot_blocks=hot_blocks,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            staged_prompts=staged_prompts,
        )
        return cls(geometry, ordinal, block_topk)

    @classmethod
    def per_head(
        cls,
        *,
        layers: int,
        rows: int,
        context_len: int,
        hot_blocks: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        windowed_staging: bool = True,
    ) -> OffloadLayout:
        """Every layer ``0..layers-1`` in per-head records (:meth:`per_head_for_context`).

        Raises:
            KernelInputError: a size the geometry refuses.
        """
        geometry = OffloadGeometry.per_head_for_context(
            layers=layers,
            rows=rows,
            context_len=context_len,
            hot_blocks=hot_blocks,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            windowed_staging=windowed_staging,
        )
        return cls(geometry, {i: i for i in range(layers)}, None)

    def pool_price(
        self,
        *,
        resident_token_bytes: int,
        index_token_bytes: int,
        verify: bool = False,
        index_ranks: int = 1,
    ) -> PoolPrice:
        """:meth:`qsa_core.PoolPrice.offloaded` of this layout, as the engine's pool sizing charges.

        A token costs its compressed index (``1 / index_ranks`` of it); the offload's buffers
        (:attr:`OffloadGeometry.sizes`) are fixed, and with the index sharded (D2) the index
        shard's candidate buffers (:meth:`ShardedIndex.candidate_bytes` of :attr:`block_topk`,
        the geometry's rows and ``index_ranks``) too.

        Args:
            resident_token_bytes: the engine's price of a token with its K/V resident, B.
            index_token_bytes: the engine's price of a token's compressed index alone, B.
            verify: the offload keeps a resident copy of every row.
            index_ranks: ranks the compressed index is sharded over by page (1 = not sharded):
                the host arenas' shard group, or every TP rank without cache sharding.

        Raises:
            KernelInputError: a sharded index over per-head records (no block top-k).
            qsa_core.CapacityError: a size qsa-core refuses (named).
        """
        candidates = 0
        if index_ranks > 1:
            if self.block_topk is None:
                msg = (
                    f"index_ranks={index_ranks!r} is not allowed for per-head records (no "
                    "compressed index); allowed: 1"
                )
                raise KernelInputError(msg)
            candidates = ShardedIndex.candidate_bytes(
                world_size=index_ranks, block_topk=self.block_topk, max_running=self.geometry.rows
            )
        return PoolPrice.offloaded(
            self.geometry.sizes,
            resident_token_bytes=resident_token_bytes,
            index_token_bytes=index_token_bytes,
            verify=verify,
            index_ranks=index_ranks,
            index_buffer_bytes=candidates,
        )


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """One request's chunk in a prefill batch.

    Attributes:
        slot: the request's engine slot.
        start: tokens of its prompt before the chunk.
        end: the chunk's end (tokens of the prompt so far).
        rows: the chunk's rows of the batch's ``[T, ...]`` q, k, v and indexer output.
    """

    slot: int
    start: int
    end: int
    rows: slice


def chunk_spans(
    slots: Sequence[int], seq_lens: Sequence[int], chunk_lens: Sequence[int]
) -> list[ChunkSpan]:
    """Each request's chunk of a prefill batch whose rows are the chunks in request order.

    Args:
        slots: each request's engine slot.
        seq_lens: each request's tokens once its chunk is in.
        chunk_lens: each request's chunk tokens.

    Raises:
        KernelInputError: the three differ in length, or a chunk longer than its request.
    """
    if not len(slots) == len(seq_lens) == len(chunk_lens):
        msg = (
            f"{len(slots)!r} slots, {len(seq_lens)!r} seq_lens and {len(chunk_lens)!r} "
            "chunk_lens; allowed: one of each per request"
        )
        raise KernelInputError(msg)
    spans, offset = [], 0
    for slot, end, length in zip(slots, seq_lens, chunk_lens, strict=True):
        if not 0 <= length <= end:
            msg = f"a chunk of {length!r} tokens in a request of {end!r}; allowed: 0 to {end!r}"
            raise KernelInputError(msg)
        spans.append(ChunkSpan(int(slot), end - length, end, slice(offset, offset + length)))
        offset += length
    return spans
