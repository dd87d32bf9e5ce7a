"""Reading an INT8-row table from a checkpoint split into row shards.

A PLE n-gram table of ``R`` rows is stored in ``parts`` row shards: shard ``i`` holds the global
rows ``[i * S, i * S + r_i)`` with ``S = ceil(R / parts)`` (SGLang's ``split_ngram_parts``
layout, ``...ngram_embedding.shard_<i>.weight``). In the INT8-row format each shard is two
tensors: the values, ``[r_i, D]`` int8, and their per-row scales, ``[r_i]`` (or ``[r_i, 1]``)
float32 (:mod:`qsa_kernels.int8_rows.reference` defines the format). A shard stored as a
bf16/fp16/fp32 table (no scales) is quantized as it is read; rows are independent, so quantizing
shard by shard equals quantizing the whole table.

:class:`Int8RowShardReader` fills one vocabulary shard ``[vocab_start, vocab_end)`` of a table
(a tensor-parallel rank's, or all of it) from the checkpoint's tensors in any order, and refuses
a malformed checkpoint (scales without values or values without scales, a shape or dtype outside
the format, a row read twice, rows never read) with the tensor's name and the values it got.
:class:`Int8RowShardRouter` does it for a model's whole weight stream: it takes the tables'
shards (``<module>.shard_<i>.weight`` and ``<module>.shard_<i>.weight_scale``) out of the
``(name, tensor)`` pairs an engine's loader yields, into each table's
:class:`~qsa_kernels.int8_rows.Int8RowVocabShard`, and passes every other tensor on.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Final

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels.int8_rows.reference import SOURCE_DTYPES, Int8RowTable, quantize_int8_rows
from qsa_kernels.int8_rows.shard import Int8RowVocabShard

__all__ = (
    "Int8RowShardReader",
    "Int8RowShardRouter",
    "Int8RowShardSummary",
    "checkpoint_shard_rows",
)

#: Dtype of stored values and of stored scales.
VALUES_DTYPE: Final = torch.int8
SCALES_DTYPE: Final = torch.float32
#: A row shard's tensor: ``<module>.shard_<i>.weight`` (values) or ``...weight_scale`` (scales).
SHARD_TENSOR_NAME: Final = re.compile(
    r"^(?P<module>.+)\.shard_(?P<shard>\d+)\.(?P<kind>weight|weight_scale)$"
)


def checkpoint_shard_rows(total_rows: int, parts: int) -> int:
    """Rows per checkpoint shard (the last may hold fewer): ``ceil(total_rows / parts)``.

    Raises:
        KernelInputError: ``total_rows`` or ``parts`` is not a positive int.
    """
    if type(total_rows) is not int or type(parts) is not int or total_rows <= 0 or parts <= 0:
        msg = f"total_rows={total_rows!r}, parts={parts!r}; both must be ints > 0"
        raise KernelInputError(msg)
    return -(-total_rows // parts)


@dataclasses.dataclass(frozen=True, slots=True)
class Int8RowShardSummary:
    """What a reader loaded.

    Attributes:
        rows: rows of ``[vocab_start, vocab_end)`` written.
        int8_shards: checkpoint shards read as stored (values and scales).
        quantized_shards: checkpoint shards stored as a 16/32-bit table, quantized when read.
    """

    rows: int
    int8_shards: int
    quantized_shards: int

    def quantized_note(self, table: str) -> str | None:
        """The note to log when 16/32-bit shards were quantized at load (None when none was)."""
        if not self.quantized_shards:
            return None
        return (
            f"INT8-row table {table} is stored as a 16/32-bit table in the checkpoint; "
            f"{self.quantized_shards} shards quantized to INT8 rows at load ({self.rows} rows)"
        )


@dataclasses.dataclass(slots=True)
class _Pending:
    values: torch.Tensor | None = None
    values_name: str = ""
    scales: torch.Tensor | None = None
    scales_name: str = ""


class Int8RowShardReader:
    """Fills rows ``[vocab_start, vocab_end)`` of ``table`` from a checkpoint's row shards.

    Args:
        table: the destination, ``vocab_end - vocab_start`` or more rows (local row ``r`` is
            global row ``vocab_start + r``), on any device or in pinned host memory.
        total_rows: the global rows the checkpoint's shards cover (``R``).
        parts: how many shards the checkpoint splits them into.
        vocab_start: the first global row ``table`` holds.
        vocab_end: one past its last (rows from there to ``table.rows`` stay as they are).

    Raises:
        KernelInputError: a shard outside ``[vocab_start, vocab_end)``'s bounds as above.
    """

    def __init__(
        self, table: Int8RowTable, *, total_rows: int, parts: int, vocab_start: int, vocab_end: int
    ) -> None:
        self._shard_rows = checkpoint_shard_rows(total_rows, parts)
        if not 0 <= vocab_start < vocab_end <= total_rows or vocab_end - vocab_start > table.rows:
            msg = (
                f"vocab shard [{vocab_start!r}, {vocab_end!r}) must lie in [0, {total_rows!r}) "
                f"and fit the table's {table.rows!r} rows"
            )
            raise KernelInputError(msg)
        self._table = table
        self._total_rows = total_rows
        self._parts = parts
        self._start = vocab_start
        self._end = vocab_end
        self._loaded = torch.zeros(vocab_end - vocab_start, dtype=torch.bool)
        self._pending: dict[int, _Pending] = {}
        self._int8_shards = 0
        self._quantized_shards = 0

    def add_values(self, shard: int, tensor: torch.Tensor, *, name: str) -> None:
        """Shard ``shard``'s values: ``[r, D]`` int8 (its scales come apart) or a 16/32-bit table.

        Raises:
            KernelInputError: another dtype or shape, a shard index outside ``[0, parts)``,
                values given twice, or scales already given for a 16/32-bit table.
        """
        self._check_shard(shard, name)
        if tensor.dtype in SOURCE_DTYPES:
            pending = self._pending.pop(shard, None)
            if pending is not None and pending.scales is not None:
                msg = (
                    f"{name} is {tensor.dtype} (a table to quantize) but {pending.scales_name} "
                    "gives it scales; scales go with int8 values"
                )
                raise KernelInputError(msg)
            self._check_rows(shard, tensor, name, values=True)
            self._write(shard, quantize_int8_rows(tensor.contiguous()), name)
            self._quantized_shards += 1
            return
        if tensor.dtype != VALUES_DTYPE:
            msg = (
                f"{name} is {tensor.dtype}; allowed: {VALUES_DTYPE} (with scales) or "
                f"{SOURCE_DTYPES!r}"
            )
            raise KernelInputError(msg)
        self._check_rows(shard, tensor, name, values=True)
        pending = self._pending.setdefault(shard, _Pending())
        if pending.values is not None:
            msg = f"{name}: shard {shard!r}'s values were already given as {pending.values_name}"
            raise KernelInputError(msg)
        pending.values, pending.values_name = tensor, name
        self._complete(shard)

    def add_scales(self, shard: int, tensor: torch.Tensor, *, name: str) -> None:
        """Shard ``shard``'s per-row scales: ``[r]`` or ``[r, 1]`` float32.

        Raises:
            KernelInputError: another dtype or shape, a shard index outside ``[0, parts)``, or
                scales given twice.
        """
        self._check_shard(shard, name)
        if tensor.dtype != SCALES_DTYPE:
            msg = f"{name} is {tensor.dtype}; allowed: {SCALES_DTYPE} (one scale per row)"
            raise KernelInputError(msg)
        if tensor.ndim == 2 and tensor.shape[1] == 1:
            tensor = tensor.reshape(-1)
        if tensor.ndim != 1:
            msg = f"{name} has shape {tuple(tensor.shape)!r}; allowed: [rows] or [rows, 1]"
            raise KernelInputError(msg)
        self._check_rows(shard, tensor, name, values=False)
        pending = self._pending.setdefault(shard, _Pending())
        if pending.scales is not None:
            msg = f"{name}: shard {shard!r}'s scales were already given as {pending.scales_name}"
            raise KernelInputError(msg)
        pending.scales, pending.scales_name = tensor, name
        self._complete(shard)

    def finish(self) -> Int8RowShardSummary:
        """Check that every shard is whole and every row of the vocab shard was read.

        Raises:
            KernelInputError: values without scales or scales without values (named), or rows
                of ``[vocab_start, vocab_end)`` that no shard held.
        """
        for pending in self._pending.values():
            if pending.values is not None:
                msg = f"{pending.values_name} is int8 but its scales were not in the checkpoint"
            else:
                msg = f"{pending.scales_name} has no values beside it in the checkpoint"
            raise KernelInputError(msg)
        missing = int((~self._loaded).sum())
        if missing:
            first = self._start + int((~self._loaded).nonzero()[0])
            msg = (
                f"{missing!r} rows of [{self._start!r}, {self._end!r}) were in no shard "
                f"(the first: {first!r})"
            )
            raise KernelInputError(msg)
        return Int8RowShardSummary(
            rows=int(self._loaded.sum()),
            int8_shards=self._int8_shards,
            quantized_shards=self._quantized_shards,
        )

    def _check_shard(self, shard: int, name: str) -> None:
        if type(shard) is not int or not 0 <= shard < self._parts:
            msg = (
                f"{name} names shard {shard!r}; the checkpoint has shards 0 to {self._parts - 1!r}"
            )
            raise KernelInputError(msg)

    def _check_rows(self, shard: int, tensor: torch.Tensor, name: str, *, values: bool) -> None:
        first = shard * self._shard_rows
        want = max(0, min(self._shard_rows, self._total_rows - first))
        rows = int(tensor.shape[0]) if tensor.ndim else -1
        if values:
            ok = tensor.ndim == 2 and tensor.shape[1] == self._table.dim and 0 < rows <= want
            layout = f"[rows <= {want!r}, {self._table.dim!r}]"
        else:
            ok = 0 < rows <= want
            layout = f"[rows <= {want!r}]"
        if not ok:
            msg = f"{name} has shape {tuple(tensor.shape)!r}; allowed: {layout}"
            raise KernelInputError(msg)

    def _complete(self, shard: int) -> None:
        pending = self._pending[shard]
        if pending.values is None or pending.scales is None:
            return
        if pending.scales.shape[0] != pending.values.shape[0]:
            msg = (
                f"{pending.scales_name} has {pending.scales.shape[0]!r} rows; "
                f"{pending.values_name} has {pending.values.shape[0]!r}"
            )
            raise KernelInputError(msg)
        del self._pending[shard]
        rows = Int8RowTable(pending.values.contiguous(), pending.scales.contiguous())
        self._write(shard, rows, pending.values_name)
        self._int8_shards += 1

    def _write(self, shard: int, rows: Int8RowTable, name: str) -> None:
        first = shard * self._shard_rows
        lo, hi = max(first, self._start), min(first + rows.rows, self._end)
        if lo >= hi:
            return  # another rank's rows
        local = slice(lo - self._start, hi - self._start)
        if bool(self._loaded[local].any()):
            msg = f"{name} holds rows [{lo!r}, {hi!r}) of which some were already read"
            raise KernelInputError(msg)
        source = slice(lo - first, hi - first)
        device = self._table.values.device
        self._table.values[local].copy_(rows.values[source].to(device))
        self._table.scales[local].copy_(rows.scales[source].to(device))
        self._loaded[local] = True


class Int8RowShardRouter:
    """Takes INT8-row tables' checkpoint shards out of a weight stream into the tables.

    Args:
        tables: each table's vocabulary shard, keyed by its module's name in the checkpoint
            (the ``<module>`` of ``<module>.shard_<i>.weight``, after ``rename``).
        parts: how many row shards each table is split into in the checkpoint.
        rename: maps a checkpoint tensor's name to the names ``tables`` uses (an engine's own
            prefix rewriting); the identity by default.

    Use :meth:`route` over the ``(name, tensor)`` pairs, then :meth:`finish` (both: :meth:`load`).
    """

    def __init__(
        self,
        tables: Mapping[str, Int8RowVocabShard],
        *,
        parts: int,
        rename: Callable[[str], str] = str,
    ) -> None:
        checkpoint_shard_rows(1, parts)  # validates parts
        self._tables = dict(tables)
        self._parts = parts
        self._rename = rename
        self._readers: dict[str, Int8RowShardReader] = {}

    def route(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every pair of ``weights`` but the tables' shards, in order; those fill the tables.

        A shard whose rows lie past ``used_rows`` or outside a table's ``[vocab_start,
        vocab_end)`` is read and dropped (padding, or another rank's rows).

        Raises:
            KernelInputError: a malformed shard (:class:`Int8RowShardReader`'s refusals).
        """
        for name, tensor in weights:
            match = SHARD_TENSOR_NAME.match(self._rename(name))
            shard = self._tables.get(match["module"]) if match else None
            if match is None or shard is None:
                yield name, tensor
                continue
            if shard.read_end <= shard.vocab_start:
                continue  # this rank holds padding rows only
            reader = self._reader(match["module"], shard)
            if match["kind"] == "weight":
                reader.add_values(int(match["shard"]), tensor, name=name)
            else:
                reader.add_scales(int(match["shard"]), tensor, name=name)

    def finish(self) -> dict[str, Int8RowShardSummary]:
        """What each table read, by module name (tables none of whose shards came are absent).

        Raises:
            KernelInputError: as :meth:`Int8RowShardReader.finish`.
        """
        return {module: reader.finish() for module, reader in self._readers.items()}

    def load(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        note: Callable[[str], None] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`route`, then :meth:`finish` once ``weights`` is exhausted.

        ``note`` gets each table's :meth:`Int8RowShardSummary.quantized_note` (quantized at load).

        Raises:
            KernelInputError: as :meth:`route` and :meth:`finish`.
        """
        yield from self.route(weights)
        for module, summary in self.finish().items():
            text = summary.quantized_note(module)
            if note is not None and text is not None:
                note(text)

    def _reader(self, module: str, shard: Int8RowVocabShard) -> Int8RowShardReader:
        reader = self._readers.get(module)
        if reader is None:
            reader = self._readers[module] = Int8RowShardReader(
                shard.table,
                total_rows=shard.total_rows,
                parts=self._parts,
                vocab_start=shard.vocab_start,
                vocab_end=shard.read_end,
            )
        return reader
