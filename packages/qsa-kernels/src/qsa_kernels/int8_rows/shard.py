"""A vocabulary shard of an INT8-row table: what one tensor-parallel rank holds and serves.

A table of ``total_rows`` rows (padded: ids name only the first ``used_rows``) is split between
ranks by vocabulary; a rank holds the rows ``[vocab_start, vocab_end)`` as an
:class:`~qsa_kernels.int8_rows.Int8RowTable` (on its device, or in pinned host memory that the
gather reads in place), gathers the rows a batch names (zeros for other ranks' ids: the ranks'
outputs sum), and is filled from a checkpoint by
:class:`~qsa_kernels.int8_rows.Int8RowShardRouter`. An engine adapter builds one per table from its
own vocabulary-sharding metadata; the table is the only allocation of its size.
"""

from __future__ import annotations

import dataclasses

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._path import KernelPath
from qsa_kernels.int8_rows.reference import Int8RowTable, gather_int8_rows_reference
from qsa_kernels.int8_rows.triton import gather_int8_rows

__all__ = ("Int8RowVocabShard",)


@dataclasses.dataclass(frozen=True, slots=True)
class Int8RowVocabShard:
    """Rows ``[vocab_start, vocab_end)`` of a table of ``total_rows`` rows, as INT8 rows.

    Attributes:
        table: ``values [R, D]`` int8 and ``scales [R]`` float32 with
            ``R >= vocab_end - vocab_start`` (local row ``r`` is global row ``vocab_start + r``).
        vocab_start: the first global row held.
        vocab_end: one past the last.
        total_rows: rows of the whole table, padding included (what a checkpoint's shards cover).
        used_rows: rows an id can name (``<= total_rows``); later rows are padding: never read
            from a checkpoint, left zero.

    Raises:
        KernelInputError: bounds outside ``0 <= vocab_start < vocab_end <= total_rows``, more
            rows than ``table`` holds, or ``used_rows`` outside ``[0, total_rows]``.
    """

    table: Int8RowTable
    vocab_start: int
    vocab_end: int
    total_rows: int
    used_rows: int

    def __post_init__(self) -> None:
        bounds = (self.vocab_start, self.vocab_end, self.total_rows, self.used_rows)
        if any(type(value) is not int for value in bounds) or not (
            0 <= self.vocab_start < self.vocab_end <= self.total_rows
            and self.vocab_end - self.vocab_start <= self.table.rows
            and 0 <= self.used_rows <= self.total_rows
        ):
            msg = (
                f"vocab_start={self.vocab_start!r}, vocab_end={self.vocab_end!r}, "
                f"total_rows={self.total_rows!r}, used_rows={self.used_rows!r} for a table of "
                f"{self.table.rows!r} rows; allowed: ints with 0 <= vocab_start < vocab_end <= "
                "total_rows, vocab_end - vocab_start <= the table's rows, 0 <= used_rows <= "
                "total_rows"
            )
            raise KernelInputError(msg)

    @classmethod
    def zeros(
        cls,
        *,
        rows: int,
        dim: int,
        vocab_start: int,
        vocab_end: int,
        total_rows: int,
        used_rows: int,
        device: torch.device,
        pinned: bool = False,
    ) -> Int8RowVocabShard:
        """A zero shard of ``rows`` rows of ``dim`` values: the only tensors of its size it makes.

        Args:
            rows: rows to allocate (``>= vocab_end - vocab_start``; an engine may pad a rank's).
            dim: values per row.
            vocab_start: the first global row held.
            vocab_end: one past the last.
            total_rows: rows of the whole table.
            used_rows: rows an id can name.
            device: where the table lives (``cpu`` for a host table).
            pinned: allocate page-locked host memory directly (``device`` must be ``cpu``), so a
                CUDA gather reads it in place; no pageable copy is made first.

        Raises:
            KernelInputError: ``pinned`` on a device other than ``cpu``, or bounds as above.
        """
        if pinned and device.type != "cpu":
            msg = f"pinned=True with device={device!r}; pinned memory is host (cpu) memory"
            raise KernelInputError(msg)
        values = torch.zeros(rows, dim, dtype=torch.int8, device=device, pin_memory=pinned)
        scales = torch.zeros(rows, dtype=torch.float32, device=device, pin_memory=pinned)
        return cls(Int8RowTable(values, scales), vocab_start, vocab_end, total_rows, used_rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the table: ``R * D`` int8 values and ``R`` float32 scales."""
        values, scales = self.table.values, self.table.scales
        return values.numel() * values.element_size() + scales.numel() * scales.element_size()

    @property
    def read_end(self) -> int:
        """One past the last row a checkpoint must fill: ``min(vocab_end, used_rows)``."""
        return min(self.vocab_end, self.used_rows)

    def gather(
        self,
        ids: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        path: KernelPath = KernelPath.AUTO,
    ) -> torch.Tensor:
        """``[*ids.shape, D]`` bf16 on ``ids``' device: the named rows, zeros for other ranks'.

        Args:
            ids: global row ids, int32/int64, any shape.
            out: ``[*ids.shape, D]`` contiguous bf16 on ``ids``' device to write (default: new).
            path: :attr:`KernelPath.AUTO` runs :func:`gather_int8_rows` for CUDA ids (reading a
                pinned host table in place) and :func:`gather_int8_rows_reference` otherwise.

        Raises:
            KernelInputError: as :func:`gather_int8_rows`.
        """
        bounds = {"vocab_start": self.vocab_start, "vocab_end": self.vocab_end}
        if path.resolve(ids.device) is KernelPath.TRITON:
            return gather_int8_rows(self.table, ids, out=out, **bounds)
        rows = gather_int8_rows_reference(self.table, ids, **bounds)
        if out is None:
            return rows
        if tuple(out.shape) != tuple(rows.shape) or out.dtype != torch.bfloat16:
            msg = (
                f"out is {tuple(out.shape)!r} {out.dtype}; allowed: {tuple(rows.shape)!r} "
                "torch.bfloat16"
            )
            raise KernelInputError(msg)
        return out.copy_(rows)
