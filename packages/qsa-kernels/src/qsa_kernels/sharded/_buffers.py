"""Static transport buffers of the sharded decode path, allocated once and shared by all layers.

Every per-step tensor the sharded path communicates lives in one of these flat buffers, sized for
``max_rows`` decode rows. A step with ``B <= max_rows`` rows uses the first ``B``-row prefix of
each buffer (a contiguous view at a fixed address), so a CUDA graph captured for a batch bucket
replays on the same memory. QSA layers run one after another, so one set serves every layer (as
upstream's shared collective arena). The K/V and index shards themselves are not here: they are
the cache pools.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS, TAIL_TOKENS

__all__ = ("PREFILL_GROUP_ROWS", "CollectiveBytes", "HeadLayout", "ShardedDecodeBuffers")

#: Query tokens of a prefill chunk after a prefix that attend in one owner-side round.
PREFILL_GROUP_ROWS = 256

_CANDIDATE_WORDS = 2  # fp32 score, int32 global block id (bit-cast to fp32)


class HeadLayout(enum.Enum):
    """How the query heads of one KV head's group are spread over the shard group.

    Attributes:
        REPLICATED: every rank holds all ``Hq`` query heads of the group; each rank's partial
            ``(out, lse)`` for all heads is all-gathered and every rank merges all heads (output
            replicated). Two collectives per layer: candidates, partials.
        SHARDED: rank ``r`` holds query heads ``[r * Hq / N, (r + 1) * Hq / N)`` (the TP head
            shard). The queries are all-gathered, each rank attends all ``Hq`` heads over the
            tokens it owns, and an all-to-all returns every rank the partials of its own heads,
            which it merges (output head-sharded, as ``o_proj`` wants it). Three collectives per
            layer: candidates, queries, partials.
    """

    REPLICATED = "replicated"
    SHARDED = "sharded"


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveBytes:
    """Bytes one rank puts into / gets out of each collective of one layer's decode step.

    Attributes:
        candidates_send: the local top-k, ``B * topk * 8`` (all-gather input).
        candidates_recv: ``N * candidates_send`` (all-gather output).
        queries_send: the rank's query heads, ``B * (Hq / N) * D * 2`` (SHARDED only, else 0).
        queries_recv: ``N * queries_send``.
        partials_send: fp32 output plus LSE, ``B * Hq * (D + 1) * 4`` (both layouts).
        partials_recv: REPLICATED ``N * partials_send`` (all-gather); SHARDED ``partials_send``
            (all-to-all; ``(N - 1) / N`` of it crosses the wire).
    """

    candidates_send: int
    candidates_recv: int
    queries_send: int
    queries_recv: int
    partials_send: int
    partials_recv: int

    @property
    def total_send(self) -> int:
        """Bytes this rank contributes per layer per step."""
        return self.candidates_send + self.queries_send + self.partials_send

    @property
    def total_recv(self) -> int:
        """Bytes this rank receives per layer per step (own contribution included)."""
        return self.candidates_recv + self.queries_recv + self.partials_recv


def _positive(name: str, value: int) -> None:
    checked: object = value  # callers may be untyped
    if isinstance(checked, bool) or not isinstance(checked, int) or checked < 1:
        msg = f"{name}={value!r} must be a positive int"
        raise KernelInputError(msg)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardedDecodeBuffers:
    """Preallocated flat buffers for one rank's sharded decode steps (``N`` ranks).

    Attributes:
        world_size: ranks ``N`` in the shard group.
        max_rows: most decode rows (query tokens) per step.
        topk: blocks selected per row (512 for QSA).
        q_heads: query heads ``Hq`` of one KV head's group across the shard group (12 for
            Qwen3.8-Flash-Next at TP >= 2).
        head_dim: ``D`` (256).
        layout: the query-head layout.
        candidate_send: ``[max_rows * topk * 2]`` fp32.
        candidate_recv: ``[N * max_rows * topk * 2]`` fp32.
        query_send: ``[max_rows * Hq / N * D]`` bf16 (empty for REPLICATED).
        query_recv: ``[N * max_rows * Hq / N * D]`` bf16 (empty for REPLICATED).
        positions: ``[max_rows * (4 * topk + 3)]`` int32 selected token positions.
        local_slots: ``[max_rows * (4 * topk + 3)]`` int32 owned local token slots, compacted to
            the front of each row (the full width is the worst case: every token on one rank).
        partial_send: ``[max_rows * Hq * (D + 1)]`` fp32.
        partial_recv: ``[N * max_rows * Hq * (D + 1)]`` (REPLICATED) or ``[max_rows * Hq * (D +
            1)]`` (SHARDED) fp32.
    """

    world_size: int
    max_rows: int
    topk: int
    q_heads: int
    head_dim: int
    layout: HeadLayout
    candidate_send: torch.Tensor
    candidate_recv: torch.Tensor
    query_send: torch.Tensor
    query_recv: torch.Tensor
    positions: torch.Tensor
    local_slots: torch.Tensor
    partial_send: torch.Tensor
    partial_recv: torch.Tensor

    @classmethod
    def allocate(
        cls,
        *,
        world_size: int,
        max_rows: int,
        topk: int,
        q_heads: int,
        head_dim: int,
        layout: HeadLayout,
        device: torch.device | str,
    ) -> ShardedDecodeBuffers:
        """Allocate the buffers (uninitialised; every step writes what it reads).

        Raises:
            KernelInputError: a non-positive size, or SHARDED with ``Hq % N != 0``.
        """
        for name, value in (
            ("world_size", world_size),
            ("max_rows", max_rows),
            ("topk", topk),
            ("q_heads", q_heads),
            ("head_dim", head_dim),
        ):
            _positive(name, value)
        layout_obj: object = layout  # callers may be untyped
        if not isinstance(layout_obj, HeadLayout):
            msg = f"layout={layout!r}; allowed: {list(HeadLayout)!r}"
            raise KernelInputError(msg)
        if layout is HeadLayout.SHARDED and q_heads % world_size:
            msg = (
                f"q_heads={q_heads!r} must be a multiple of world_size={world_size!r} for "
                f"{HeadLayout.SHARDED!r}"
            )
            raise KernelInputError(msg)
        dev = torch.device(device)
        n, rows = world_size, max_rows
        cand = rows * topk * _CANDIDATE_WORDS
        tokens = rows * (BLOCK_TOKENS * topk + TAIL_TOKENS)
        partial = rows * q_heads * (head_dim + 1)
        sharded = layout is HeadLayout.SHARDED
        query = rows * (q_heads // n) * head_dim if sharded else 0

        def f32(size: int) -> torch.Tensor:
            return torch.empty(size, dtype=torch.float32, device=dev)

        return cls(
            world_size=n,
            max_rows=rows,
            topk=topk,
            q_heads=q_heads,
            head_dim=head_dim,
            layout=layout,
            candidate_send=f32(cand),
            candidate_recv=f32(n * cand),
            query_send=torch.empty(query, dtype=torch.bfloat16, device=dev),
            query_recv=torch.empty(n * query, dtype=torch.bfloat16, device=dev),
            positions=torch.empty(tokens, dtype=torch.int32, device=dev),
            local_slots=torch.empty(tokens, dtype=torch.int32, device=dev),
            partial_send=f32(partial),
            partial_recv=f32(partial if sharded else n * partial),
        )

    @classmethod
    def for_rank(
        cls,
        world_size: int,
        layout: HeadLayout,
        *,
        max_rows: int,
        block_topk: int,
        q_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> ShardedDecodeBuffers:
        """The buffers of a rank whose attention layers hold ``q_heads`` query heads.

        The group attends ``world_size x q_heads`` heads where the heads are split over its ranks
        (SHARDED), ``q_heads`` where every rank holds them all (REPLICATED). ``device="meta"``
        sizes them without allocating.

        Raises:
            KernelInputError: as :meth:`allocate`.
        """
        group_heads = q_heads * world_size if layout is HeadLayout.SHARDED else q_heads
        return cls.allocate(
            world_size=world_size,
            max_rows=max_rows,
            topk=block_topk,
            q_heads=group_heads,
            head_dim=head_dim,
            layout=layout,
            device=device,
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        parts = (
            self.candidate_send,
            self.candidate_recv,
            self.query_send,
            self.query_recv,
            self.positions,
            self.local_slots,
            self.partial_send,
            self.partial_recv,
        )
        return sum(t.numel() * t.element_size() for t in parts)

    def check_rows(self, rows: int) -> None:
        """Raise :class:`KernelInputError` unless ``0 <= rows <= max_rows``."""
        if not 0 <= rows <= self.max_rows:
            msg = f"rows={rows!r} is outside 0..max_rows={self.max_rows!r}"
            raise KernelInputError(msg)

    def collective_bytes(self, rows: int) -> CollectiveBytes:
        """Bytes each collective moves for one rank in a step of ``rows`` rows."""
        self.check_rows(rows)
        n = self.world_size
        cand = rows * self.topk * _CANDIDATE_WORDS * 4
        sharded = self.layout is HeadLayout.SHARDED
        query = rows * (self.q_heads // n) * self.head_dim * 2 if sharded else 0
        partial = rows * self.q_heads * (self.head_dim + 1) * 4
        return CollectiveBytes(
            candidates_send=cand,
            candidates_recv=n * cand,
            queries_send=query,
            queries_recv=n * query,
            partials_send=partial,
            partials_recv=partial if sharded else n * partial,
        )
