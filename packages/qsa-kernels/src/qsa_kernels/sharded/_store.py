"""One rank's share of the QSA layers' raw K/V under a shard group, and its attention (D1).

Engine-neutral: an engine's attention backend stores each new token's K/V with :meth:`write`
(owned rows only), attends decode rows with :meth:`ShardedKVStore.decode` and a chunk after a
prefix with :meth:`ShardedKVStore.prefill`, and prices the fixed buffers with
:meth:`ShardedKVStore.transport_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from qsa_core import format_bytes
from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS
from qsa_kernels._path import KernelPath
from qsa_kernels.context import PrefillKernels, ZigzagEntries, attend_chunks, attend_context
from qsa_kernels.expand import complete_blocks
from qsa_kernels.sharded._attention import owner_sparse_decode, owner_sparse_prefill
from qsa_kernels.sharded._buffers import PREFILL_GROUP_ROWS, HeadLayout, ShardedDecodeBuffers
from qsa_kernels.sharded._group import ShardGroup
from qsa_kernels.sharded._index import ShardedIndex
from qsa_kernels.sharded._layout import owned_token_bound
from qsa_kernels.sharded._writes import raw_write_targets, write_owned_raw_kv

__all__ = ("RowExchange", "ShardedKVStore")


class RowExchange(Protocol):
    """An engine's context-parallel row exchange for one extend batch."""

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``[T_local, ...]`` this rank's rows -> ``[T, ...]`` every rank's, in token order."""
        ...

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` in token order -> this rank's rows first (``[>= T_local, ...]``)."""
        ...


