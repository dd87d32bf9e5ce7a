"""The offloaded K/V of the QSA layers: host arena, per-request hot caches and open-block tails.

This composes the decode-path kernels into the data path of one rank. Each request row keeps its
whole raw K/V history in a pinned host arena; the device holds, per (layer, row), a hot cache of
``S`` block slots governed by the ``qsa_core`` residency contract, plus the open (incomplete) block
of the row. A decode step of one layer fetches the selected blocks that miss, attends over them in
the hot cache and over the open block in the tail, and merges the two parts by their LSE.

Ordering across streams is explicit: a closed block is written back on a side stream, and the
current stream waits on that copy's event before it reuses the tail record or fetches from the
arena. Nothing here allocates pinned memory after construction.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._path import KernelPath
from qsa_kernels.fetch import (
    BLOCK_TOKENS,
    HotCacheTables,
    fetch_selected_blocks,
    fetch_selected_blocks_reference,
)
from qsa_kernels.lse_merge import lse_merge, lse_merge_reference
from qsa_kernels.sparse_decode import sparse_decode, sparse_decode_reference
from qsa_kernels.writeback import (
    offload_prompt,
    offload_prompt_reference,
    writeback_blocks,
    writeback_blocks_reference,
)

__all__ = ("OffloadGeometry", "OffloadedKV", "RowState")

_KV_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)


class RowState(enum.Enum):
    """Whether a request row holds a request."""

    FREE = "free"
    ACTIVE = "active"


@dataclass(frozen=True, slots=True)
class OffloadGeometry:
    """Sizes of one rank's offloaded K/V.

    Attributes:
        layers: QSA layers ``L`` (12 for Qwen3.8-Flash-Next).
        rows: request rows ``R`` (concurrent requests).
        hot_slots: hot-cache block slots ``S`` per (layer, row); at least the block top-k.
        max_blocks: host arena blocks ``NB`` per (row, layer): ``ceil(max_context / 4)``.
        kv_heads: K/V heads per rank ``Hkv``.
        head_dim: ``D``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.bfloat16``.
    """

    layers: int
    rows: int
    hot_slots: int
    max_blocks: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("layers", "rows", "hot_slots", "max_blocks", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                msg = f"{name}={value!r} is not allowed; it must be a positive integer"
                raise KernelInputError(msg)
        if self.dtype not in _KV_DTYPES:
            msg = f"dtype={self.dtype!r} is not allowed; allowed: {_KV_DTYPES!r}"
            raise KernelInputError(msg)

    @property
    def max_tokens(self) -> int:
        """Tokens one row can hold (``NB × 4``)."""
        return self.max_blocks * BLOCK_TOKENS

    @property
    def record_shape(self) -> tuple[int, int, int, int]:
        """One block of one layer: ``[2, 4, Hkv, D]`` (its K rows, then its V rows)."""
        return (2, BLOCK_TOKENS, self.kv_heads, self.head_dim)

    @property
    def record_bytes(self) -> int:
        """Bytes of one record (one block of one layer, K and V)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * BLOCK_TOKENS * self.kv_heads * self.head_dim * element

    @property
    def host_bytes(self) -> int:
        """Bytes of the host arena: ``R × L × NB`` records."""
        return self.rows * self.layers * self.max_blocks * self.record_bytes

    @property
    def device_bytes(self) -> int:
        """Device bytes :class:`OffloadedKV` allocates: hot caches, tails and residency tables.

        ``L × R × (S + 1)`` records, plus ``L × R × S`` int32 block ids and int64 stamps and
        ``L × R × NB`` int32 slots.
        """
        caches = self.layers * self.rows * (self.hot_slots + 1) * self.record_bytes
        per_slot = 4 + 8  # an int32 block id and an int64 stamp
        tables = self.layers * self.rows * (self.hot_slots * per_slot + self.max_blocks * 4)
        return caches + tables


@dataclass(frozen=True, slots=True)
class _Kernels:
    """The four operations of the data path, from one implementation (see :class:`KernelPath`).

    The write-back and prompt offload return the event that completes them (``None`` when they
    ran synchronously).
    """

    fetch: Callable[..., torch.Tensor]
    decode: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    merge: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    writeback: Callable[..., torch.cuda.Event | None]
    offload: Callable[..., torch.cuda.Event | None]


def _writeback_reference(*args: Any, **kwargs: Any) -> None:
    writeback_blocks_reference(*args, **kwargs)


