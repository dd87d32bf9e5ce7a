"""The hot-cache residency tables and the K/V layouts shared by fetch, write-back and decode.

Layouts (``L`` QSA layers, ``R`` request rows, ``S`` hot slots per (row, layer), ``NB`` blocks of
host capacity per (row, layer), ``Hkv`` KV heads, ``D`` head dim; one block = 4 tokens):

* record: one block of one layer, ``[2, 4, Hkv, D]`` = its 4 K rows then its 4 V rows
  (``2 * 4 * Hkv * D * itemsize`` bytes: 2 KiB for FP8 E4M3 at Hkv=1, D=256).
* host arena: ``[R, L, NB, 2, 4, Hkv, D]`` in pinned host memory; block ``b`` of request row ``r``
  at layer ``l`` is ``arena[r, l, b]``. Each request row's history is one contiguous slab.
* hot cache: ``[L, R, S, 2, 4, Hkv, D]`` on the device; ``hot[l]`` viewed as
  ``[R * S, 2, 4, Hkv, D]`` is what sparse decode reads. A *global slot* is ``r * S + s``; the
  token slot of token ``j`` (0..3) of the block in global slot ``g`` is ``4 * g + j``.
"""

from __future__ import annotations

import dataclasses

import torch

from qsa_kernels._checks import (
    KV_DTYPES,
    check_contiguous,
    check_dim,
    check_dtype,
    check_ndim,
    check_same_device,
)
from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS

__all__ = ("BLOCK_TOKENS", "MAX_HOT_SLOTS", "HotCacheTables", "check_kv_layouts")

#: Most slots ``S`` one hot cache may have: the fetch kernel's fallback victim sort keeps a slot
#: in 16 bits beside a 46-bit stamp.
MAX_HOT_SLOTS = 1 << 16


