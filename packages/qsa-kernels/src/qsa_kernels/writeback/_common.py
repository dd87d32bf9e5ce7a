"""Argument checks and the side-stream launch shared by the write-back kernels and references."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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

__all__ = ("check_blocks_args", "check_prompt_args", "run_on_side_stream")


def check_blocks_args(
    hot: torch.Tensor,
    host_arena: torch.Tensor,
    *,
    rows: torch.Tensor,
    layers: torch.Tensor,
    slots: torch.Tensor,
    blocks: torch.Tensor,
) -> None:
    """Validate a closed-block write-back: four ``[N]`` int32 index vectors and the two layouts."""
    check_ndim("hot", hot, 7, "[L, R, S, 2, 4, Hkv, D]")
    check_ndim("host_arena", host_arena, 7, "[R, L, NB, 2, 4, Hkv, D]")
    check_dtype("hot", hot, KV_DTYPES)
    if host_arena.dtype != hot.dtype or host_arena.shape[3:] != hot.shape[3:]:
        msg = (
            f"host_arena ({host_arena.dtype!r}, record {tuple(host_arena.shape[3:])!r}) must match "
            f"hot ({hot.dtype!r}, record {tuple(hot.shape[3:])!r})"
        )
        raise KernelInputError(msg)
    check_dim("host_arena", host_arena, 0, hot.shape[1], "R of hot")
    check_dim("host_arena", host_arena, 1, hot.shape[0], "L of hot")
    check_dim("hot", hot, 4, BLOCK_TOKENS, "tokens per block")
    for name, t in (("rows", rows), ("layers", layers), ("slots", slots), ("blocks", blocks)):
        check_ndim(name, t, 1, "[N]")
        check_dtype(name, t, (torch.int32,))
        check_dim(name, t, 0, rows.shape[0], "N of rows")
    check_same_device(hot.device, rows=rows, layers=layers, slots=slots, blocks=blocks)
    # The kernel reads the index vectors densely from their first element.
    check_contiguous(
        hot=hot, host_arena=host_arena, rows=rows, layers=layers, slots=slots, blocks=blocks
    )


def check_prompt_args(
    k: torch.Tensor, v: torch.Tensor, host_arena: torch.Tensor, row: int, first_block: int
) -> int:
    """Validate a prompt hand-off and return the number of complete blocks it writes."""
    check_ndim("k", k, 4, "[L, T, Hkv, D]")
    check_dtype("k", k, KV_DTYPES)
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        msg = (
            f"v ({tuple(v.shape)!r}, {v.dtype!r}, {v.device!r}) must match "
            f"k ({tuple(k.shape)!r}, {k.dtype!r}, {k.device!r})"
        )
        raise KernelInputError(msg)
    check_contiguous(k=k, v=v, host_arena=host_arena)
    check_ndim("host_arena", host_arena, 7, "[R, L, NB, 2, 4, Hkv, D]")
    if host_arena.dtype != k.dtype:
        msg = f"host_arena dtype {host_arena.dtype!r} must equal k dtype {k.dtype!r}"
        raise KernelInputError(msg)
    expected = (2, BLOCK_TOKENS, k.shape[2], k.shape[3])
    if tuple(host_arena.shape[3:]) != expected:
        msg = f"host_arena record shape {tuple(host_arena.shape[3:])!r}; expected {expected!r}"
        raise KernelInputError(msg)
    check_dim("host_arena", host_arena, 1, k.shape[0], "L of k")
    if (k.shape[3] * k.element_size()) % 4:
        msg = f"a K row must be a multiple of 4 bytes; got D={k.shape[3]!r} of {k.dtype!r}"
        raise KernelInputError(msg)
    if not 0 <= row < host_arena.shape[0]:
        msg = f"row must lie in [0, {host_arena.shape[0]!r}); got {row!r}"
        raise KernelInputError(msg)
    n_blocks = k.shape[1] // BLOCK_TOKENS
    if first_block < 0 or first_block + n_blocks > host_arena.shape[2]:
        msg = (
            f"blocks [{first_block!r}, {first_block + n_blocks!r}) do not fit the arena's "
            f"NB={host_arena.shape[2]!r} blocks per row"
        )
        raise KernelInputError(msg)
    return n_blocks


def run_on_side_stream(
    device: torch.device,
    stream: torch.cuda.Stream | None,
    launch: Callable[[], None],
    keep_alive: Sequence[torch.Tensor],
) -> torch.cuda.Event | None:
    """Run ``launch`` on ``stream`` after the current stream's work; return its completion event.

    On the CPU (the Triton interpreter) ``launch`` runs inline and ``None`` is returned; so it does
    when ``stream`` is the current stream, whose order already covers every later use (and which
    may be capturing a CUDA graph). Otherwise device tensors in ``keep_alive`` are marked as used
    by ``stream`` so the caching allocator does not recycle them before the copy ends.
    """
    if device.type != "cuda" or stream == torch.cuda.current_stream(device):
        launch()
        return None
    side = stream if stream is not None else torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        launch()
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(side)
    for t in keep_alive:
        if t.device.type == "cuda":
            t.record_stream(side)
    return done
