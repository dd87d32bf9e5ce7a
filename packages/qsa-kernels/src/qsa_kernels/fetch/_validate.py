"""Argument checks shared by the fetch kernel and its reference."""

from __future__ import annotations

import torch

from qsa_kernels._checks import (
    check_contiguous,
    check_dim,
    check_dtype,
    check_ndim,
    check_same_device,
)
from qsa_kernels._errors import KernelInputError
from qsa_kernels.fetch._tables import HotCacheTables, check_kv_layouts

__all__ = ("check_fetch_args",)


def check_fetch_args(
    selected: torch.Tensor,
    rows: torch.Tensor,
    layers: torch.Tensor,
    *,
    step: int | torch.Tensor,
    tables: HotCacheTables,
    hot: torch.Tensor,
    host_arena: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> None:
    """Validate shapes, dtypes and devices of a fetch call (no device sync)."""
    if counters is not None:
        check_ndim("counters", counters, 1, "[2]: (selected, missing)")
        check_dim("counters", counters, 0, 2, "selected, missing")
        check_dtype("counters", counters, (torch.int64,))
        check_same_device(tables.device, counters=counters)
    check_ndim("selected", selected, 3, "[B, NL, K]")
    check_dtype("selected", selected, (torch.int32,))
    check_ndim("rows", rows, 1, "[B]")
    check_dtype("rows", rows, (torch.int32,))
    check_ndim("layers", layers, 1, "[NL]")
    check_dtype("layers", layers, (torch.int32,))
    check_dim("rows", rows, 0, selected.shape[0], "B of selected")
    check_dim("layers", layers, 0, selected.shape[1], "NL of selected")
    check_same_device(tables.device, selected=selected, rows=rows, layers=layers)
    check_contiguous(selected=selected)
    if selected.shape[2] > tables.slots:
        msg = (
            f"selected has K={selected.shape[2]!r} entries per row but a hot cache has only "
            f"S={tables.slots!r} slots; need K <= S"
        )
        raise KernelInputError(msg)
    if isinstance(step, torch.Tensor):
        check_dtype("step", step, (torch.int64,))
        if tuple(step.shape) != (1,):
            msg = f"a step tensor must have shape (1,); got {tuple(step.shape)!r}"
            raise KernelInputError(msg)
        check_same_device(tables.device, step=step)
    elif step < 0:
        msg = f"step must be >= 0; got {step!r}"
        raise KernelInputError(msg)
    check_kv_layouts(hot, host_arena, tables)
