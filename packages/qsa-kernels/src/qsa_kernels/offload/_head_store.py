"""The store of per-head records: tokens chosen per KV head (double sparsity).

Where each KV head chooses its own tokens, a record holds one 4-token block of one KV head
(``[2, 4, 1, D]``, :attr:`OffloadGeometry.per_head`), so a head's choice moves only its own bytes:
the store keeps ``L × Hkv`` record layers, layer ``l``'s head ``h`` at ``l × Hkv + h``.
:class:`PerHeadOffloadedKV` adds to the shared data path
(:class:`~qsa_kernels.offload._store.OffloadStore`) the blocks that hold each head's chosen tokens
(:meth:`PerHeadOffloadedKV.token_blocks`) and attention over those tokens
(:meth:`PerHeadOffloadedKV.attend_tokens`, which counts the selected and missing records on the
device). It takes no shard group: each rank stores every block of its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS
from qsa_kernels._path import KernelPath
from qsa_kernels.offload._store import OffloadGeometry, OffloadStore

__all__ = ("PerHeadOffloadedKV",)


def _head_records(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of one layer's per-head record layers as ``[N, Hkv, D]`` views (no copy).

    ``cache`` is ``[Hkv, R, S', 2, 4, 1, D]`` (a hot cache, or tails with ``S' = 1``); token
    ``8 r + o`` of the K view is token ``o`` of record ``r = row × S' + slot`` (a record is
    :data:`~qsa_kernels._geometry.RECORD_ROWS` rows), and the same id in the V view
    (``BLOCK_TOKENS`` rows later) is its value.
    """
    heads, d = int(cache.shape[0]), int(cache.shape[-1])
    rows = cache.view(heads, -1, d).permute(1, 0, 2)  # [R S' 8, Hkv, D]
    return rows[:-BLOCK_TOKENS], rows[BLOCK_TOKENS:]


