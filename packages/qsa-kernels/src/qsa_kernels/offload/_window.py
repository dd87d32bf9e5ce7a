"""A staging area of one prompt held by a window of layers (DS-Offload's windowed staging).

A chunked prefill's dense attention needs, at layer ``l``, every earlier token's K/V of layer
``l`` only. With :attr:`OffloadGeometry.windowed_staging` the runtime's staging area holds one
layer of one prompt in token order (what the engine's prefill kernels read) and
:class:`StagingWindow` keeps the rest in the host arena:

- each layer's chunk is written through to the prompt's arena row as soon as it is staged
  (:meth:`StagingWindow.write_through`: the chunk's blocks, the first one completed with the
  prefix's tokens, the last one padded with zeros and kept on the device as the layer's open
  block);
- a layer's prefix is read back from the arena into the staging area before its chunk
  (:meth:`StagingWindow.restore`). On CUDA the next layer's prefix is read on a side stream
  while the current layer computes (into a buffer of one layer's records, the second layer of
  the window); elsewhere each read runs when its layer asks for it.

The arena then holds the prompt's complete blocks when the prompt is handed off, and only the
open blocks move to the row's tail (:meth:`StagingWindow.hand_off`). The bytes attended are the
staged bytes, read back unchanged, so the prefill's output is the whole staging area's.
"""

from __future__ import annotations

import torch

from qsa_kernels._geometry import BLOCK_TOKENS
from qsa_kernels.offload._store import OffloadStore

__all__ = ("StagingWindow",)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


class StagingWindow:
    """The host side of a windowed staging area over ``kv``'s arena (module docstring).

    Args:
        kv: the store whose arena rows take the prompts; its geometry has ``windowed_staging``.
    """

    def __init__(self, kv: OffloadStore) -> None:
        g = kv.geometry
        self.kv = kv
        self._per_layer = g.store_layers // g.layers
        #: The records of one layer's prefix, read back from the arena: ``[Ls / L, NB, 2, 4,
        #: Hr, D]``.
        self.prefix = torch.zeros(
            (self._per_layer, g.max_blocks, *g.record_shape), dtype=g.dtype, device=kv.device
        )
        #: Every record layer's open block of the prompt staged last: ``[Ls, 2, 4, Hr, D]``.
        self.open_records = torch.zeros(
            (g.store_layers, *g.record_shape), dtype=g.dtype, device=kv.device
        )
        self._stream: torch.cuda.Stream | None = None
        if kv.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=kv.device)  # type: ignore[no-untyped-call]
        # The prefix read ahead on the side stream: (row, layer, blocks) and its event.
        self._ahead: tuple[int, int, int] | None = None
        self._ahead_done: torch.cuda.Event | None = None

    def restore(
        self, layer: int, row: int, start: int, k_dst: torch.Tensor, v_dst: torch.Tensor
    ) -> None:
        """Put layer ``layer``'s first ``start`` tokens of ``row`` into ``k_dst`` / ``v_dst``.

        From the arena (what :meth:`write_through` wrote), read ahead on the side stream or now.

        Args:
            layer: the logical layer.
            row: the prompt's arena row.
            start: tokens before the chunk about to be staged.
            k_dst: ``[T_max, Hkv, D]`` the staging area's keys (token order).
            v_dst: its values.
        """
        blocks = _blocks(start)
        ahead, self._ahead = self._ahead, None
        if blocks == 0:
            return
        current = torch.cuda.current_stream(self.kv.device) if self._stream is not None else None
        if current is not None and ahead == (row, layer, blocks) and self._ahead_done is not None:
            current.wait_event(self._ahead_done)
        else:
            if current is not None and self._stream is not None:
                current.wait_stream(self._stream)  # the write-throughs land first
            self.kv.read_prompt_records(row, layer, blocks, self.prefix)
        records, tokens = self.prefix[:, :blocks], blocks * BLOCK_TOKENS
        k_dst[:tokens] = OffloadStore.record_tokens(records, 0)
        v_dst[:tokens] = OffloadStore.record_tokens(records, 1)

    def write_through(  # noqa: PLR0917 (restore's order, then the chunk)
        self,
        layer: int,
        row: int,
        start: int,
        end: int,
        k_src: torch.Tensor,
        v_src: torch.Tensor,
        next_layer: int | None,
    ) -> None:
        """Write tokens ``[start, end)`` of one layer to ``row``'s arena; read the next one ahead.

        Args:
            layer: the logical layer.
            row: the prompt's arena row.
            start: the chunk's first token.
            end: the chunk's end.
            k_src: ``[T_max, Hkv, D]`` the staging area's keys, holding tokens ``[0, end)``.
            v_src: its values.
            next_layer: the layer whose prefix (the same ``start`` tokens) the next
                :meth:`restore` of this chunk asks for; None when none does.
        """
        first = start // BLOCK_TOKENS * BLOCK_TOKENS
        padded = _blocks(end) * BLOCK_TOKENS
        k, v = (src.new_zeros((padded - first, *src.shape[1:])) for src in (k_src, v_src))
        k[: end - first], v[: end - first] = k_src[first:end], v_src[first:end]
        records = self.kv.prompt_records(k, v)
        span = slice(layer * self._per_layer, (layer + 1) * self._per_layer)
        if end % BLOCK_TOKENS:
            self.open_records[span] = records[:, -1]
        else:
            self.open_records[span].zero_()
        if self._stream is None:
            self.kv.write_prompt_records(row, layer, records, first // BLOCK_TOKENS)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(self._stream):
            self.kv.write_prompt_records(row, layer, records, first // BLOCK_TOKENS)
            records.record_stream(self._stream)
            blocks = _blocks(start)
            if next_layer is not None and blocks:
                self.kv.read_prompt_records(row, next_layer, blocks, self.prefix)
                self._ahead = (row, next_layer, blocks)
                self._ahead_done = self._stream.record_event()

    def hand_off(self, row: int, tokens: int) -> None:
        """``row``'s prompt of ``tokens`` tokens, all written through, takes its row."""
        self._ahead = None
        if self._stream is not None:
            torch.cuda.current_stream(self.kv.device).wait_stream(self._stream)
        self.kv.admit_written(row, tokens, self.open_records)
