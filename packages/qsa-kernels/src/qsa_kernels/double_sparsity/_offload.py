"""DS-Offload: double sparsity over host-offloaded K/V.

The full K/V history of every request row lives in the pinned host arena of a
:class:`~qsa_kernels.offload.PerHeadOffloadedKV`; only the label cache (``C`` of ``D`` channels of
each key) and the per-row hot caches stay on the device. The store keeps one record per (block,
KV head) (:attr:`OffloadGeometry.per_head`), so a head's choice moves only its own bytes. A decode
step of one layer scores every token from the label cache, keeps the heavy tokens per KV head,
fetches each head's 4-token blocks that hold them (one fetch for every head, through the fetch
kernel and each head's hot-cache LRU), and attends only to the selected tokens: from the hot
cache for closed blocks, from the open-block tail for the newest ``seq_len % 4`` tokens. The
result equals resident double sparsity (:func:`ds_decode`).
The data path is :meth:`PerHeadOffloadedKV.token_blocks` and
:meth:`PerHeadOffloadedKV.attend_tokens`; this class adds the row-indexed label cache and the
selection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._path import KernelPath
from qsa_kernels.double_sparsity._config import DSConfig
from qsa_kernels.double_sparsity._decode import DSDecodeOutput, ds_positions, ds_positions_fixed
from qsa_kernels.double_sparsity._label_cache import LabelCache
from qsa_kernels.offload import OffloadGeometry, PerHeadOffloadedKV

__all__ = ("DSOffloadedKV",)


class DSOffloadedKV:
    """Double-sparsity K/V of one rank with the K/V history on the host.

    Composes a :class:`~qsa_kernels.offload.PerHeadOffloadedKV` (``kv``, per-head records: host
    arena ``[R, L Hkv, NB, 2, 4, 1, D]``, hot caches ``[L Hkv, R, S, 2, 4, 1, D]``, open-block
    tails) and a device :class:`LabelCache` (``labels``: ``[L, R * NB * 4, Hkv, C]``).

    Hot-cache size: one head's step needs a slot for every distinct closed block that holds one
    of its selected tokens, at most ``min(config.hot_blocks(), NB)``
    (:meth:`DSConfig.hot_blocks`); :meth:`decode` raises if ``S`` is smaller than a step's need.

    Args:
        geometry: sizes of the offloaded K/V (``layers`` = attention layers), with
            ``per_head=True``.
        channels: ``[L, Hkv, C]`` heavy channels (:attr:`ChannelConfig.channels`).
        config: the double-sparsity options.
        device: the device of the hot caches and the label cache.
        label_dtype: bf16 or fp16.
        path: the data path's implementation (:class:`~qsa_kernels.KernelPath`).
    """

    def __init__(
        self,
        geometry: OffloadGeometry,
        channels: torch.Tensor,
        *,
        config: DSConfig,
        device: torch.device | str,
        label_dtype: torch.dtype = torch.bfloat16,
        path: KernelPath = KernelPath.AUTO,
    ) -> None:
        device = torch.device(device)
        if not geometry.per_head:
            msg = (
                "DS-Offload keeps one record per KV head; got a geometry with per_head=False "
                "(give OffloadGeometry(..., per_head=True))"
            )
            raise KernelInputError(msg)
        if channels.dim() != 3 or tuple(channels.shape[:2]) != (geometry.layers, geometry.kv_heads):
            msg = (
                f"channels must be [L={geometry.layers}, Hkv={geometry.kv_heads}, C]; got "
                f"{tuple(channels.shape)!r}"
            )
            raise KernelInputError(msg)
        self.config = config
        self.kv = PerHeadOffloadedKV(geometry, device, path=path)
        self.labels = LabelCache(
            channels,
            rows=geometry.rows,
            max_tokens=geometry.max_tokens,
            dtype=label_dtype,
            device=device,
        )
        self._step = -1

    @property
    def geometry(self) -> OffloadGeometry:
        """Sizes of the offloaded K/V."""
        return self.kv.geometry

    def length(self, row: int) -> int:
        """Tokens row ``row`` holds."""
        return self.kv.length(row)

    def admit(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Take a prefilled prompt into a free row: K/V to host (open block to the tail), labels.

        Args:
            row: a free request row.
            k: ``[L, T, Hkv, D]`` prompt keys (device, the geometry's dtype).
            v: ``[L, T, Hkv, D]`` prompt values.
        """
        self.kv.admit(row, k, v)
        for layer in range(self.geometry.layers):
            self.labels.write_prompt(layer, row, k[layer])

    def release(self, row: int) -> None:
        """Free a row (its label rows are overwritten by the next admit)."""
        self.kv.release(row)

    def begin_step(self) -> int:
        """Start a decode step; returns its stamp. Call :meth:`decode` once per layer per step."""
        self._step = self.kv.begin_step()
        return self._step

    def append(self, rows: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one token per row to every layer (K/V, write-back of closed blocks, labels).

        Args:
            rows: ``B`` distinct active rows.
            k: ``[L, B, Hkv, D]`` the new token's keys.
            v: ``[L, B, Hkv, D]`` its values.
        """
        positions = [self.kv.length(r) for r in rows]
        self.kv.append(rows, k, v)
        for layer in range(self.geometry.layers):
            self.labels.append(layer, rows, positions, k[layer])

    def decode(
        self,
        layer: int,
        rows: Sequence[int],
        q: torch.Tensor,
        *,
        scale: float | None = None,
    ) -> DSDecodeOutput:
        """Double-sparsity attention of one layer for ``B`` active rows.

        Args:
            layer: attention layer in ``[0, L)``.
            rows: ``B`` distinct active rows.
            q: ``[B, Hq, D]`` bf16 queries.
            scale: softmax scale, ``1 / sqrt(D)`` if ``None``.

        Returns:
            :class:`DSDecodeOutput`; ``positions`` are the logical positions attended.

        Raises:
            KernelInputError: bad arguments, no :meth:`begin_step`, or a hot cache too small for
                the step's blocks.
        """
        self._check_decode(layer)
        if len(set(rows)) != len(rows) or not rows:
            msg = f"rows {list(rows)!r} must be non-empty and distinct"
            raise KernelInputError(msg)
        lengths = [self.kv.length(r) for r in rows]
        positions = ds_positions(
            q,
            self.labels.layer(layer),
            self.labels.channels[layer],
            self.labels.slots(rows, max(lengths)),
            lengths,
            config=self.config,
        )
        try:
            blocks = self.kv.token_blocks(rows, positions)
        except KernelInputError as exc:
            msg = (
                f"layer {layer!r}: {exc}; DSConfig.hot_blocks() = "
                f"{self.config.hot_blocks()!r} slots never run short"
            )
            raise KernelInputError(msg) from exc
        out, lse = self.kv.attend_tokens(layer, rows, q, positions, blocks, scale=scale)
        return DSDecodeOutput(out, lse, positions)

    def decode_fixed(
        self,
        layer: int,
        rows: Sequence[int],
        q: torch.Tensor,
        *,
        scale: float | None = None,
    ) -> DSDecodeOutput:
        """:meth:`decode` with no host read and fixed shapes: one layer of a CUDA-graph step.

        The rows and lengths come from the store's step plan on the device (what
        :meth:`begin_step` and :meth:`append` left there), the token choice is
        :func:`ds_positions_fixed` over each row's whole label range, and the block lists are
        not counted on the host (the hot caches must hold :meth:`DSConfig.hot_blocks` slots).
        The result equals :meth:`decode`'s, its positions padded with ``-1`` to
        ``config.fixed_width()``.

        Args:
            layer: attention layer in ``[0, L)``.
            rows: the step's rows (as given to :meth:`append`).
            q: ``[B, Hq, D]`` bf16 queries.
            scale: softmax scale, ``1 / sqrt(D)`` if ``None``.

        Raises:
            KernelInputError: bad arguments, no :meth:`begin_step`, or hot caches smaller than
                ``config.hot_blocks()`` (or a whole context).
        """
        g = self.geometry
        self._check_decode(layer)
        need = min(self.config.hot_blocks(), g.max_blocks)
        if g.hot_slots < need:
            msg = (
                f"hot_slots={g.hot_slots!r} is not allowed for a fixed-shape step; allowed: at "
                f"least DSConfig.hot_blocks()={self.config.hot_blocks()!r} (or the row's "
                f"{g.max_blocks!r} blocks)"
            )
            raise KernelInputError(msg)
        positions = ds_positions_fixed(
            q,
            self.labels.layer(layer),
            self.labels.channels[layer],
            self.labels.row_slots(self.kv.step_row_ids, g.max_tokens),
            self.kv.step_lengths,
            config=self.config,
        )
        blocks = self.kv.token_blocks(rows, positions, checked=False)
        out, lse = self.kv.attend_tokens(layer, rows, q, positions, blocks, scale=scale)
        return DSDecodeOutput(out, lse, positions)

    def _check_decode(self, layer: int) -> None:
        """A decode call needs a stamped step and a layer of the store."""
        if self._step < 0:
            msg = "decode before begin_step(); every decode step needs a stamp"
            raise KernelInputError(msg)
        if not 0 <= layer < self.geometry.layers:
            msg = f"layer={layer!r} is not allowed; allowed: [0, {self.geometry.layers})"
            raise KernelInputError(msg)