class PerHeadOffloadedKV(OffloadStore):
    """One rank's K/V under host offload, one record per block of one KV head.

    Shapes: host arena ``[R, L Hkv, NB, 2, 4, 1, D]``, hot caches ``[L Hkv, R, S, 2, 4, 1, D]``
    (``S`` slots per head), tails ``[L Hkv, R, 1, 2, 4, 1, D]``; every call takes and returns
    K/V by logical layer and head. The rest of the contract (rows, steps, write-back, ``path``)
    is :class:`OffloadStore`'s.

    Args:
        geometry: the sizes, with ``per_head=True``.
        device: the device of the hot caches, tails and tables.
        path: the kernels' implementation.

    Raises:
        KernelInputError: a geometry of records of every KV head (those are
            :class:`~qsa_kernels.offload.OffloadedKV`'s).
    """

    def __init__(
        self,
        geometry: OffloadGeometry,
        device: torch.device,
        *,
        path: KernelPath = KernelPath.AUTO,
    ) -> None:
        if not geometry.per_head:
            msg = (
                "PerHeadOffloadedKV keeps one record per KV head; got a geometry with "
                "per_head=False (give OffloadGeometry(..., per_head=True))"
            )
            raise KernelInputError(msg)
        super().__init__(geometry, device, path=path)

    def admit(self, row: int, k: torch.Tensor, v: torch.Tensor) -> torch.cuda.Event | None:
        """Take a prefilled prompt into a free row: complete blocks to host, the open block to tail.

        Args:
            row: a free request row.
            k: ``[L, T, Hkv, D]`` keys of every layer (device, the geometry's dtype), ``T >= 1``.
            v: ``[L, T, Hkv, D]`` values.

        Returns:
            The copy's completion event, or None when it ran synchronously
            (:meth:`OffloadStore._admit`).
        """
        return self._admit(row, k, v, None)

    def token_blocks(
        self, rows: Sequence[int], positions: torch.Tensor, *, checked: bool = True
    ) -> torch.Tensor:
        """The complete blocks that hold each KV head's chosen tokens.

        What :meth:`attend_tokens` fetches: a head's chosen token needs that head's record of
        its 4-token block in the hot cache; tokens of the open block are read from the tail. No
        host synchronisation when ``W <= hot_slots`` or ``checked=False``; otherwise a wider
        list is counted on the host (one read) to refuse a head that needs more blocks than a
        hot cache holds.

        Args:
            rows: the step's rows (what the last :meth:`advance` returned).
            positions: ``[B, Hkv, W]`` int32 logical token positions each (row, KV head)
                attends, ``-1`` padded, each below the row's length after the step's token.
            checked: count a wide list's blocks on the host. ``False`` (a CUDA-graph step) when
                the caller guarantees at most ``hot_slots`` blocks per head, e.g. by sizing hot
                caches with :meth:`DSConfig.hot_blocks`; a head's blocks past ``hot_slots`` are
                then dropped.

        Returns:
            ``[B, Hkv, K]`` int32 distinct block ids per (row, head), ascending, ``-1`` padded,
            ``K = min(W, hot_slots)``.

        Raises:
            KernelInputError: ``positions`` is not ``[B, Hkv, W]``, or a head needs more blocks
                than a hot cache holds.
        """
        g = self.geometry
        self.planner.check_planned("token_blocks", rows)
        if positions.dim() != 3 or tuple(positions.shape[:2]) != (len(rows), g.kv_heads):
            msg = (
                f"positions must be [B={len(rows)}, Hkv={g.kv_heads}, W]; got "
                f"{tuple(positions.shape)!r}"
            )
            raise KernelInputError(msg)
        blocks, counts = self._kernels.head_blocks(
            positions.to(torch.int32).contiguous(),
            self.planner.plan.closed_blocks,
            slots=g.hot_slots,
        )
        if checked and int(positions.shape[2]) > g.hot_slots:
            need = int(counts.max())  # the host read
            if need > g.hot_slots:
                msg = (
                    f"a KV head needs {need!r} distinct blocks in one hot cache but hot_slots="
                    f"{g.hot_slots!r}; allowed: at most hot_slots blocks per row, layer and head"
                )
                raise KernelInputError(msg)
        return blocks

    def attend_tokens(
        self,
        layer: int,
        rows: Sequence[int],
        q: torch.Tensor,
        positions: torch.Tensor,
        blocks: torch.Tensor,
        *,
        scale: float | None = None,
        counters: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer for ``B`` rows over chosen tokens, a list per KV head.

        :meth:`OffloadedKV.attend` takes whole blocks for every head (QSA's indexer); this takes
        tokens per KV head (double sparsity's heavy tokens): each head's blocks are fetched into
        that head's hot cache (one fetch for every head of the layer), each head attends only its
        own tokens there and in the open-block tail, and the two parts are merged by their LSE.
        No host synchronisation.

        Args:
            layer: layer index in ``[0, L)``.
            rows: the step's rows (what the last :meth:`advance` returned).
            q: ``[B, Hq, D]`` bf16 queries.
            positions: ``[B, Hkv, W]`` int32 chosen token positions, ``-1`` padded (see
                :meth:`token_blocks`).
            blocks: ``token_blocks(rows, positions)``.
            scale: softmax scale, ``1 / sqrt(D)`` if ``None``.
            counters: ``[2]`` int64 device tensor, or None: the fetch adds the selected records
                and those that missed the hot caches (no host synchronisation).

        Returns:
            ``(out [B, Hq, D] bf16, lse [B, Hq] fp32)``, natural-log LSE.
        """
        g = self.geometry
        self._check_step("attend_tokens", layer, rows)
        batch = len(rows)
        if (
            blocks.dim() != 3
            or tuple(blocks.shape[:2]) != (batch, g.kv_heads)
            or blocks.shape[2] > g.hot_slots
        ):
            msg = (
                f"blocks must be [B={batch}, Hkv={g.kv_heads}, K <= hot_slots={g.hot_slots}] "
                f"(token_blocks); got {tuple(blocks.shape)!r}"
            )
            raise KernelInputError(msg)
        span = self._record_span(layer)
        plan = self.planner.plan
        if blocks.shape[2]:
            self._fetch(span, blocks, counters)
        hot_tokens, tail_tokens = self._kernels.head_tokens(
            positions.to(torch.int32).contiguous(),
            plan.row_ids,
            plan.closed_blocks,
            self.tables.block_slot[span],
            slots=g.hot_slots,
        )
        hot, tail = (
            self._kernels.decode_split(
                q, tokens, *_head_records(cache[span]), scale=scale, merged=False
            )
            for tokens, cache in ((hot_tokens, self.hot), (tail_tokens, self.tail))
        )
        return self._kernels.merge(*hot, more=tail)  # one launch, no concatenation
