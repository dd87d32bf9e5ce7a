"""Torch reference of the selected-block fetch: the residency contract, step by step, in Python."""

from __future__ import annotations

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels.fetch._tables import HotCacheTables
from qsa_kernels.fetch._validate import check_fetch_args

__all__ = ("fetch_selected_blocks_reference",)


def fetch_selected_blocks_reference(
    selected: torch.Tensor,
    rows: torch.Tensor,
    layers: torch.Tensor,
    *,
    step: int | torch.Tensor,
    tables: HotCacheTables,
    hot: torch.Tensor,
    host_arena: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Make every selected block resident in its hot cache and return the slots (reference).

    Same contract and arguments as :func:`qsa_kernels.fetch.fetch_selected_blocks`; implemented one
    (request, layer) at a time with Python lists and ``torch`` copies. Also checks what the kernel
    cannot check without a device sync: ids in range and distinct per row, and ``step`` greater
    than every stamp of the touched hot caches. A step tensor is read, then advanced by one, as
    the kernel does.

    Returns:
        ``[B, NL, K]`` int32 global slots (``row * S + slot``), ``-1`` where ``selected`` is ``-1``.
    """
    check_fetch_args(
        selected,
        rows,
        layers,
        step=step,
        tables=tables,
        hot=hot,
        host_arena=host_arena,
        counters=counters,
    )
    step_tensor = step if isinstance(step, torch.Tensor) else None
    if step_tensor is not None:
        step = int(step_tensor.item())
        if step < 0:
            msg = f"step must be >= 0; got {step!r}"
            raise KernelInputError(msg)
    S = tables.slots
    out = torch.full_like(selected, -1)
    sel_all = selected.tolist()
    for b, row in enumerate(rows.tolist()):
        for j, layer in enumerate(layers.tolist()):
            sel = [int(x) for x in sel_all[b][j]]
            valid = [x for x in sel if x != -1]
            if any(x < -1 or x >= tables.blocks for x in sel):
                msg = f"selected ids of row {b!r} must lie in [-1, {tables.blocks!r}); got {sel!r}"
                raise KernelInputError(msg)
            if len(set(valid)) != len(valid):
                msg = f"selected ids of row {b!r}, layer {layer!r} must be distinct; got {sel!r}"
                raise KernelInputError(msg)
            slot_block, slot_stamp = tables.residency(layer, row)
            if max(slot_stamp) >= step:
                msg = f"step {step!r} must exceed every stamp; max stamp is {max(slot_stamp)!r}"
                raise KernelInputError(msg)
            holder = {blk: s for s, blk in enumerate(slot_block) if blk != -1}
            chosen = set(valid)
            victims = sorted(
                (s for s in range(S) if slot_block[s] not in chosen),
                key=lambda s: (slot_block[s] != -1, slot_stamp[s], s),
            )
            misses = [i for i, x in enumerate(sel) if x != -1 and x not in holder]
            if counters is not None:
                counters += torch.tensor([len(valid), len(misses)], device=counters.device)
            for n, i in enumerate(misses):
                victim = victims[n]
                old = slot_block[victim]
                if old != -1:
                    tables.block_slot[layer, row, old] = -1
                blk = sel[i]
                tables.block_slot[layer, row, blk] = victim
                tables.slot_block[layer, row, victim] = blk
                holder[blk] = victim
                hot[layer, row, victim].copy_(host_arena[row, layer, blk])
            for i, blk in enumerate(sel):
                if blk == -1:
                    continue
                s = holder[blk]
                tables.slot_stamp[layer, row, s] = step
                out[b, j, i] = row * S + s
    if step_tensor is not None:
        step_tensor.add_(1)
    return out
