"""The label cache: the heavy channels of every key, preallocated per request row."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qsa_kernels._checks import check_ndim
from qsa_kernels.double_sparsity._errors import DSConfigError

__all__ = ("LabelCache",)

_LABEL_DTYPES = (torch.bfloat16, torch.float16)


class LabelCache:
    """Label rows ``k[:, h, channels[layer, h]]`` of every token, fixed size per request row.

    ``buffer`` is ``[L, R * max_tokens, Hkv, C]``; the token at logical position ``t`` of request
    row ``r`` lives at slot ``r * max_tokens + t`` of every layer. That is also the token slot of a
    resident K/V store of ``[R * max_tokens / 4, 2, 4, Hkv, D]`` records laid out row by row, so one
    slot table (:meth:`slots`) addresses both. Nothing is allocated after construction; writes are
    ``index_copy_`` into the buffer (FP8 keys are upcast to the label dtype, unscaled).

    Args:
        channels: ``[L, Hkv, C]`` int32/int64 heavy channels per layer (index ``l`` is the
            ``l``-th attention layer, as in :attr:`ChannelConfig.channels`).
        rows: request rows ``R``.
        max_tokens: tokens one row holds.
        dtype: bf16 or fp16 label dtype.
        device: where the buffer lives.
    """

    def __init__(
        self,
        channels: torch.Tensor,
        *,
        rows: int,
        max_tokens: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        check_ndim("channels", channels, 3, "[L, Hkv, C]")
        if channels.dtype not in (torch.int32, torch.int64):
            msg = f"channels has dtype {channels.dtype!r}; allowed: (torch.int32, torch.int64)"
            raise DSConfigError(msg)
        for name, value in (("rows", rows), ("max_tokens", max_tokens)):
            if type(value) is not int or value < 1:
                msg = f"{name}={value!r} is not allowed; it must be an int >= 1"
                raise DSConfigError(msg)
        if dtype not in _LABEL_DTYPES:
            msg = f"dtype={dtype!r} is not allowed; allowed: {_LABEL_DTYPES!r}"
            raise DSConfigError(msg)
        # The device of a real allocation: "cuda" resolves to "cuda:<index>", so later equality
        # checks against tensors' devices hold.
        self.channels = channels.to(device=torch.device(device), dtype=torch.int64).contiguous()
        self.device = self.channels.device
        self.rows = rows
        self.max_tokens = max_tokens
        layers, hkv, c = self.channels.shape
        self.buffer = torch.zeros(
            (layers, rows * max_tokens, hkv, c), dtype=dtype, device=self.device
        )

    @staticmethod
    def dtype_for(kv_dtype: torch.dtype) -> torch.dtype:
        """The label dtype of keys stored as ``kv_dtype``: the same when 16-bit, else bf16.

        FP8 keys (and any other) are upcast into bf16 labels, unscaled.
        """
        return kv_dtype if kv_dtype in _LABEL_DTYPES else torch.bfloat16

    @property
    def layers(self) -> int:
        """Attention layers ``L``."""
        return int(self.buffer.shape[0])

    def layer(self, layer: int) -> torch.Tensor:
        """``[R * max_tokens, Hkv, C]`` label rows of one layer (what ``label_topk`` reads)."""
        self._check_layer(layer)
        return self.buffer[layer]

    def slots(self, rows: Sequence[int], width: int) -> torch.Tensor:
        """``[B, width]`` int32 slot table: ``slots[b, t] = rows[b] * max_tokens + t``."""
        for row in rows:
            self._check_row(row)
        if not 0 <= width <= self.max_tokens:
            msg = f"width={width!r} is not allowed; allowed: [0, {self.max_tokens!r}]"
            raise DSConfigError(msg)
        return self.row_slots(
            torch.tensor(list(rows), dtype=torch.int32, device=self.device), width
        )

    def row_slots(self, row_ids: torch.Tensor, width: int) -> torch.Tensor:
        """:meth:`slots` for rows given on the device (``[B]`` int, not checked): no host read.

        Returns:
            ``[B, width]`` of ``row_ids``' dtype: ``row_ids[b] * max_tokens + t``.
        """
        offsets = torch.arange(width, dtype=row_ids.dtype, device=row_ids.device)
        return row_ids.unsqueeze(1) * self.max_tokens + offsets

    def write_prompt(self, layer: int, row: int, k: torch.Tensor, *, start: int = 0) -> None:
        """Write the labels of ``T`` consecutive keys of one row (a prompt or a prefill chunk).

        Args:
            layer: attention layer in ``[0, L)``.
            row: request row.
            k: ``[T, Hkv, D]`` keys of positions ``start .. start + T - 1``.
            start: first logical position written.
        """
        self._check_row(row)
        check_ndim("k", k, 3, "[T, Hkv, D]")
        tokens = int(k.shape[0])
        if start < 0 or start + tokens > self.max_tokens:
            msg = (
                f"positions [{start!r}, {start + tokens!r}) of row {row!r} are not allowed; "
                f"allowed: [0, {self.max_tokens!r})"
            )
            raise DSConfigError(msg)
        first = row * self.max_tokens + start
        slots = torch.arange(first, first + tokens, dtype=torch.int64, device=self.device)
        self._scatter(layer, slots, k)

    def append(
        self, layer: int, rows: Sequence[int], positions: Sequence[int], k: torch.Tensor
    ) -> None:
        """Write the label of one new key per row (a decode step).

        Args:
            layer: attention layer in ``[0, L)``.
            rows: ``B`` request rows.
            positions: ``B`` logical positions of the new tokens (``seq_len - 1`` after the step).
            k: ``[B, Hkv, D]`` the new keys.
        """
        check_ndim("k", k, 3, "[B, Hkv, D]")
        if len(rows) != len(positions) or len(rows) != k.shape[0]:
            msg = (
                f"rows ({len(rows)!r}), positions ({len(positions)!r}) and k "
                f"{tuple(k.shape)!r} must agree on B"
            )
            raise DSConfigError(msg)
        flat = []
        for row, pos in zip(rows, positions, strict=True):
            self._check_row(row)
            if not 0 <= pos < self.max_tokens:
                msg = (
                    f"position {pos!r} of row {row!r} is not allowed; "
                    f"allowed: [0, {self.max_tokens!r})"
                )
                raise DSConfigError(msg)
            flat.append(row * self.max_tokens + pos)
        slots = torch.tensor(flat, dtype=torch.int64, device=self.device)
        self._scatter(layer, slots, k)

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Write the labels of keys at arbitrary slots (a cache indexed by a pool's token slots).

        With ``rows=1`` and ``max_tokens`` equal to a K/V pool's slot count, slot ``s`` of the
        label cache belongs to token slot ``s`` of the pool, so one ``req_to_token`` addresses both.

        Args:
            layer: attention layer in ``[0, L)``.
            slots: ``[N]`` int32/int64 slots in ``[0, rows * max_tokens)``, on the cache's device.
            k: ``[N, Hkv, D]`` the keys written there.
        """
        check_ndim("slots", slots, 1, "[N]")
        check_ndim("k", k, 3, "[N, Hkv, D]")
        if slots.shape[0] != k.shape[0]:
            msg = f"slots {tuple(slots.shape)!r} and k {tuple(k.shape)!r} must agree on N"
            raise DSConfigError(msg)
        self._scatter(layer, slots.to(torch.int64), k)

    def _scatter(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        self._check_layer(layer)
        _, hkv, c = self.channels.shape
        if k.shape[1] != hkv or k.device != self.device:
            msg = (
                f"k must be [N, Hkv={hkv}, D] on {self.device!r}; "
                f"got {tuple(k.shape)!r} on {k.device!r}"
            )
            raise DSConfigError(msg)
        index = self.channels[layer].unsqueeze(0).expand(k.shape[0], hkv, c)
        labels = torch.gather(k.to(self.buffer.dtype), 2, index)
        self.buffer[layer].index_copy_(0, slots, labels)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layers:
            msg = f"layer={layer!r} is not allowed; allowed: [0, {self.layers!r})"
            raise DSConfigError(msg)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.rows:
            msg = f"row={row!r} is not allowed; allowed: [0, {self.rows!r})"
            raise DSConfigError(msg)
