"""Zigzag CP row plan as torch index tensors, and the local (collective-free) row permutations.

The arithmetic is :class:`qsa_core.ZigzagLayout`'s; this module only turns it into ``int64`` index
tensors on one device, once per batch, so every permutation is a single ``index_select``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qsa_core import ZigzagLayout
from qsa_kernels._errors import KernelInputError

__all__ = (
    "CPRowPlan",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_to_rank_major",
    "zigzag_unshard",
)


@dataclass(frozen=True, slots=True)
class CPRowPlan:
    """Index tensors of one :class:`qsa_core.ZigzagLayout` on one device.

    ``N`` is ``layout.total_rows``, ``C`` is ``layout.cp_size``, ``R`` is ``layout.rows_per_rank``.

    Attributes:
        layout: the zigzag layout the indices encode.
        rank_major_index: ``[C * R]`` int64, global row at each rank-major position, ``-1`` for a
            padding row. Rank ``r``'s local rows are ``rank_major_index[r * R:(r + 1) * R]``.
        rank_major_gather: ``[C * R]`` int64, ``rank_major_index`` with ``-1`` replaced by ``N``
            (the row a pad value is appended at), so a permutation is one ``index_select``.
        inverse_index: ``[N]`` int64, rank-major position of each global row.
        request_starts: ``[num_requests]`` int64, first global row of each packed request.
        row_request: ``[C * R]`` int64, request of each rank-major row, ``-1`` for padding.
        row_position: ``[C * R]`` int64, position of each rank-major row inside its request
            (tokens from the request start, as RoPE and causal masks use it), ``-1`` for padding.
    """

    layout: ZigzagLayout
    rank_major_index: torch.Tensor
    rank_major_gather: torch.Tensor
    inverse_index: torch.Tensor
    request_starts: torch.Tensor
    row_request: torch.Tensor
    row_position: torch.Tensor

    @classmethod
    def from_layout(cls, layout: ZigzagLayout, device: torch.device | str = "cpu") -> CPRowPlan:
        """Build the index tensors of ``layout`` on ``device`` (host work ``O(N)``, done once)."""
        total = layout.total_rows
        index = torch.tensor(layout.rank_major_index(), dtype=torch.int64)
        starts: list[int] = []
        request_of_row: list[int] = []
        position_of_row: list[int] = []
        base = 0
        for request, length in enumerate(layout.seq_lens):
            starts.append(base)
            request_of_row.extend([request] * length)
            position_of_row.extend(range(length))
            base += length
        req = torch.tensor(request_of_row, dtype=torch.int64)
        pos = torch.tensor(position_of_row, dtype=torch.int64)
        pad = index < 0
        safe = index.clamp_min(0)
        row_request = torch.where(pad, -1, req[safe]) if total else torch.full_like(index, -1)
        row_position = torch.where(pad, -1, pos[safe]) if total else torch.full_like(index, -1)
        dev = torch.device(device)
        return cls(
            layout=layout,
            rank_major_index=index.to(dev),
            rank_major_gather=torch.where(pad, total, index).to(dev),
            inverse_index=torch.tensor(layout.inverse_index(), dtype=torch.int64, device=dev),
            request_starts=torch.tensor(starts, dtype=torch.int64, device=dev),
            row_request=row_request.to(dev),
            row_position=row_position.to(dev),
        )

    @property
    def cp_size(self) -> int:
        """CP ranks ``C``."""
        return self.layout.cp_size

    @property
    def rows_per_rank(self) -> int:
        """Local rows ``R`` of every rank, padding included."""
        return self.layout.rows_per_rank

    @property
    def total_rows(self) -> int:
        """Global rows ``N`` (sum of the request lengths)."""
        return self.layout.total_rows

    @property
    def device(self) -> torch.device:
        """Device the index tensors live on."""
        return self.rank_major_index.device

    def local_slice(self, rank: int) -> slice:
        """Rank ``rank``'s rows inside any ``[C * R]`` rank-major tensor.

        Raises:
            KernelInputError: ``rank`` is not in ``0..C-1``.
        """
        if not 0 <= rank < self.cp_size:
            msg = f"rank={rank!r} is not allowed; allowed: 0..{self.cp_size - 1}"
            raise KernelInputError(msg)
        width = self.rows_per_rank
        return slice(rank * width, (rank + 1) * width)


def check_rows(name: str, t: torch.Tensor, plan: CPRowPlan, rows: int, what: str) -> None:
    """Reject a tensor with no row dim, off ``plan.device``, or with dim 0 not ``rows``."""
    if t.dim() < 1:
        msg = f"{name} must have a leading row dim; got shape {tuple(t.shape)!r}"
        raise KernelInputError(msg)
    if t.device != plan.device:
        msg = f"{name} is on {t.device!r}; the plan's indices are on {plan.device!r}"
        raise KernelInputError(msg)
    if t.shape[0] != rows:
        msg = (
            f"{name} has {t.shape[0]!r} rows (shape {tuple(t.shape)!r}); expected {rows!r} ({what})"
        )
        raise KernelInputError(msg)


def _gather_padded(x: torch.Tensor, gather: torch.Tensor, pad: float) -> torch.Tensor:
    """``x`` with one ``pad`` row appended, then ``index_select`` by ``gather`` (exact copy)."""
    padded = torch.cat([x, x.new_full((1, *x.shape[1:]), pad)])
    return padded.index_select(0, gather)


def zigzag_to_rank_major(x: torch.Tensor, plan: CPRowPlan, *, pad: float = 0) -> torch.Tensor:
    """Permute global rows into the rank-major layout (every rank's local rows, rank after rank).

    Args:
        x: ``[N, ...]`` global rows in packed request order, any dtype.
        plan: the row plan; ``x`` must be on ``plan.device``.
        pad: value of the padding rows (``0`` for activations, ``-1`` for index lists).

    Returns:
        ``[C * R, ...]`` in ``x``'s dtype; chunk ``r`` (rows ``r*R .. r*R+R-1``) is exactly
        ``zigzag_shard(x, plan, r, pad=pad)``. Values are copied bit for bit.

    Raises:
        KernelInputError: ``x`` is not ``[N, ...]`` on ``plan.device``.
    """
    check_rows("x", x, plan, plan.total_rows, "global rows N of the plan")
    return _gather_padded(x, plan.rank_major_gather, pad)


def zigzag_shard(x: torch.Tensor, plan: CPRowPlan, rank: int, *, pad: float = 0) -> torch.Tensor:
    """Rank ``rank``'s local rows of global rows ``x``.

    Rank ``r`` holds, for each request in order, the rows of block ``r`` then of block ``2C-1-r``
    (``2C`` blocks of ``ceil(L / 2C)`` rows per request of ``L`` rows), then padding rows up to
    ``R``.

    Args:
        x: ``[N, ...]`` global rows, any dtype, on ``plan.device``.
        plan: the row plan.
        rank: CP rank in ``0..C-1``.
        pad: value of the padding rows.

    Returns:
        ``[R, ...]`` in ``x``'s dtype, copied bit for bit.

    Raises:
        KernelInputError: bad ``x`` or ``rank``.
    """
    check_rows("x", x, plan, plan.total_rows, "global rows N of the plan")
    return _gather_padded(x, plan.rank_major_gather[plan.local_slice(rank)], pad)


def zigzag_unshard(rank_major: torch.Tensor, plan: CPRowPlan) -> torch.Tensor:
    """Global rows from the concatenation of every rank's local rows (inverse of the shard).

    Args:
        rank_major: ``[C * R, ...]`` rank 0's local rows, then rank 1's, ...; padding rows are
            dropped whatever they hold.
        plan: the row plan.

    Returns:
        ``[N, ...]`` global rows in packed request order, copied bit for bit.

    Raises:
        KernelInputError: ``rank_major`` is not ``[C * R, ...]`` on ``plan.device``.
    """
    check_rows("rank_major", rank_major, plan, plan.cp_size * plan.rows_per_rank, "C * R")
    return rank_major.index_select(0, plan.inverse_index)


def zigzag_positions(plan: CPRowPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request and in-request position of each of rank ``rank``'s local rows.

    Positions are tokens from the request start (what RoPE and the causal mask use), not the local
    row number.

    Returns:
        ``(request [R] int64, position [R] int64)``, both ``-1`` on padding rows.

    Raises:
        KernelInputError: ``rank`` is not in ``0..C-1``.
    """
    local = plan.local_slice(rank)
    return plan.row_request[local], plan.row_position[local]