class ShardedKVStore:
    """This rank's share of the QSA layers' raw K/V, and the attention over the shard group.

    Each rank keeps ``[L, NS_local, 2, 4, Hkv, D]`` records of the logical token slots it owns
    (slot ``g`` on rank ``g % N`` at local slot ``g // N``): ``1 / N`` of the raw bytes a
    replicated pool holds. Writes go to their owner only (:func:`raw_write_targets`,
    :func:`write_owned_raw_kv`: fixed shapes, no host read); decode and a chunk after a prefix
    attend owner-side (:func:`owner_sparse_decode`, :func:`owner_sparse_prefill`) through one
    set of transport buffers per kind, allocated once.

    Args:
        shard: this rank's shard group (``N >= 2`` ranks holding copies of one K/V head).
        layer_ordinal: the engine's layer id of each QSA layer -> its index in the store
            (``[0, L)``).
        slots: logical token slots of the engine's K/V pool (padding included).
        kv_heads: K/V heads of this rank's attention layers.
        head_dim: head dim ``D``.
        dtype: the K/V dtype (bf16 or FP8 E4M3).
        q_heads: query heads of this rank (the group attends ``N x q_heads`` when SHARDED).
        block_topk: the QSA indexer's block selection width.
        max_rows: most decode rows of one step (the engine's running requests).
        device: where the store and the transport buffers live.
        path: kernels or torch references (:attr:`KernelPath.AUTO`: Triton on CUDA).
        head_layout: how the group holds its query heads: SHARDED with the TP head split,
            REPLICATED under CP over the TP group (every rank every head).
    """

    def __init__(
        self,
        shard: ShardGroup,
        layer_ordinal: Mapping[int, int],
        *,
        slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        q_heads: int,
        block_topk: int,
        max_rows: int,
        device: torch.device,
        path: KernelPath = KernelPath.AUTO,
        head_layout: HeadLayout = HeadLayout.SHARDED,
    ) -> None:
        self.shard = shard
        self.path = path
        self.device = device
        self._ordinal = dict(layer_ordinal)
        self._block_topk = block_topk
        self.kv_heads, self.head_dim = kv_heads, head_dim
        placement = shard.placement
        records = -(-placement.local_capacity(slots) // BLOCK_TOKENS)
        shape = (len(self._ordinal), records, 2, BLOCK_TOKENS, kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self._width = owned_token_bound(placement, block_topk)

        def buffers(rows: int) -> ShardedDecodeBuffers:
            return ShardedDecodeBuffers.for_rank(
                shard.world_size,
                head_layout,
                max_rows=rows,
                block_topk=block_topk,
                q_heads=q_heads,
                head_dim=head_dim,
                device=device,
            )

        self._decode_buffers = buffers(max_rows)
        self._prefill_buffers = buffers(PREFILL_GROUP_ROWS)

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's raw K/V store."""
        return int(self.kv.nbytes)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the transport buffers (decode and prefill)."""
        return self._decode_buffers.nbytes + self._prefill_buffers.nbytes

    def describe(self) -> str:
        """One line of what this rank stores, for an engine's start-up log."""
        shard = self.shard
        return (
            f"rank {shard.rank} of a group of {shard.world_size} stores "
            f"{format_bytes(self.nbytes)} of the QSA layers' raw K/V on {self.device} "
            f"({format_bytes(self.nbytes * shard.world_size)} unsharded); transport buffers "
            f"{format_bytes(self.buffer_bytes)}; kernels: {self.path.resolve(self.device).value}"
        )

    def index(self, max_running: int) -> ShardedIndex:
        """The compressed index's shard operations on this store's group, width, device, path (D2).

        Its candidate buffers hold ``max_running`` decode rows or one prefill group
        (:meth:`ShardedIndex.rows_for`).
        """
        return ShardedIndex(
            self.shard,
            block_topk=self._block_topk,
            max_rows=ShardedIndex.rows_for(max_running),
            device=self.device,
            path=self.path,
        )

    def layer(self, layer_id: int) -> torch.Tensor:
        """``[NS_local, 2, 4, Hkv, D]`` this rank's records of one QSA layer."""
        ordinal = self._ordinal.get(layer_id)
        if ordinal is None:
            msg = f"layer {layer_id!r} is not a QSA layer; QSA layers: {list(self._ordinal)!r}"
            raise KernelInputError(msg)
        return self.kv[ordinal]

    def write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the owned rows of new K/V (a prefill chunk or a decode step's tokens).

        Args:
            layer_id: the engine's layer id.
            k: ``[M, Hkv * D]`` (or ``[M, Hkv, D]``) keys of the new tokens.
            v: their values, shaped like ``k``.
            slots: ``[M]`` their logical slots (negative for padding).
        """
        store = self.layer(layer_id)
        rows = int(slots.shape[0])
        shape = (rows, self.kv_heads, self.head_dim)
        targets = raw_write_targets(slots, self.shard.placement, self.shard.rank)
        k = k[:rows].reshape(shape).to(store.dtype)
        v = v[:rows].reshape(shape).to(store.dtype)
        write_owned_raw_kv(store, targets, k, v)

    def decode(  # noqa: PLR0917 (the attention call's own order)
        self,
        layer_id: int,
        q: torch.Tensor,
        indices: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_table: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One QSA layer's decode over the shard group (the new token already :meth:`write` n).

        Args:
            layer_id: the engine's layer id.
            q: ``[B, Hq * D]`` (or ``[B, Hq, D]``) this rank's query heads.
            indices: the indexer's selection (the forms
                :func:`qsa_kernels.offload.complete_blocks` takes).
            seq_lens: ``[B]`` each row's length with the new token.
            slot_table: ``[B, >= max seq_len]`` logical slot of each position
                (the engine's slot table rows).
            scale: softmax scale.

        Returns:
            ``[B, Hq * D]`` attention output of this rank's heads, in ``q``'s dtype.
        """
        batch = int(seq_lens.shape[0])
        queries = q.reshape(batch, -1, self.head_dim)
        blocks = complete_blocks(indices[:batch], seq_lens // BLOCK_TOKENS, self._block_topk)
        capturing = queries.is_cuda and torch.cuda.is_current_stream_capturing()
        out, _lse = owner_sparse_decode(
            queries.to(torch.bfloat16),
            blocks,
            seq_lens,
            slot_table,
            self.layer(layer_id),
            shard=self.shard,
            buffers=self._decode_buffers,
            scale=scale,
            path=self.path,
            owned_width=self._width,
            check_width=not capturing,  # a captured step relies on the page-contiguous bound
        )
        return out.reshape(batch, -1).to(q.dtype)

    def prefill(  # noqa: PLR0917 (the attention call's own order)
        self,
        layer_id: int,
        q: torch.Tensor,
        indices: torch.Tensor,
        positions: torch.Tensor,
        slot_row: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One request's chunk after a prefix, owner-side (the chunk already :meth:`write` n).

        Args:
            layer_id: the engine's layer id.
            q: ``[T, Hq * D]`` (or ``[T, Hq, D]``) this rank's query heads of the chunk.
            indices: ``[T, 4 block_topk + 3]`` the indexer's token positions per query token.
            positions: ``[T]`` each query token's position in the request.
            slot_row: ``[S]`` the request's logical slot of each position.
            scale: softmax scale.

        Returns:
            ``[T, Hq * D]`` attention output of this rank's heads, in ``q``'s dtype.
        """
        tokens = int(positions.shape[0])
        queries = q.reshape(tokens, -1, self.head_dim)
        closed = (positions + 1) // BLOCK_TOKENS
        blocks = complete_blocks(indices, closed, self._block_topk)
        out, _lse = owner_sparse_prefill(
            queries.to(torch.bfloat16),
            blocks,
            positions,
            slot_row,
            self.layer(layer_id),
            shard=self.shard,
            buffers=self._prefill_buffers,
            scale=scale,
            path=self.path,
        )
        return out.reshape(tokens, -1).to(q.dtype)

    def extend(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        indices: torch.Tensor,
        *,
        slots: torch.Tensor,
        extend_lens: Sequence[int],
        seq_lens: Sequence[int],
        slot_table: torch.Tensor,
        table_rows: torch.Tensor,
        scale: float,
        kernels: PrefillKernels,
        exchange: RowExchange | None = None,
        zigzag: ZigzagEntries | None = None,
    ) -> torch.Tensor:
        """One layer of a prefill batch: store the owned rows, attend every query token.

        Requests with no prefix attend over their own chunk, which every rank holds whole, with
        the engine's no-prefix kernel (:func:`~qsa_kernels.context.attend_chunks`); when any
        request has a prefix each request attends owner-side (:meth:`prefill`), in the batch's
        order on every rank. Under context parallelism (``exchange``) one request whose chunk is
        its whole prompt attends by this rank's ``zigzag`` rows (:meth:`extend_zigzag`, as
        :meth:`ZigzagEntries.applies` decides); any other batch's rows are gathered into token
        order, attended as above, and this rank's kept.

        Args:
            layer_id: the engine's layer id.
            q: ``[T, Hq * D]`` (or ``[T, Hq, D]``) this rank's query heads, ``T`` valid rows
                (with ``exchange``: this rank's rows, every head).
            k: ``[>= T, Hkv * D]`` the chunks' keys, packed in the batch's order (with
                ``exchange``: every rank's, token order).
            v: their values.
            indices: ``[T, 4 block_topk + 3]`` the indexer's token positions per query.
            slots: ``[>= T]`` the logical slot of each new token.
            extend_lens: each request's new tokens, summing to ``T``.
            seq_lens: each request's length with them (the first ``len(extend_lens)`` read).
            slot_table: ``[R, S]`` the engine's logical slot of each (table row, position).
            table_rows: ``[B]`` each request's row of ``slot_table``.
            scale: softmax scale.
            kernels: the engine's prefill kernels.
            exchange: the engine's context-parallel row exchange for this batch, or None.
            zigzag: this rank's entries when a context-parallel batch is one request.

        Returns:
            ``[T, Hq * D]`` attention output of this rank's heads, in ``q``'s dtype.
        """
        if exchange is not None:
            if zigzag is not None and ZigzagEntries.applies(
                len(extend_lens), seq_lens, extend_lens
            ):
                return self.extend_zigzag(
                    layer_id,
                    q,
                    k,
                    v,
                    indices,
                    slots=slots,
                    zigzag=zigzag,
                    scale=scale,
                    kernels=kernels,
                )
            mine = int(indices.shape[0])
            out = self.extend(
                layer_id,
                exchange.gather(q.reshape(mine, -1)),
                k,
                v,
                exchange.gather(indices),
                slots=slots,
                extend_lens=extend_lens,
                seq_lens=seq_lens,
                slot_table=slot_table,
                table_rows=table_rows,
                scale=scale,
                kernels=kernels,
            )
            return exchange.scatter(out)[:mine]
        tokens = int(indices.shape[0])
        self.write(layer_id, k[:tokens], v[:tokens], slots[:tokens])
        extend = [int(n) for n in extend_lens]
        lengths = [int(n) for n in seq_lens][: len(extend)]
        heads = q.reshape(tokens, -1, self.head_dim)
        if lengths == extend:
            out = attend_chunks(heads, k, v, indices, extend, scale, kernels)
            return out.reshape(tokens, -1).to(q.dtype)
        parts, start = [], 0
        for i, (length, count) in enumerate(zip(lengths, extend, strict=True)):
            rows = slice(start, start + count)
            positions = torch.arange(length - count, length, device=q.device)
            slot_row = slot_table[table_rows[i], :length]
            parts.append(
                self.prefill(layer_id, heads[rows], indices[rows], positions, slot_row, scale)
            )
            start += count
        return torch.cat(parts).to(q.dtype)

    def extend_zigzag(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        indices: torch.Tensor,
        *,
        slots: torch.Tensor,
        zigzag: ZigzagEntries,
        scale: float,
        kernels: PrefillKernels,
    ) -> torch.Tensor:
        """One request's whole prompt under zigzag context parallelism: this rank's rows.

        The gathered chunk's owned rows go to the store; this rank's zigzag rows attend over
        the chunk, which every rank holds whole (:func:`~qsa_kernels.context.attend_context`).

        Args:
            layer_id: the engine's layer id.
            q: ``[T, Hq * D]`` (or ``[T, Hq, D]``) this rank's zigzag rows, every head.
            k: ``[N, Hkv * D]`` (or ``[N, Hkv, D]``) the gathered chunk's keys, token order.
            v: its values.
            indices: ``[T, W]`` the indexer's token positions per row.
            slots: ``[>= N]`` the logical slot of each token of the chunk.
            zigzag: this rank's entries.
            scale: softmax scale.
            kernels: the engine's prefill kernels.

        Returns:
            ``[T, Hq * D]`` in ``q``'s dtype.
        """
        rows, tokens = int(indices.shape[0]), int(k.shape[0])
        self.write(layer_id, k, v, slots[:tokens])
        shape = (tokens, self.kv_heads, self.head_dim)
        heads = q.reshape(rows, -1, self.head_dim)
        out = attend_context(
            heads, k.reshape(shape), v.reshape(shape), indices, scale, kernels, zigzag=zigzag
        )
        return out.reshape(rows, -1).to(q.dtype)

    @staticmethod
    def transport_bytes(
        *,
        world_size: int,
        max_rows: int,
        block_topk: int,
        q_heads: int,
        head_dim: int,
        layout: HeadLayout = HeadLayout.SHARDED,
        index_sharded: bool = False,
    ) -> int:
        """Device bytes of one rank's transport buffers (decode and prefill), without allocating.

        With ``index_sharded`` (D2), the :class:`ShardedIndex` candidate buffers of the same
        group too (:meth:`ShardedIndex.rows_for` ``max_rows``): all a shard group allocates once,
        the fixed part of its pool price.
        """
        index = 0
        if index_sharded:
            index = ShardedIndex.candidate_bytes(
                world_size=world_size, block_topk=block_topk, max_running=max_rows
            )
        return index + sum(
            ShardedDecodeBuffers.for_rank(
                world_size,
                layout,
                max_rows=rows,
                block_topk=block_topk,
                q_heads=q_heads,
                head_dim=head_dim,
                device="meta",
            ).nbytes
            for rows in (max_rows, PREFILL_GROUP_ROWS)
        )
