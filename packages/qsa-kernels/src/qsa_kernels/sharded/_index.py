"""One rank's share of the compressed QSA index (D2): its pages, its writes, its selection.

The compressed index is sharded by 16-block page (page ``p`` on rank ``p % N`` at local page
``p // N``, :class:`qsa_core.ShardPlacement`): a rank stores ``ceil(P / N)`` pages of a
``P``-page index (``placement.local_capacity(P)``) and scores only those.
:class:`ShardedIndex` gives an engine the two operations it needs, in the engine's own terms:
a write of closed blocks by logical block slot that keeps only the owned ones
(:meth:`ShardedIndex.write`), and the block top-k of any number of query rows (decode rows,
or prefill rows as decode rows of their positions) through :func:`sharded_indexer_topk` in
groups of ``max_rows`` rows (:meth:`ShardedIndex.select`, its rows from an engine's slot table
or decode page table by :meth:`ShardedIndex.prefill_rows` / :meth:`ShardedIndex.decode_rows`).
An engine whose prefill selection is a second call after the one that computes its rows' key
ranges holds the rows between the two (:meth:`ShardedIndex.prefill_inputs`, then
:meth:`ShardedIndex.select_prefill` with the same row starts); a decode selection is one call
(:meth:`ShardedIndex.select_decode`).
An engine that builds the whole index in its own constructor builds it under
:class:`ZerosOnMeta` (no memory) and puts a rank's :class:`IndexShard` in its place.
Every rank of the group must call :meth:`ShardedIndex.select` with the same rows (the
candidate all-gather pairs up group by group), as tensor-parallel ranks do. A prefill whose ranks
each bring their own rows (context parallelism: each rank its zigzag rows) says so to
:meth:`ShardedIndex.prefill_inputs` (``own_rows``): the group then selects for the union of its
ranks' rows, in rank order, and each rank keeps its own rows' selections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement, format_bytes
from qsa_kernels._errors import KernelInputError
from qsa_kernels._path import KernelPath
from qsa_kernels.sharded._buffers import PREFILL_GROUP_ROWS, HeadLayout, ShardedDecodeBuffers
from qsa_kernels.sharded._group import ShardGroup, all_gather_rows, group_row_counts
from qsa_kernels.sharded._layout import local_index_table
from qsa_kernels.sharded._topk import sharded_indexer_topk
from qsa_kernels.sharded._writes import index_write_targets, write_owned_index_blocks

__all__ = ("IndexRows", "IndexShard", "ShardedIndex", "ZerosOnMeta")


@dataclass(frozen=True, slots=True)
class IndexShard:
    """One layer's compressed index under a placement: its pages and one rank's share.

    Attributes:
        placement: the page placement (``blocks_per_page`` blocks of ``compress_ratio`` tokens).
        logical_pages: ``P``, pages of the whole index.
    """

    placement: ShardPlacement
    logical_pages: int

    @classmethod
    def of(
        cls, world_size: int, *, blocks_per_page: int, compress_ratio: int, capacity_blocks: int
    ) -> IndexShard:
        """The shard of an index of ``capacity_blocks`` blocks over ``world_size`` ranks.

        Raises:
            KernelInputError: pages other than the index kernels' (16 blocks of 4 tokens).
        """
        want = (QWEN38_FLASH_NEXT.blocks_per_page, QWEN38_FLASH_NEXT.compress_ratio)
        if (blocks_per_page, compress_ratio) != want:
            msg = (
                f"index sharding needs compressed pages of {want[0]} blocks of {want[1]} tokens; "
                f"the index has {blocks_per_page!r} blocks of {compress_ratio!r}"
            )
            raise KernelInputError(msg)
        placement = ShardPlacement(world_size, blocks_per_page, compress_ratio)
        return cls(placement, -(-capacity_blocks // blocks_per_page))

    @staticmethod
    def whole_shape(
        *, layers: int, slots: int, compress_ratio: int, heads: int, dim: int
    ) -> tuple[int, int]:
        """``(L, C * H * D)``: an unsharded index of ``layers`` layers over ``slots`` token slots.

        ``C = ceil(slots / compress_ratio)`` blocks per layer, each ``heads x dim`` elements: the
        whole buffer an engine's constructor allocates (and :class:`ZerosOnMeta` diverts).
        """
        blocks = -(-slots // compress_ratio)
        return layers, blocks * heads * dim

    @property
    def local_pages(self) -> int:
        """Pages one rank stores: ``ceil(P / N)`` (page ``p`` at local page ``p // N``)."""
        return self.placement.local_capacity(self.logical_pages)

    @property
    def local_blocks(self) -> int:
        """Blocks one rank stores per layer: ``local_pages * blocks_per_page``."""
        return self.local_pages * self.placement.blocks_per_page

    def allocate(
        self, *, layers: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A rank's compressed keys of ``layers`` layers, zeros, in one allocation.

        Returns:
            ``[L, local_blocks * H * D]`` ``dtype``, and each layer's ``[local_blocks, H, D]``
            view of it.
        """
        blocks = self.local_blocks
        flat = torch.zeros((layers, blocks * heads * dim), dtype=dtype, device=device)
        return flat, [flat[layer].view(blocks, heads, dim) for layer in range(layers)]

    def describe(self, *, layers: int, block_bytes: int) -> str:
        """One line of a rank's share for ``layers`` layers of ``block_bytes``-byte blocks."""
        page = self.placement.blocks_per_page
        return (
            f"compressed index {format_bytes(layers * self.local_blocks * block_bytes)} per rank "
            f"({self.local_pages} of {self.logical_pages} pages of {page} blocks, {layers} "
            f"layers; unsharded {format_bytes(layers * self.logical_pages * page * block_bytes)})"
        )


@dataclass(frozen=True, slots=True)
class IndexRows:
    """The query rows of one selection, as :meth:`ShardedIndex.select` takes them.

    Attributes:
        page_table: ``[B, P]`` int logical compressed page ids of each row's request.
        seq_lens: ``[B]`` int64 tokens each row sees.
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(frozen=True, slots=True)
class _HeldPrefill:
    """One layer's prefill rows between :meth:`ShardedIndex.prefill_inputs` and the selection."""

    row_starts: torch.Tensor  # the tensor prefill_inputs returned (identifies the call)
    local_index: torch.Tensor  # [P_local, 16, Dk]
    rows: IndexRows  # every rank's rows, in rank order, with own_rows
    counts: tuple[int, ...] | None  # each rank's rows with own_rows, else None
    own: slice  # this rank's rows of ``rows``


class ZerosOnMeta(TorchFunctionMode):
    """While active, ``torch.zeros`` of ``shape`` allocates on the meta device (no memory).

    Every other call is untouched; :attr:`diverted` counts the diverted ones, so an engine can
    refuse a constructor that no longer allocates the buffer it expects.
    """

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = shape
        self.diverted = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and _shape_of(args) == self.shape:
            self.diverted += 1
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _shape_of(args: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The shape a factory call's positional arguments give: ``(2, 3)`` or ``2, 3``."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    if all(isinstance(n, int) for n in args):
        return tuple(args)
    return None  # a SymInt or another form: not a shape this mode diverts


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
        self._held: _HeldPrefill | None = None
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

    @classmethod
    def candidate_bytes(cls, *, world_size: int, block_topk: int, max_running: int) -> int:
        """:meth:`buffer_bytes_for` an index serving ``max_running`` decode rows (pool sizing).

        The candidate buffers an engine's index allocates (:meth:`rows_for` rows), the fixed
        bytes of a page-sharded index (``qsa_core.IndexBufferBytes``).
        """
        return cls.buffer_bytes_for(
            world_size=world_size, block_topk=block_topk, max_rows=cls.rows_for(max_running)
        )

    def local_view(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[P_local, 16, H * D]``: a view of ``[16 P_local, H, D]`` or ``[P_local, 16, H, D]``."""
        page = self.shard.placement.blocks_per_page
        return buffer.view(-1, page, buffer.shape[-2] * buffer.shape[-1])

    def prefill_rows(
        self, slot_table: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor
    ) -> IndexRows:
        """The rows of prefill query tokens, each a decode row of its position.

        Args:
            slot_table: ``[R, S]`` int the engine's token slot of each (request row, position),
                its pages slot-aligned (negative: none).
            requests: ``[B]`` int each query token's row of ``slot_table``.
            positions: ``[B]`` int each query token's position in its request.
        """
        page_tokens = self.shard.placement.blocks_per_page * self.shard.placement.compress_ratio
        pages = slot_table[:, ::page_tokens].long().clamp_min(0) // page_tokens
        return IndexRows(pages.index_select(0, requests.long()), positions.long() + 1)

    def decode_rows(self, page_table: torch.Tensor, closed_blocks: torch.Tensor) -> IndexRows:
        """Decode rows: ``page_table [B, P]`` page ids, ``closed_blocks [B]`` complete blocks."""
        seq_lens = closed_blocks.to(torch.int64) * self.shard.placement.compress_ratio
        return IndexRows(page_table, seq_lens)

    def write(
        self, local_index: torch.Tensor, block_slots: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Store the closed blocks this rank owns, in place; the others are dropped.

        No host synchronisation, fixed shapes (CUDA-graph capturable).

        Args:
            local_index: ``[P_local, 16, Dk]`` this rank's index shard of one layer, contiguous.
            block_slots: ``[M]`` int32/int64 logical compressed block slots (``raw slot // 4``),
                negative for padding rows.
            rows: ``[M, Dk]`` (or ``[M, H, D]``) the closed blocks' keys, cast to
                ``local_index``'s dtype.

        Raises:
            KernelInputError: bad shapes.
        """
        targets = index_write_targets(block_slots, self.shard.placement, self.shard.rank)
        rows = rows.reshape(block_slots.shape[0], -1).to(local_index.dtype)
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

    def prefill_inputs(
        self,
        index_buffer: torch.Tensor,
        slot_table: torch.Tensor,
        positions: torch.Tensor,
        requests: torch.Tensor,
        *,
        row_ranges: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        own_rows: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's prefill rows: their key ranges, the rows held for :meth:`select_prefill`.

        With ``own_rows`` (a context-parallel prefill: each rank of the group brings its own
        rows, any number) every rank holds the union of the group's rows in rank order, so the
        candidate all-gathers of :meth:`select_prefill` pair up; one all-gather of the row
        counts (a host read) and one of the rows' ``(request, position)`` pairs (16 bytes a row).

        Args:
            index_buffer: this rank's index shard of the layer (as :meth:`local_view` takes it).
            slot_table: ``[R, S]`` int the engine's token slots (as :meth:`prefill_rows`).
            positions: ``[T']`` int each query token's position, ``T' >= T`` (padding past
                ``T`` is dropped); moved to ``requests``' device.
            requests: ``[T]`` int each query token's row of ``slot_table``, on the device the
                row ranges are computed on.
            row_ranges: the engine's key ranges of query rows: ``(positions [T], requests [T])``
                -> ``(row_starts [T], row_ends [T])``.
            own_rows: each rank selects for its own rows (all ranks must say the same); False:
                every rank brings the same rows.

        Returns:
            ``(row_starts [T], row_ends [T])`` of ``row_ranges``; ``row_starts`` identifies
            these rows to :meth:`select_prefill`, which must come next.

        Raises:
            KernelInputError: fewer positions than query tokens.
        """
        rows = requests.numel()
        if positions.numel() < rows:
            msg = (
                f"prefill positions are shorter than the query rows: positions="
                f"{positions.numel()!r}, rows={rows!r}"
            )
            raise KernelInputError(msg)
        positions = positions[:rows].to(requests.device)
        row_starts, row_ends = row_ranges(positions, requests)
        counts, own = None, slice(None)
        if own_rows:
            counts = group_row_counts(self.shard, rows, requests.device)
            before = sum(counts[: self.shard.rank])
            own = slice(before, before + rows)
            pairs = torch.stack([requests.long(), positions.long()], dim=1)
            requests, positions = all_gather_rows(self.shard, pairs, counts).unbind(1)
        held = self.prefill_rows(slot_table, requests, positions)
        self._held = _HeldPrefill(row_starts, self.local_view(index_buffer), held, counts, own)
        return row_starts, row_ends

    def select_prefill(
        self, row_starts: torch.Tensor, q: torch.Tensor, *, heads: int
    ) -> torch.Tensor:
        """:meth:`select` of the rows :meth:`prefill_inputs` returned ``row_starts`` for.

        With ``own_rows`` the group's queries are all-gathered first (``heads x D`` elements a
        row) and the union selected; each rank returns its own rows.

        Args:
            row_starts: the tensor :meth:`prefill_inputs` returned (the same object).
            q: ``[T, >= heads, D]`` index queries of this rank's rows; the first ``heads`` are
                the indexer's.
            heads: the indexer's query heads.

        Returns:
            ``[T, block_topk]`` int32 block ids of this rank's rows, as :meth:`select`.

        Raises:
            KernelInputError: ``row_starts`` are not the held rows' (none held, or another
                call's): the keys would be read at logical slots of a rank-local shard.
        """
        held, self._held = self._held, None
        if held is None or held.row_starts is not row_starts:
            msg = (
                "a prefill selection whose row ranges are not the ones prefill_inputs returned; "
                "its keys would be read at logical slots of a rank-local shard"
            )
            raise KernelInputError(msg)
        queries = q[:, :heads].contiguous()
        if held.counts is not None:
            queries = all_gather_rows(self.shard, queries, held.counts)
        blocks = self.select(queries, held.local_index, held.rows.page_table, held.rows.seq_lens)
        return blocks[held.own]

    def select_decode(
        self,
        q: torch.Tensor,
        index_buffer: torch.Tensor,
        page_table: torch.Tensor,
        closed_blocks: torch.Tensor,
        *,
        heads: int,
    ) -> torch.Tensor:
        """:meth:`select` of decode rows (:meth:`decode_rows`); capturable.

        Args:
            q: ``[B, >= heads, D]`` index queries; the first ``heads`` are the indexer's (an
                engine may pad them with zero heads).
            index_buffer: this rank's index shard of the layer (as :meth:`local_view` takes it).
            page_table: ``[B, P]`` int logical compressed page ids.
            closed_blocks: ``[B]`` int complete blocks of each row.
            heads: the indexer's query heads.

        Returns:
            ``[B, block_topk]`` int32 block ids, as :meth:`select`.
        """
        rows = self.decode_rows(page_table, closed_blocks)
        local = self.local_view(index_buffer)
        queries = q[:, :heads].contiguous()
        return self.select(queries, local, rows.page_table, rows.seq_lens)
