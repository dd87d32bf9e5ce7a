"""The whole compressed index by logical block row, read and written through one rank's shard.

A host prefix cache checkpoints a prompt's index rows and restores them into the rows of new
token slots, by logical block row (``token slot // compress_ratio``). Under index sharding (D2)
page ``p`` of the index lives on rank ``p % N`` only, and a restore's new rows have other owners
than the published ones, so a checkpoint keeps every row on every rank (the index is small next
to the K/V) and :class:`ShardedIndexAccess` moves rows between that whole form and the shard:

- :meth:`ShardedIndexAccess.read` (collective): each rank sends the requested rows it owns (one
  :func:`all_gather_rows` of every layer's bytes), and every rank returns every row;
- :meth:`ShardedIndexAccess.write` (local): each rank stores the rows it owns
  (:meth:`ShardedIndex.write`), the others are dropped.

Its ``device``, ``read`` and ``write`` are what ``qsa_hostcache.IndexAccess`` asks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels.sharded._group import all_gather_rows
from qsa_kernels.sharded._index import ShardedIndex
from qsa_kernels.sharded._writes import index_write_targets

__all__ = ("ShardedIndexAccess",)


class ShardedIndexAccess:
    """Every layer's compressed index by logical block row, over one rank's shards of it.

    Args:
        index: this rank's index shard operations (its group and placement).
        buffers: each layer's shard of this rank, ``[16 * P_local, H, D]`` (or
            ``[P_local, 16, H, D]``), contiguous, one dtype and device.

    Raises:
        KernelInputError: no buffers, or buffers of other shapes, dtypes or devices than the
            first's, or a first dimension that is not whole pages.
    """

    def __init__(self, index: ShardedIndex, buffers: Sequence[torch.Tensor]) -> None:
        self.index = index
        self.buffers = tuple(buffers)
        if not self.buffers:
            raise KernelInputError("ShardedIndexAccess needs at least one layer's buffer")
        first = self.buffers[0]
        page = index.shard.placement.blocks_per_page
        for layer, buf in enumerate(self.buffers):
            same = (buf.shape, buf.dtype, buf.device) == (first.shape, first.dtype, first.device)
            if not same or not buf.is_contiguous() or buf.dim() < 3:
                msg = (
                    f"layer {layer}'s index shard must be a contiguous buffer like layer 0's "
                    f"{tuple(first.shape)!r} {first.dtype!r} on {first.device}; got "
                    f"{tuple(buf.shape)!r} {buf.dtype!r} on {buf.device}"
                )
                raise KernelInputError(msg)
        blocks = first.numel() // (first.shape[-2] * first.shape[-1])
        if blocks % page:
            msg = f"an index shard holds whole pages of {page} blocks; got {blocks!r} blocks"
            raise KernelInputError(msg)

    @property
    def device(self) -> torch.device:
        """Where the shards live; rows are read to and written from there."""
        return self.buffers[0].device

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Every requested row of every layer, gathered from the ranks that own them.

        Collective: every rank of the shard group calls it at once with the same ``rows``; one
        :func:`all_gather_rows` of the rows each rank owns (``L * H * D`` elements a row, sent as
        bytes, so any dtype), after one host synchronisation (the owners' row counts, which every
        rank computes alike from ``rows``).

        Args:
            rows: ``[R]`` int logical compressed block rows (page ``row // 16``); a negative
                row has no owner and reads as zeros.

        Returns:
            ``[R, L, H, D]`` the buffers' dtype on :attr:`device`: what the unsharded index
            holds at ``rows``, the same on every rank.

        Raises:
            KernelInputError: ``rows`` is not 1-D.
        """
        if rows.dim() != 1:
            msg = f"rows must be [R]; got shape {tuple(rows.shape)!r}"
            raise KernelInputError(msg)
        shard, first = self.index.shard, self.buffers[0]
        n, page = shard.world_size, shard.placement.blocks_per_page
        rows = rows.to(device=self.device, dtype=torch.int64)
        count, width = rows.shape[0], first.shape[-2] * first.shape[-1]
        owner = torch.where(rows >= 0, torch.remainder(rows // page, n), n)  # n: no owner
        owned = torch.bincount(owner, minlength=n + 1)[:n].tolist()  # the same on every rank
        out = torch.zeros((count, len(self.buffers), width), dtype=first.dtype, device=self.device)
        if max(owned) > 0:  # else nothing to gather (every rank sees the same rows, so none does)
            targets = index_write_targets(rows, shard.placement, shard.rank)
            mine = targets.local[targets.owned]  # in row order
            sent = torch.stack([buf.view(-1, width)[mine] for buf in self.buffers], 1)
            gathered = all_gather_rows(shard, sent, owned)  # rank 0's rows, then rank 1's...
            for rank, part in enumerate(torch.split(gathered, owned)):
                out[owner == rank] = part
        return out.view(count, len(self.buffers), *first.shape[-2:])

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Store the rows this rank owns of every layer into its shards; drop the others.

        Local (no collective): :meth:`ShardedIndex.write` of each layer, in bytes.

        Args:
            rows: ``[R]`` int logical compressed block rows (negative: written nowhere).
            values: ``[R, L, H, D]`` (or ``[R, L, H * D]``) every layer's values of ``rows``,
                cast to the buffers' dtype.

        Raises:
            KernelInputError: ``values`` does not hold ``R`` rows of every layer.
        """
        if values.dim() < 2 or values.shape[:2] != (rows.shape[0], len(self.buffers)):
            msg = (
                f"values must be [R={rows.shape[0]}, L={len(self.buffers)}, H, D]; got "
                f"{tuple(values.shape)!r}"
            )
            raise KernelInputError(msg)
        count, first = rows.shape[0], self.buffers[0]
        rows, values = rows.to(self.device), values.to(device=self.device, dtype=first.dtype)
        for layer, buf in enumerate(self.buffers):  # as bytes: any dtype (fp8 too) on any device
            part = values[:, layer].reshape(count, -1).contiguous().view(torch.uint8)
            self.index.write(self.index.local_view(buf.view(torch.uint8)), rows, part)
