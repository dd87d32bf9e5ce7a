"""One rank's share of the compressed QSA index (D2): its pages, its writes, its selection.

The compressed index is sharded by 16-block page (page ``p`` on rank ``p % N`` at local page
``p // N``, :class:`qsa_core.ShardPlacement`): a rank stores ``ceil(P / N)`` pages of a
``P``-page index (``placement.local_capacity(P)``) and scores only those.
:class:`ShardedIndex` gives an engine the two operations it needs, in the engine's own terms:
a write of closed blocks by logical block slot that keeps only the owned ones
(:meth:`ShardedIndex.write`), and the block top-k of any number of query rows (decode rows,
or prefill rows as decode rows of their positions) through :func:`sharded_indexer_topk` in
groups of ``max_rows`` rows (:meth:`ShardedIndex.select`).
Every rank of the group must call :meth:`ShardedIndex.select` with the same rows (the
candidate all-gather pairs up group by group), as tensor-parallel ranks do.
"""

from __future__ import annotations

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._path import KernelPath
from qsa_kernels.sharded._buffers import PREFILL_GROUP_ROWS, HeadLayout, ShardedDecodeBuffers
from qsa_kernels.sharded._group import ShardGroup
from qsa_kernels.sharded._layout import local_index_table
from qsa_kernels.sharded._topk import sharded_indexer_topk
from qsa_kernels.sharded._writes import index_write_targets, write_owned_index_blocks

__all__ = ("ShardedIndex",)


class ShardedIndex:
    """One rank's compressed-index shard operations and its candidate buffers.

    Attributes:
        shard: this rank's shard group (``shard.placement`` pages the index).
        block_topk: blocks each row selects (the indexer's ``budget / compress_ratio``).
        buffers: the candidate all-gather buffers, ``max_rows`` rows per group.
        path: kernels or references for scoring and merge.
    """

    def __init__(
        self,
        shard: ShardGroup,
        *,
        block_topk: int,
        max_rows: int,
        device: torch.device | str,
        path: KernelPath = KernelPath.AUTO,
    ) -> None:
        """Allocate the candidate buffers for ``max_rows`` rows of ``block_topk`` blocks.

        Raises:
            KernelInputError: a non-positive ``block_topk`` or ``max_rows``.
        """
        self.shard = shard
        self.block_topk = block_topk
        self.path = path
        # Selection uses only the candidate buffers; the attention parts are one element wide.
        self.buffers = ShardedDecodeBuffers.allocate(
            world_size=shard.world_size,
            max_rows=max_rows,
            topk=block_topk,
            q_heads=1,
            head_dim=1,
            layout=HeadLayout.REPLICATED,
            device=device,
        )

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the candidate buffers (allocated once, shared by every layer)."""
        return self.buffers.nbytes

    @staticmethod
    def rows_for(max_running: int) -> int:
        """Rows of one candidate all-gather: every decode row, or one prefill group."""
        return max(max_running, PREFILL_GROUP_ROWS)

    @staticmethod
    def buffer_bytes_for(*, world_size: int, block_topk: int, max_rows: int) -> int:
        """What :attr:`buffer_bytes` will be, without allocating (for pool sizing)."""
        return ShardedDecodeBuffers.allocate(
            world_size=world_size,
            max_rows=max_rows,
            topk=block_topk,
            q_heads=1,
            head_dim=1,
            layout=HeadLayout.REPLICATED,
            device="meta",
        ).nbytes

    def write(
        self, local_index: torch.Tensor, block_slots: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Store the closed blocks this rank owns, in place; the others are dropped.

        No host synchronisation, fixed shapes (CUDA-graph capturable).

        Args:
            local_index: ``[P_local, 16, Dk]`` this rank's index shard of one layer, contiguous.
            block_slots: ``[M]`` int32/int64 logical compressed block slots (``raw slot // 4``),
                negative for padding rows.
            rows: ``[M, Dk]`` the closed blocks' keys, ``local_index``'s dtype.

        Raises:
            KernelInputError: bad shapes or dtypes.
        """
        targets = index_write_targets(block_slots, self.shard.placement, self.shard.rank)
        write_owned_index_blocks(local_index, targets, rows)

    def select(
        self,
        q: torch.Tensor,
        local_index: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """The global block top-k of each row, identical on every rank of the group.

        Collective: one candidate all-gather of ``rows * block_topk * 8`` bytes per rank for
        every group of ``max_rows`` rows.

        Args:
            q: ``[B, 4, 128]`` bf16/fp8 index queries, the same on every rank.
            local_index: ``[P_local, 16, 128]`` this rank's index shard of the layer.
            page_table: ``[B, P]`` int32/int64 logical compressed page ids of each row's request
                (``token slot // 64`` of its page-aligned slots).
            seq_lens: ``[B]`` int32/int64 tokens each row sees (query position + 1).

        Returns:
            ``[B, block_topk]`` int32 request-relative block ids, best first, ``-1`` after a
            row's ``min(seq_lens // 4, block_topk)`` valid ones.

        Raises:
            KernelInputError: ``page_table`` or ``seq_lens`` rows that do not match ``q``.
        """
        rows = q.shape[0]
        if page_table.dim() != 2 or page_table.shape[0] != rows or seq_lens.shape != (rows,):
            msg = (
                f"page_table must be [B={rows}, P] and seq_lens [B={rows}]; got "
                f"{tuple(page_table.shape)!r} and {tuple(seq_lens.shape)!r}"
            )
            raise KernelInputError(msg)
        out = torch.empty((rows, self.block_topk), dtype=torch.int32, device=q.device)
        step = self.buffers.max_rows
        for start in range(0, rows, step):
            part = slice(start, min(start + step, rows))
            table = local_index_table(
                page_table[part], seq_lens[part], self.shard.placement, self.shard.rank
            )
            merged = sharded_indexer_topk(
                q[part],
                local_index,
                table,
                shard=self.shard,
                buffers=self.buffers,
                path=self.path,
            )
            out[part] = merged.ids
        return out