def _offload_reference(*args: Any, **kwargs: Any) -> None:
    offload_prompt_reference(*args, **kwargs)


_KERNELS = {
    KernelPath.TRITON: _Kernels(
        fetch=fetch_selected_blocks,
        decode=sparse_decode,
        merge=lse_merge,
        writeback=writeback_blocks,
        offload=lambda *args, **kwargs: offload_prompt(*args, **kwargs)[1],
    ),
    KernelPath.REFERENCE: _Kernels(
        fetch=fetch_selected_blocks_reference,
        decode=sparse_decode_reference,
        merge=lse_merge_reference,
        writeback=_writeback_reference,
        offload=_offload_reference,
    ),
}


@dataclass(frozen=True, slots=True)
class _StepRows:
    """What one decode step writes, fixed by :meth:`OffloadedKV.advance` for every layer.

    Attributes:
        rows: the step's rows, in batch order.
        index: ``[2, B]`` int64 device tensor: each row and the tail offset of its new token.
        closed: ``[2, C]`` int32 device tensor: the rows whose block the new token closes, and
            that block's index; ``None`` when no block closes.
    """

    rows: tuple[int, ...]
    index: torch.Tensor
    closed: torch.Tensor | None


class OffloadedKV:
    """One rank's QSA K/V under host offload (see the module docstring).

    Shapes: host arena ``[R, L, NB, 2, 4, Hkv, D]`` (pinned where CUDA exists), hot cache
    ``[L, R, S, 2, 4, Hkv, D]``, open-block tails ``[L, R, 1, 2, 4, Hkv, D]`` (device), residency
    tables :class:`~qsa_kernels.HotCacheTables`. Token counts per row are tracked on the host.

    A decode step either appends every layer's token at once (:meth:`append`), or, as a model's
    forward pass produces them, counts the token once (:meth:`advance`) and then writes it layer
    by layer (:meth:`write_token`) just before that layer attends (:meth:`attend`).

    ``path`` picks the implementation: the Triton kernels, or their torch references (same
    contract; what a CPU-only engine runs). :attr:`KernelPath.AUTO` takes Triton on CUDA.
    """

    def __init__(
        self,
        geometry: OffloadGeometry,
        device: torch.device,
        *,
        path: KernelPath = KernelPath.AUTO,
    ) -> None:
        self.geometry = geometry
        g = geometry
        pin = device.type == "cuda"
        self.host_arena = torch.empty(
            (g.rows, g.layers, g.max_blocks, *g.record_shape), dtype=g.dtype, pin_memory=pin
        )
        self.hot = torch.zeros(
            (g.layers, g.rows, g.hot_slots, *g.record_shape), dtype=g.dtype, device=device
        )
        self.tail = torch.zeros(
            (g.layers, g.rows, 1, *g.record_shape), dtype=g.dtype, device=device
        )
        # The device of a real allocation ("cuda" resolves to "cuda:<index>").
        self.device = self.hot.device
        self.path = path.resolve(self.device)
        self._kernels = _KERNELS[self.path]
        self.tables = HotCacheTables.empty(g.layers, g.rows, g.hot_slots, g.max_blocks, device)
        self._lengths = [0] * g.rows
        self._states = [RowState.FREE] * g.rows
        self._step = -1
        self._pending: list[torch.cuda.Event] = []
        self._layer_ids = torch.arange(g.layers, dtype=torch.int32, device=self.device)
        self._block_offsets = torch.arange(BLOCK_TOKENS, dtype=torch.int32, device=self.device)
        # Per batch of rows: (row ids, open-block token ids) on the device, reused by every layer
        # until a row's length changes.
        self._row_indices: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._step_rows: _StepRows | None = None

    # -- request lifecycle --

    def length(self, row: int) -> int:
        """Tokens row ``row`` holds."""
        return self._lengths[self._check_row(row)]

    def admit(
        self,
        row: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        prefix: torch.Tensor | None = None,
    ) -> None:
        """Take a prefilled prompt into a free row: complete blocks to host, the open block to tail.

        With ``prefix`` (the records of a cached prefix, e.g. restored from a host prefix cache),
        the prompt is ``prefix`` followed by ``k``/``v``: the prefix records go to the row's first
        arena blocks as they are, and only the new tokens are offloaded after them.

        Args:
            row: a free request row.
            k: ``[L, T, Hkv, D]`` keys of every QSA layer for the tokens after the prefix
                (device, the geometry's dtype); ``T`` may be 0 only with a prefix.
            v: ``[L, T, Hkv, D]`` values.
            prefix: ``[L, P, 2, 4, Hkv, D]`` records of the first ``P`` complete blocks
                (``4 P`` tokens), any device, the geometry's dtype; ``None`` for no prefix.
        """
        self._check_row(row)
        if self._states[row] is not RowState.FREE:
            msg = f"row {row!r} is {self._states[row].value!r}; admit needs a free row"
            raise KernelInputError(msg)
        g = self.geometry
        expected = (g.layers, k.shape[1] if k.dim() == 4 else -1, g.kv_heads, g.head_dim)
        if k.dim() != 4 or tuple(k.shape) != expected or tuple(v.shape) != expected:
            msg = (
                f"k and v must be [L={g.layers}, T, Hkv={g.kv_heads}, D={g.head_dim}]; got "
                f"{tuple(k.shape)!r} and {tuple(v.shape)!r}"
            )
            raise KernelInputError(msg)
        prefix_blocks = 0 if prefix is None else int(prefix.shape[1]) if prefix.dim() == 6 else -1
        if prefix is not None and (
            prefix_blocks < 0
            or tuple(prefix.shape) != (g.layers, prefix_blocks, *g.record_shape)
            or prefix.dtype != g.dtype
        ):
            msg = (
                f"prefix must be [L={g.layers}, P, {', '.join(map(str, g.record_shape))}] "
                f"{g.dtype}; got {tuple(prefix.shape)!r} {prefix.dtype}"
            )
            raise KernelInputError(msg)
        first = prefix_blocks * BLOCK_TOKENS
        tokens = first + int(k.shape[1])
        if tokens == 0 or tokens > g.max_tokens:
            msg = f"a prompt of {tokens!r} tokens is not allowed; allowed: 1..{g.max_tokens!r}"
            raise KernelInputError(msg)
        self.tables.reset_rows(torch.tensor([row], device=self.device))
        if prefix is not None:
            self.wait_for_host_writes()
            if self.device.type == "cuda":  # the arena may still be read by queued fetches
                torch.cuda.current_stream(self.device).synchronize()
            self.host_arena[row, :, :prefix_blocks].copy_(prefix)
        self._remember(
            self._kernels.offload(
                k.contiguous(), v.contiguous(), self.host_arena, row, first_block=prefix_blocks
            )
        )
        closed = tokens // BLOCK_TOKENS * BLOCK_TOKENS
        open_tokens = tokens - closed
        self.tail[:, row].zero_()
        if open_tokens:
            self.tail[:, row, 0, 0, :open_tokens] = k[:, closed - first :]
            self.tail[:, row, 0, 1, :open_tokens] = v[:, closed - first :]
        self._set_length(row, tokens)
        self._states[row] = RowState.ACTIVE

    def export_prefix(self, row: int, blocks: int) -> torch.Tensor:
        """The records of a row's first ``blocks`` complete blocks, for a host prefix cache.

        Returns:
            ``[L, blocks, 2, 4, Hkv, D]`` contiguous host tensor (a copy; written back blocks only,
            so ``4 × blocks`` must not exceed the row's closed tokens).
        """
        self._check_row(row)
        closed_blocks = self._lengths[row] // BLOCK_TOKENS
        if not 0 < blocks <= closed_blocks:
            msg = (
                f"blocks={blocks!r} is not allowed for row {row!r}; allowed: 1..{closed_blocks!r} "
                "(its complete blocks)"
            )
            raise KernelInputError(msg)
        self.wait_for_host_writes()
        if self.device.type == "cuda":  # the host reads the arena: device writes must be done
            torch.cuda.current_stream(self.device).synchronize()
        return self.host_arena[row, :, :blocks].contiguous()

    def state(self, row: int) -> RowState:
        """Whether row ``row`` holds a request."""
        return self._states[self._check_row(row)]

    def release(self, row: int) -> None:
        """Free a row; its arena bytes are left as they are and overwritten by the next admit."""
        self._check_row(row)
        self._states[row] = RowState.FREE
        self._set_length(row, 0)
        if self._step_rows is not None and row in self._step_rows.rows:
            self._step_rows = None

    # -- one decode step --

    def begin_step(self) -> int:
        """Start a decode step; returns its stamp (one stamp serves every layer of the step)."""
        self._step += 1
        return self._step

    def advance(self, rows: Sequence[int]) -> None:
        """Count one new token in each row; :meth:`write_token` then stores it, layer by layer.

        Every row is checked before anything changes. A row whose new token opens a block gets a
        clean tail record in every layer.

        Args:
            rows: ``B`` distinct active rows, each with room for one more token.
        """
        g = self.geometry
        self._check_active(rows)
        positions = [self._lengths[row] for row in rows]
        for row, position in zip(rows, positions, strict=True):
            if position >= g.max_tokens:
                msg = f"row {row!r} is full ({g.max_tokens!r} tokens)"
                raise KernelInputError(msg)
        self.wait_for_host_writes()  # a closed tail may still be on its way to host
        offsets = [position % BLOCK_TOKENS for position in positions]
        fresh = [row for row, offset in zip(rows, offsets, strict=True) if offset == 0]
        if fresh:
            self.tail[:, torch.tensor(fresh, device=self.device)] = 0
        closing = [
            (row, position // BLOCK_TOKENS)
            for row, position, offset in zip(rows, positions, offsets, strict=True)
            if offset == BLOCK_TOKENS - 1
        ]
        index = torch.tensor([list(rows), offsets]).to(self.device)
        closed = (
            torch.tensor(closing, dtype=torch.int32).T.contiguous().to(self.device)
            if closing
            else None
        )
        for row, position in zip(rows, positions, strict=True):
            self._set_length(row, position + 1)
        self._step_rows = _StepRows(tuple(rows), index, closed)

    def write_token(
        self, layer: int | None, rows: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store the token counted by the last :meth:`advance`; write back a block it closes.

        Args:
            layer: QSA layer index in ``[0, L)``, or ``None`` for every layer at once.
            rows: the rows of the last :meth:`advance`, in the same order.
            k: ``[B, Hkv, D]`` the token's keys in ``layer`` (``[L, B, Hkv, D]`` for every layer),
                the geometry's dtype.
            v: the token's values, shaped like ``k``.
        """
        g = self.geometry
        step = self._step_rows
        if step is None or step.rows != tuple(rows):
            have = None if step is None else list(step.rows)
            msg = f"write_token for rows {list(rows)!r}; the last advance() counted rows {have!r}"
            raise KernelInputError(msg)
        if layer is not None and not 0 <= layer < g.layers:
            msg = f"layer={layer!r} is not allowed; allowed: [0, {g.layers}) or None"
            raise KernelInputError(msg)
        per_layer = (len(rows), g.kv_heads, g.head_dim)
        expected = per_layer if layer is not None else (g.layers, *per_layer)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            msg = f"k and v must be {expected!r}; got {tuple(k.shape)!r} and {tuple(v.shape)!r}"
            raise KernelInputError(msg)
        target = self.tail if layer is None else self.tail[layer]
        head = (slice(None),) if layer is None else ()
        target[(*head, step.index[0], 0, 0, step.index[1])] = k.to(g.dtype)
        target[(*head, step.index[0], 0, 1, step.index[1])] = v.to(g.dtype)
        if step.closed is None:
            return
        closed = step.closed
        n = int(closed.shape[1])
        if layer is None:
            rows_t, blocks_t = closed[0].repeat(g.layers), closed[1].repeat(g.layers)
            layers_t = self._layer_ids.repeat_interleave(n)
        else:
            rows_t, blocks_t = closed[0], closed[1]
            layers_t = self._layer_ids[layer : layer + 1].expand(n).contiguous()
        self._remember(
            self._kernels.writeback(
                self.tail,
                self.host_arena,
                rows=rows_t,
                layers=layers_t,
                slots=torch.zeros_like(rows_t),
                blocks=blocks_t,
            )
        )

    def append(self, rows: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one token per row to every layer; a block that closes is written back to host.

        Args:
            rows: ``B`` distinct active rows.
            k: ``[L, B, Hkv, D]`` the new token's keys in every QSA layer.
            v: ``[L, B, Hkv, D]`` its values.
        """
        g = self.geometry
        expected = (g.layers, len(rows), g.kv_heads, g.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            msg = f"k and v must be {expected!r}; got {tuple(k.shape)!r} and {tuple(v.shape)!r}"
            raise KernelInputError(msg)
        self.advance(rows)
        self.write_token(None, rows, k, v)

    def attend(
        self,
        layer: int,
        rows: Sequence[int],
        q: torch.Tensor,
        blocks: torch.Tensor,
        *,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer for ``B`` rows over their selected blocks and their open block.

        Args:
            layer: QSA layer index in ``[0, L)``.
            rows: ``B`` distinct active rows.
            q: ``[B, Hq, D]`` bf16 queries.
            blocks: ``[B, K]`` int32 selected complete blocks (``-1`` padding), ``K <= S``.
            scale: softmax scale, ``1 / sqrt(D)`` if ``None``.

        Returns:
            ``(out [B, Hq, D] bf16, lse [B, Hq] fp32)``, the attention over the selected blocks'
            tokens and the row's open-block tokens, natural-log LSE.
        """
        g = self.geometry
        if not 0 <= layer < g.layers:
            msg = f"layer={layer!r} is not allowed; allowed: [0, {g.layers})"
            raise KernelInputError(msg)
        self._check_active(rows)
        if blocks.dim() != 2 or blocks.shape[0] != len(rows):
            msg = f"blocks must be [B={len(rows)}, K]; got {tuple(blocks.shape)!r}"
            raise KernelInputError(msg)
        if self._step < 0:
            msg = "attend before begin_step(); every decode step needs a stamp"
            raise KernelInputError(msg)
        self.wait_for_host_writes()
        row_t, tail_tokens = self._indices_of(rows)
        slots = self._kernels.fetch(
            blocks.to(torch.int32).contiguous().unsqueeze(1),
            row_t,
            self._layer_ids[layer : layer + 1],
            step=self._step,
            tables=self.tables,
            hot=self.hot,
            host_arena=self.host_arena,
        )[:, 0]
        hot_tokens = torch.where(
            slots.unsqueeze(-1) >= 0, slots.unsqueeze(-1) * BLOCK_TOKENS + self._block_offsets, -1
        ).reshape(len(rows), -1)
        hot_records = self.hot[layer].view(g.rows * g.hot_slots, *g.record_shape)
        # Both parts stay fp32 until the merge, so the output is rounded to bf16 once.
        out_hot, lse_hot = self._kernels.decode(
            q, hot_tokens, hot_records, scale=scale, out_dtype=torch.float32
        )

        tail_records = self.tail[layer].view(g.rows, *g.record_shape)
        out_tail, lse_tail = self._kernels.decode(
            q, tail_tokens, tail_records, scale=scale, out_dtype=torch.float32
        )
        return self._kernels.merge(
            torch.stack((out_hot, out_tail)),
            torch.stack((lse_hot, lse_tail)),
            out_dtype=torch.bfloat16,
        )

    def wait_for_host_writes(self) -> None:
        """Order the current stream after every write to the host arena or tail still in flight.

        Call it before reading the arena from the device by other means (e.g. a fetch issued by
        a caller); :meth:`append` and :meth:`attend` call it themselves. It does not block the host.
        """
        if self._pending:
            stream = torch.cuda.current_stream(self.device)
            for event in self._pending:
                stream.wait_event(event)
            self._pending.clear()

    # -- internals --

    def _check_row(self, row: int) -> int:
        if not 0 <= row < self.geometry.rows:
            msg = f"row={row!r} is not allowed; allowed: [0, {self.geometry.rows})"
            raise KernelInputError(msg)
        return row

    def _check_active(self, rows: Sequence[int]) -> None:
        if len(set(rows)) != len(rows):
            msg = f"rows {list(rows)!r} repeat a row; each row may appear once per call"
            raise KernelInputError(msg)
        for row in rows:
            if self._states[self._check_row(row)] is not RowState.ACTIVE:
                msg = f"row {row!r} is {self._states[row].value!r}; it must be active"
                raise KernelInputError(msg)

    def _set_length(self, row: int, tokens: int) -> None:
        self._lengths[row] = tokens
        self._row_indices.clear()

    def _indices_of(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B] int32 row ids, [B, 3] int32 open-block token ids, -1 padded)`` on the device.

        Built with one host-to-device copy on a batch's first layer, then reused by every layer
        until a row's length changes.
        """
        key = tuple(rows)
        cached = self._row_indices.get(key)
        if cached is None:
            counts = [self._lengths[row] % BLOCK_TOKENS for row in rows]
            index = torch.tensor([list(rows), counts], dtype=torch.int32).to(self.device)
            row_t, open_counts = index[0], index[1]
            offsets = self._block_offsets[: BLOCK_TOKENS - 1]
            tail_tokens = torch.where(
                offsets < open_counts.unsqueeze(-1),
                row_t.unsqueeze(-1) * BLOCK_TOKENS + offsets,
                -1,
            )
            cached = self._row_indices[key] = (row_t, tail_tokens)
        return cached

    def _remember(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self._pending.append(event)
