"""INT8-row embedding tables: the format, its quantizer, and the row gather's torch reference.

An INT8-row table stores a ``[V, D]`` embedding table as ``int8`` values with one ``float32``
scale per row: ``row[v] = values[v] * scales[v]``. The scale is the row's largest magnitude over
127 and each value its element over the scale, rounded to the nearest integer (ties to even) and
clamped to ``[-127, 127]``: symmetric per-row absmax quantization, the vector-wise scheme of
LLM.int8() (Dettmers et al., 2022, arXiv 2208.07339). A row of zeros has scale 0. A 16-bit table
takes half the bytes (plus 4 B a row), and each value is within half a quantization step
(``scale / 2``) of its source.

Qwen3.8-Flash-Next's PLE n-gram table (about 51.2 B parameters, rows of 160) is what this
format is for: held in host memory, only the rows a batch's n-grams hash to are read.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import torch

from qsa_kernels._checks import check_dtype, check_ndim, check_same_device
from qsa_kernels._errors import KernelInputError

__all__ = (
    "Int8RowTable",
    "dequantize_int8_rows_reference",
    "gather_int8_rows_reference",
    "quantize_int8_rows",
)

#: Largest magnitude of a stored value.
INT8_LIMIT: Final = 127
#: Dtypes a source table may have.
SOURCE_DTYPES: Final = (torch.bfloat16, torch.float16, torch.float32)
#: Dtypes of ids.
ID_DTYPES: Final = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True, slots=True)
class Int8RowTable:
    """An embedding table as ``int8`` rows and one ``float32`` scale per row.

    Attributes:
        values: ``[V, D]`` int8, contiguous.
        scales: ``[V]`` float32, contiguous, on the same device as ``values``.

    Raises:
        KernelInputError: a shape, dtype, device or layout other than the above.
    """

    values: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        check_ndim("values", self.values, 2, "[V, D]")
        check_dtype("values", self.values, (torch.int8,))
        check_ndim("scales", self.scales, 1, "[V]")
        check_dtype("scales", self.scales, (torch.float32,))
        check_same_device(self.values.device, scales=self.scales)
        if self.scales.shape[0] != self.values.shape[0]:
            msg = (
                f"scales has {self.scales.shape[0]!r} rows; values has "
                f"{self.values.shape[0]!r} ([V] and [V, D] must agree)"
            )
            raise KernelInputError(msg)
        for name, tensor in (("values", self.values), ("scales", self.scales)):
            if not tensor.is_contiguous():
                msg = f"{name} must be contiguous; got strides {tensor.stride()!r}"
                raise KernelInputError(msg)

    @property
    def rows(self) -> int:
        """Rows ``V``."""
        return int(self.values.shape[0])

    @property
    def dim(self) -> int:
        """Row width ``D``."""
        return int(self.values.shape[1])

    def pin(self) -> Int8RowTable:
        """The same table in page-locked host memory (what a device gather reads in place)."""
        return Int8RowTable(self.values.pin_memory(), self.scales.pin_memory())


def quantize_int8_rows(table: torch.Tensor) -> Int8RowTable:
    """Quantize a ``[V, D]`` bf16/fp16/fp32 table to INT8 rows (module docstring), on its device.

    Raises:
        KernelInputError: ``table`` is not 2-D, not a floating dtype listed above, or holds a
            non-finite value.
    """
    check_ndim("table", table, 2, "[V, D]")
    check_dtype("table", table, SOURCE_DTYPES)
    source = table.float()
    if not bool(torch.isfinite(source).all()):
        msg = "table holds a non-finite value; an INT8-row scale cannot represent it"
        raise KernelInputError(msg)
    scales = source.abs().amax(dim=1) / INT8_LIMIT
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(source / divisor[:, None]).clamp_(-INT8_LIMIT, INT8_LIMIT)
    return Int8RowTable(values.to(torch.int8).contiguous(), scales.contiguous())


def dequantize_int8_rows_reference(table: Int8RowTable) -> torch.Tensor:
    """``[V, D]`` bf16: each row's values times its scale in float32, rounded once to bf16."""
    return (table.values.float() * table.scales[:, None]).to(torch.bfloat16)


def check_gather_inputs(
    table: Int8RowTable, ids: torch.Tensor, vocab_start: int, vocab_end: int | None
) -> int:
    """Validate a gather's arguments; returns the shard's end (``vocab_end`` or start + V).

    Raises:
        KernelInputError: ``ids`` is not int32/int64, or the shard ``[vocab_start, vocab_end)``
            is empty, negative or longer than the table.
    """
    check_dtype("ids", ids, ID_DTYPES)
    end = vocab_start + table.rows if vocab_end is None else vocab_end
    if type(vocab_start) is not int or type(end) is not int or vocab_start < 0:
        msg = f"vocab_start={vocab_start!r}, vocab_end={vocab_end!r}; both must be ints >= 0"
        raise KernelInputError(msg)
    if not 0 < end - vocab_start <= table.rows:
        msg = (
            f"the shard [{vocab_start!r}, {end!r}) must hold 1 to {table.rows!r} rows (the "
            "table's rows)"
        )
        raise KernelInputError(msg)
    return end


def gather_int8_rows_reference(
    table: Int8RowTable, ids: torch.Tensor, *, vocab_start: int = 0, vocab_end: int | None = None
) -> torch.Tensor:
    """Rows of a vocabulary shard, dequantized: ``[*ids.shape, D]`` bf16 on ``ids``' device.

    Args:
        table: this shard's rows; global id ``vocab_start + r`` is row ``r``.
        ids: global row ids, int32/int64, any shape.
        vocab_start: the first global id the shard holds.
        vocab_end: one past its last (default: ``vocab_start + V``).

    Returns:
        Row ``i`` is ``dequantize(table)[ids[i] - vocab_start]`` for an id in the shard, and
        zeros for any other id (another tensor-parallel rank's row: the ranks' outputs sum).

    Raises:
        KernelInputError: as :func:`check_gather_inputs`.
    """
    end = check_gather_inputs(table, ids, vocab_start, vocab_end)
    flat = ids.reshape(-1).long().to(table.values.device)  # read the named rows where they live
    inside = (flat >= vocab_start) & (flat < end)
    local = torch.where(inside, flat - vocab_start, torch.zeros_like(flat))
    rows = dequantize_int8_rows_reference(Int8RowTable(table.values[local], table.scales[local]))
    rows[~inside] = 0
    return rows.reshape(*ids.shape, table.dim).to(ids.device)
