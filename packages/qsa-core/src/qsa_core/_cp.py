"""Zigzag context-parallel layout of packed prefill rows, and its rank-major permutation.

With ``C`` CP ranks each request of ``L`` tokens is cut into ``2C`` blocks of
``b = ceil(L / 2C)`` rows (the last blocks may be shorter or empty); rank ``r`` owns blocks ``r``
and ``2C-1-r``, which balances causal attention work. Requests are packed one after another in
the global row order.

Rank ``r``'s **local rows** are, for each request in order, its block ``r`` rows then its block
``2C-1-r`` rows, then padding up to ``rows_per_rank`` (the largest real count over ranks), so
every rank has the same row count. The **rank-major** layout is the concatenation of every rank's
local rows: ``[C × rows_per_rank]``, padding marked ``-1`` in the index.

Invariant (the reason for the layout): if every rank holds a partial sum of the global rows, then
reduce-scatter of each rank's rank-major rows (sum over ranks, chunk ``r`` to rank ``r``) gives rank
``r`` exactly its zigzag shard, padding rows zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

from qsa_core._checks import is_int
from qsa_core._errors import LayoutError

__all__ = ("MAX_CP_SIZE", "MAX_SEQ_LEN", "ZigzagLayout")

#: Most CP ranks a layout is built for; a larger count is a mistake, refused before the rank lists.
MAX_CP_SIZE: Final = 1 << 10
#: Longest request any part of the workspace takes, in tokens (16,777,216: 64 times a 256K
#: context); a longer one is a mistake, refused before anything is sized by it.
MAX_SEQ_LEN: Final = 1 << 24

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ZigzagLayout:
    """Zigzag CP assignment of packed rows and the rank-major permutation.

    Attributes:
        cp_size: CP ranks ``C >= 1``.
        seq_lens: rows (tokens) of each packed request, each ``>= 0``.
    """

    cp_size: int
    seq_lens: tuple[int, ...]
    _rank_rows: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_int(self.cp_size) or not 1 <= self.cp_size <= MAX_CP_SIZE:
            msg = (
                f"cp_size={self.cp_size!r} is not allowed; allowed: an integer in 1..{MAX_CP_SIZE}"
            )
            raise LayoutError(msg)
        for position, length in enumerate(self.seq_lens):
            if not is_int(length) or not 0 <= length <= MAX_SEQ_LEN:
                msg = (
                    f"seq_lens[{position}]={length!r} is not allowed; allowed: an integer in "
                    f"0..{MAX_SEQ_LEN}"
                )
                raise LayoutError(msg)
        rows: list[list[int]] = [[] for _ in range(self.cp_size)]
        base = 0
        for length in self.seq_lens:
            for rank in range(self.cp_size):
                for block in (rank, 2 * self.cp_size - 1 - rank):
                    start, stop = self._bounds(length, block)
                    rows[rank].extend(range(base + start, base + stop))
            base += length
        object.__setattr__(self, "_rank_rows", tuple(tuple(r) for r in rows))

    def _bounds(self, length: int, block: int) -> tuple[int, int]:
        size = self.block_size(length)
        return min(block * size, length), min((block + 1) * size, length)

    @property
    def num_blocks(self) -> int:
        """Blocks per request: ``2C``."""
        return 2 * self.cp_size

    @property
    def total_rows(self) -> int:
        """Global (packed) rows: ``sum(seq_lens)``."""
        return sum(self.seq_lens)

    def block_size(self, seq_len: int) -> int:
        """Rows per block of a request of ``seq_len`` rows: ``ceil(seq_len / 2C)``."""
        return -(-seq_len // self.num_blocks)

    def block_bounds(self, request: int, block: int) -> tuple[int, int]:
        """Global ``[start, stop)`` rows of ``block`` of ``request``.

        Raises:
            LayoutError: request or block out of range.
        """
        if not is_int(request) or not 0 <= request < len(self.seq_lens):
            msg = f"request={request!r} is not allowed; allowed: 0..{len(self.seq_lens) - 1}"
            raise LayoutError(msg)
        if not is_int(block) or not 0 <= block < self.num_blocks:
            msg = f"block={block!r} is not allowed; allowed: 0..{self.num_blocks - 1}"
            raise LayoutError(msg)
        base = sum(self.seq_lens[:request])
        start, stop = self._bounds(self.seq_lens[request], block)
        return base + start, base + stop

    def blocks_of_rank(self, rank: int) -> tuple[int, int]:
        """The two blocks rank ``rank`` owns: ``(rank, 2C-1-rank)``."""
        self._check_rank(rank)
        return rank, self.num_blocks - 1 - rank

    def rank_rows(self, rank: int) -> tuple[int, ...]:
        """Global rows rank ``rank`` owns, in local order (no padding)."""
        self._check_rank(rank)
        return self._rank_rows[rank]

    @property
    def rows_per_rank(self) -> int:
        """Local rows of every rank after padding (the largest real count)."""
        return max(len(r) for r in self._rank_rows)

    def rank_major_index(self) -> tuple[int, ...]:
        """``[C × rows_per_rank]`` global row at each rank-major position, ``-1`` for padding."""
        width = self.rows_per_rank
        out: list[int] = []
        for rows in self._rank_rows:
            out.extend(rows)
            out.extend([-1] * (width - len(rows)))
        return tuple(out)

    def inverse_index(self) -> tuple[int, ...]:
        """``[total_rows]`` rank-major position of each global row (inverse of the index)."""
        inverse = [-1] * self.total_rows
        for position, row in enumerate(self.rank_major_index()):
            if row >= 0:
                inverse[row] = position
        return tuple(inverse)

    def owner_of_row(self, row: int) -> tuple[int, int]:
        """``(rank, local row)`` of global row ``row``."""
        if not is_int(row) or not 0 <= row < self.total_rows:
            msg = f"row={row!r} is not allowed; allowed: 0..{self.total_rows - 1}"
            raise LayoutError(msg)
        return divmod(self.inverse_index()[row], self.rows_per_rank)

    def to_rank_major(self, rows: Sequence[T], pad: T) -> list[T]:
        """Permute ``[total_rows]`` global rows into ``[C × rows_per_rank]``, padding with ``pad``.

        Raises:
            LayoutError: ``len(rows) != total_rows``.
        """
        self._check_len(rows, self.total_rows, "rows")
        return [pad if i < 0 else rows[i] for i in self.rank_major_index()]

    def from_rank_major(self, rank_major: Sequence[T]) -> list[T]:
        """Inverse of :meth:`to_rank_major`: global row order, padding dropped.

        Raises:
            LayoutError: ``len(rank_major) != C × rows_per_rank``.
        """
        self._check_len(rank_major, self.cp_size * self.rows_per_rank, "rank_major")
        return [rank_major[p] for p in self.inverse_index()]

    def shard(self, rows: Sequence[T], rank: int, pad: T) -> list[T]:
        """Rank ``rank``'s rows of ``[total_rows]`` global rows, padded to ``rows_per_rank``."""
        self._check_len(rows, self.total_rows, "rows")
        mine = [rows[i] for i in self.rank_rows(rank)]
        return mine + [pad] * (self.rows_per_rank - len(mine))

    def _check_rank(self, rank: int) -> None:
        if not is_int(rank) or not 0 <= rank < self.cp_size:
            msg = f"rank={rank!r} is not allowed; allowed: 0..{self.cp_size - 1}"
            raise LayoutError(msg)

    @staticmethod
    def _check_len(rows: Sequence[object], expected: int, name: str) -> None:
        if len(rows) != expected:
            msg = f"{name} has {len(rows)!r} rows; the layout expects {expected!r}"
            raise LayoutError(msg)
