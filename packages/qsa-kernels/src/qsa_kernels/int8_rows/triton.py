"""Triton kernel of the INT8-row gather: the rows a batch names, read where the table lives.

One program reads one id's row: ``D`` int8 values and the row's float32 scale, straight from the
table's memory (a pinned host table is read over PCIe through its device view, as
:mod:`qsa_kernels._uva` maps it), and writes ``D`` bf16 values. Only the named rows cross the bus.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._checks import check_same_device, next_pow2
from qsa_kernels._errors import KernelInputError
from qsa_kernels._uva import device_view
from qsa_kernels.int8_rows.reference import Int8RowTable, check_gather_inputs

__all__ = ("gather_int8_rows",)


@triton.jit  # type: ignore[untyped-decorator]
def _gather_int8_rows_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    values_ptr,  # [V, D] int8
    scales_ptr,  # [V] fp32
    ids_ptr,  # [N] int32 / int64, global ids
    out_ptr,  # [N, D] bf16
    dim,
    vocab_start,
    vocab_end,
    BLOCK_D: tl.constexpr,  # constexpr: D rounded up to a power of two
):
    n = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + n).to(tl.int64)
    inside = (row >= vocab_start) & (row < vocab_end)
    local = tl.where(inside, row - vocab_start, 0)
    d = tl.arange(0, BLOCK_D)
    mask = d < dim
    values = tl.load(values_ptr + local * dim + d, mask=mask & inside, other=0)
    scale = tl.load(scales_ptr + local, mask=inside, other=0.0)
    rows = values.to(tl.float32) * scale  # finite: |int8| <= 127 times a finite scale
    # Round to bf16 (nearest, ties to even) in the bits, so the cast below is exact: Triton's
    # interpreter would truncate, and both paths must equal torch's rounding bit for bit.
    bits = rows.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    tl.store(out_ptr + n * dim + d, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)


def gather_int8_rows(
    table: Int8RowTable,
    ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_end: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Contract of :func:`~qsa_kernels.int8_rows.gather_int8_rows_reference`, on ``ids``' device.

    Args:
        table: the shard's rows: on ``ids``' device, or pinned host memory (read in place).
        ids: global row ids, int32/int64, any shape, on the device that runs the kernel.
        vocab_start: the first global id the shard holds.
        vocab_end: one past its last (default: ``vocab_start + V``).
        out: ``[*ids.shape, D]`` bf16 on ``ids``' device to write into (default: a new tensor).

    Returns:
        ``out`` (or the new tensor): bit-equal to the reference.

    Raises:
        KernelInputError: as the reference, a table neither on ``ids``' device nor pinned, or an
            ``out`` of another shape, dtype or device.
    """
    end = check_gather_inputs(table, ids, vocab_start, vocab_end)
    device = ids.device
    shape = (*ids.shape, table.dim)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    elif tuple(out.shape) != shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
        msg = (
            f"out is {tuple(out.shape)!r} {out.dtype} (contiguous={out.is_contiguous()!r}); "
            f"allowed: a contiguous {shape!r} torch.bfloat16 tensor"
        )
        raise KernelInputError(msg)
    check_same_device(device, out=out)
    if table.values.device != device and not (device.type == "cuda" and table.values.is_pinned()):
        msg = (
            f"the table is on {table.values.device!r} (pinned={table.values.is_pinned()!r}); a "
            f"gather on {device!r} reads a table on {device!r} or, from CUDA, in pinned host memory"
        )
        raise KernelInputError(msg)
    flat = ids.reshape(-1).contiguous()
    if flat.numel() == 0:
        return out
    values = device_view(table.values, device)
    scales = device_view(table.scales, device)
    _gather_int8_rows_kernel[(flat.numel(),)](
        values,
        scales,
        flat,
        out,
        table.dim,
        vocab_start,
        end,
        BLOCK_D=next_pow2(table.dim),
    )
    return out
