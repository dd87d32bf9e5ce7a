"""The store of records of every KV head: QSA's block selection, and the shard group's own pages.

A record holds one 4-token block of every KV head (``[2, 4, Hkv, D]``), as QSA's indexer selects
blocks for all heads at once. :class:`OffloadedKV` adds to the shared data path
(:class:`~qsa_kernels.offload._store.OffloadStore`) what this layout alone does: a prompt admitted
after a cached prefix's records (:meth:`OffloadedKV.admit`, :meth:`OffloadedKV.export_prefix`),
attention over selected blocks and the open block (:meth:`OffloadedKV.attend`) and the count of
selected and missing blocks (``counters`` of :meth:`OffloadedKV.attend`).

Under a shard group (``shard``: ``N`` ranks holding the same K/V heads, e.g. the copies of one KV
head at TP > KV heads), each rank's arena stores only the blocks its placement gives it: whole
16-block pages, page ``p`` of a request on rank ``p % N`` (the compressed index's page
interleaving, :func:`qsa_kernels.sharded.localize_blocks`), so host bytes and fetches divide by
``N``. Every rank keeps the open-block tail; rank 0 alone attends it. :meth:`OffloadedKV.attend`
then returns this rank's partial, which :func:`qsa_kernels.sharded.merge_owner_partials` combines
across the group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS, TAIL_TOKENS
from qsa_kernels._path import KernelPath
from qsa_kernels.offload._store import OffloadGeometry, OffloadStore
from qsa_kernels.sharded import ShardGroup, localize_blocks

__all__ = ("OffloadedKV",)


class OffloadedKV(OffloadStore):
    """One rank's QSA K/V under host offload, one record per block of every KV head.

    Shapes: host arena ``[R, L, NB, 2, 4, Hkv, D]`` (``NB_local`` blocks under a shard group),
    hot caches ``[L, R, S, 2, 4, Hkv, D]``, tails ``[L, R, 1, 2, 4, Hkv, D]``; the rest of the
    contract (rows, steps, write-back, ``path``, ``shard``) is :class:`OffloadStore`'s.

    Args:
        geometry: the sizes, with ``per_head=False``.
        device: the device of the hot caches, tails and tables.
        path: the kernels' implementation.
        shard: this rank's shard group, or ``None``.

    Raises:
        KernelInputError: a geometry of per-head records (those are
            :class:`~qsa_kernels.offload.PerHeadOffloadedKV`'s).
    """

    def __init__(
        self,
        geometry: OffloadGeometry,
        device: torch.device,
        *,
        path: KernelPath = KernelPath.AUTO,
        shard: ShardGroup | None = None,
    ) -> None:
        if geometry.per_head:
            msg = (
                "OffloadedKV keeps every KV head in one record; got a geometry with "
                "per_head=True (per-head records are PerHeadOffloadedKV's)"
            )
            raise KernelInputError(msg)
        super().__init__(geometry, device, path=path, shard=shard)
        # One rank of a shard group attends the open block; the others read no tail token.
        self._attends_tail = self.shard is None or self.shard.rank == 0
        self._no_tail = torch.full(
            (geometry.rows, TAIL_TOKENS), -1, dtype=torch.int32, device=self.device
        )

    def admit(
        self,
        row: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        prefix: torch.Tensor | None = None,
    ) -> torch.cuda.Event | None:
        """Take a prefilled prompt into a free row: complete blocks to host, the open block to tail.

        With ``prefix`` (the records of a cached prefix, e.g. restored from a host prefix cache),
        the prompt is ``prefix`` followed by ``k``/``v``: the prefix records go to the row's first
        arena blocks as they are, and only the new tokens are offloaded after them.

        Args:
            row: a free request row.
            k: ``[L, T, Hkv, D]`` keys of every QSA layer for the tokens after the prefix
                (device, the geometry's dtype); ``T`` may be 0 only with a prefix.
            v: ``[L, T, Hkv, D]`` values.
            prefix: ``[L, P, 2, 4, Hkv, D]`` records of the first ``P`` complete blocks
                (``4 P`` tokens), any device, the geometry's dtype; ``None`` for no prefix.

        Returns:
            The copy's completion event, or None when it ran synchronously
            (:meth:`OffloadStore._admit`).
        """
        return self._admit(row, k, v, prefix)

    def export_prefix(self, row: int, blocks: int) -> torch.Tensor:
        """The records of a row's first ``blocks`` complete blocks, for a host prefix cache.

        Returns:
            ``[L, blocks, 2, 4, Hkv, D]`` contiguous host tensor (a copy; written back blocks only,
            so ``4 × blocks`` must not exceed the row's closed tokens).

        Raises:
            KernelInputError: under a shard group (this rank stores only its own pages), or
                ``blocks`` outside the row's complete blocks.
        """
        self.planner.check_row(row)
        if self.shard is not None:
            msg = (
                "export_prefix reads every block of a row; under a shard group of "
                f"{self.shard.world_size!r} ranks this rank stores only its own"
            )
            raise KernelInputError(msg)
        closed_blocks = self.planner.length(row) // BLOCK_TOKENS
        if not 0 < blocks <= closed_blocks:
            msg = (
                f"blocks={blocks!r} is not allowed for row {row!r}; allowed: 1..{closed_blocks!r} "
                "(its complete blocks)"
            )
            raise KernelInputError(msg)
        self.wait_for_host_writes()
        if self.device.type == "cuda":  # the host reads the arena: device writes must be done
            torch.cuda.current_stream(self.device).synchronize()
        return self.host_arena[row, :, :blocks].contiguous()

    def attend(
        self,
        layer: int,
        rows: Sequence[int],
        q: torch.Tensor,
        blocks: torch.Tensor,
        *,
        scale: float | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        counters: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer for ``B`` rows over their selected blocks and their open block.

        Under a shard group, over the selected blocks this rank stores (and the open block on
        rank 0): this rank's partial, ``(0, -inf)`` where it holds none of a row's tokens; ask
        for ``out_dtype=torch.float32`` to merge the partials without a bf16 rounding.

        Args:
            layer: QSA layer index in ``[0, L)``.
            rows: the step's rows (what the last :meth:`advance` returned).
            q: ``[B, Hq, D]`` bf16 queries.
            blocks: ``[B, K]`` int32 selected complete blocks (``-1`` padding), ``K <= S``; a
                padding row's entries must be ``-1`` (see :attr:`step_closed_blocks`).
            scale: softmax scale, ``1 / sqrt(D)`` if ``None``.
            out_dtype: dtype of ``out``: bf16, or fp32 for a later merge.
            counters: ``[2]`` int64 device tensor, or None: the fetch adds the selected blocks
                this rank stores and those that missed the hot cache (no host synchronisation;
                under a shard group, other ranks' blocks are not counted, so a group's counts
                add up to the selection).

        Returns:
            ``(out [B, Hq, D] out_dtype, lse [B, Hq] fp32)``, the attention over the selected
            blocks' tokens and the row's open-block tokens, natural-log LSE.
        """
        self._check_step("attend", layer, rows)
        if blocks.dim() != 2 or blocks.shape[0] != len(rows):
            msg = f"blocks must be [B={len(rows)}, K]; got {tuple(blocks.shape)!r}"
            raise KernelInputError(msg)
        blocks = blocks.to(torch.int32)
        if self.shard is not None:
            blocks = localize_blocks(blocks, self.shard.placement, self.shard.rank)
        slots = self._fetch(slice(layer, layer + 1), blocks.unsqueeze(1), counters)[:, 0]
        hot_tokens = torch.where(
            slots.unsqueeze(-1) >= 0, slots.unsqueeze(-1) * BLOCK_TOKENS + self._block_offsets, -1
        ).reshape(len(rows), -1)
        plan = self.planner.plan
        tail = plan.tail_tokens if self._attends_tail else self._no_tail[: len(rows)]
        return self._attend_parts(layer, q, hot_tokens, tail, scale, out_dtype=out_dtype)

    def _attend_parts(
        self,
        layer: int,
        q: torch.Tensor,
        hot_tokens: torch.Tensor,
        tail_tokens: torch.Tensor,
        scale: float | None,
        *,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over hot-cache tokens and tail-record tokens of one layer, LSE-merged.

        Both decodes' split-K parts merge in one LSE merge launch, so the output is rounded (to
        ``out_dtype``) once.
        """
        g = self.geometry
        hot, tail = (
            self._kernels.decode(q, tokens, cache, scale=scale, merged=False)
            for tokens, cache in (
                (hot_tokens, self.hot[layer].view(g.rows * g.hot_slots, *g.record_shape)),
                (tail_tokens, self.tail[layer].view(g.rows, *g.record_shape)),
            )
        )
        return self._kernels.merge(*hot, out_dtype=out_dtype, more=tail)  # no concatenation