@dataclasses.dataclass(frozen=True, slots=True)
class HotCacheTables:
    """Device residency state of every (layer, request row) hot cache.

    Attributes:
        slot_block: ``[L, R, S]`` int32; block id resident in each slot, ``-1`` for empty.
        slot_stamp: ``[L, R, S]`` int64; step of each slot's last use, ``-1`` for never used.
        block_slot: ``[L, R, NB]`` int32; inverse map, local slot of each resident block, else -1.
            Kept consistent with ``slot_block`` by every fetch.
    """

    slot_block: torch.Tensor
    slot_stamp: torch.Tensor
    block_slot: torch.Tensor

    def __post_init__(self) -> None:
        check_ndim("slot_block", self.slot_block, 3, "[L, R, S]")
        check_ndim("slot_stamp", self.slot_stamp, 3, "[L, R, S]")
        check_ndim("block_slot", self.block_slot, 3, "[L, R, NB]")
        check_dtype("slot_block", self.slot_block, (torch.int32,))
        check_dtype("slot_stamp", self.slot_stamp, (torch.int64,))
        check_dtype("block_slot", self.block_slot, (torch.int32,))
        if self.slot_stamp.shape != self.slot_block.shape:
            msg = (
                f"slot_stamp shape {tuple(self.slot_stamp.shape)!r} must equal slot_block shape "
                f"{tuple(self.slot_block.shape)!r}"
            )
            raise KernelInputError(msg)
        check_dim("block_slot", self.block_slot, 0, self.layers, "L of slot_block")
        check_dim("block_slot", self.block_slot, 1, self.rows, "R of slot_block")
        check_same_device(
            self.slot_block.device, slot_stamp=self.slot_stamp, block_slot=self.block_slot
        )
        check_contiguous(
            slot_block=self.slot_block, slot_stamp=self.slot_stamp, block_slot=self.block_slot
        )

    @classmethod
    def empty(
        cls, layers: int, rows: int, slots: int, blocks: int, device: torch.device
    ) -> HotCacheTables:
        """All slots empty and never used, for ``layers`` x ``rows`` hot caches of ``slots`` slots.

        ``blocks`` is the host capacity per (row, layer) in blocks (``NB``).
        """
        return cls(
            slot_block=torch.full((layers, rows, slots), -1, dtype=torch.int32, device=device),
            slot_stamp=torch.full((layers, rows, slots), -1, dtype=torch.int64, device=device),
            block_slot=torch.full((layers, rows, blocks), -1, dtype=torch.int32, device=device),
        )

    @property
    def layers(self) -> int:
        return int(self.slot_block.shape[0])

    @property
    def rows(self) -> int:
        return int(self.slot_block.shape[1])

    @property
    def slots(self) -> int:
        return int(self.slot_block.shape[2])

    @property
    def blocks(self) -> int:
        return int(self.block_slot.shape[2])

    @property
    def device(self) -> torch.device:
        return self.slot_block.device

    def clone(self) -> HotCacheTables:
        """Deep copy (tests run kernel and reference from the same start)."""
        return HotCacheTables(
            self.slot_block.clone(), self.slot_stamp.clone(), self.block_slot.clone()
        )

    def residency(self, layer: int, row: int) -> tuple[list[int], list[int]]:
        """``(slot_block, slot_stamp)`` of one hot cache as lists, the ``qsa-core`` state form."""
        return (
            [int(x) for x in self.slot_block[layer, row].tolist()],
            [int(x) for x in self.slot_stamp[layer, row].tolist()],
        )

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empty every slot of the given request rows (``[n]`` int), in all layers, in place."""
        idx = rows.to(device=self.device, dtype=torch.long)
        self.slot_block[:, idx] = -1
        self.slot_stamp[:, idx] = -1
        self.block_slot[:, idx] = -1


def check_kv_layouts(hot: torch.Tensor, host_arena: torch.Tensor, tables: HotCacheTables) -> None:
    """Check ``hot`` ``[L, R, S, 2, 4, Hkv, D]`` and ``host_arena`` ``[R, L, NB, 2, 4, Hkv, D]``.

    Both must share dtype (FP8 E4M3 or bf16) and record shape, agree with ``tables``, and be
    contiguous. Raises :class:`KernelInputError` otherwise.
    """
    check_ndim("hot", hot, 7, "[L, R, S, 2, 4, Hkv, D]")
    check_ndim("host_arena", host_arena, 7, "[R, L, NB, 2, 4, Hkv, D]")
    check_dtype("hot", hot, KV_DTYPES)
    if host_arena.dtype != hot.dtype:
        msg = f"host_arena dtype {host_arena.dtype!r} must equal hot dtype {hot.dtype!r}"
        raise KernelInputError(msg)
    check_dim("hot", hot, 0, tables.layers, "L of the tables")
    check_dim("hot", hot, 1, tables.rows, "R of the tables")
    check_dim("hot", hot, 2, tables.slots, "S of the tables")
    check_dim("hot", hot, 3, 2, "K then V")
    check_dim("hot", hot, 4, BLOCK_TOKENS, "tokens per block")
    check_dim("host_arena", host_arena, 0, tables.rows, "R of the tables")
    check_dim("host_arena", host_arena, 1, tables.layers, "L of the tables")
    check_dim("host_arena", host_arena, 2, tables.blocks, "NB of the tables")
    if host_arena.shape[3:] != hot.shape[3:]:
        msg = (
            f"host_arena record shape {tuple(host_arena.shape[3:])!r} must equal hot record shape "
            f"{tuple(hot.shape[3:])!r}"
        )
        raise KernelInputError(msg)
    check_contiguous(hot=hot, host_arena=host_arena)
    check_same_device(tables.device, hot=hot)
    record_bytes = hot[0, 0, 0].numel() * hot.element_size()
    if record_bytes % 4:
        msg = f"record size {record_bytes!r} bytes must be a multiple of 4"
        raise KernelInputError(msg)
