"""Exact row-wise top-k on packed 64-bit keys, shared by the indexer, label scoring and the merge.

The order is score descending with ties to the smaller index. Each candidate becomes the signed
64-bit key ``(ordered(score) << 32) | (0xFFFFFFFF - index)``: ``ordered`` maps the fp32 bits to a
signed 32-bit integer that increases with the value (``-0.0`` canonicalised to ``+0.0`` first), and
the inverted index makes the smaller index the larger key among equal scores. Non-candidates get
``INT64_MIN``. Keys of distinct indices are distinct, so the top ``k`` keys are one exact set.

:func:`topk_from_keys` selects rows of at least :data:`RADIX_MIN_WIDTH` columns with the radix
select (:mod:`._radix`: no ``torch.topk``, no sort) and narrower rows with ``torch.topk`` (a
multi-block radix select on the GPU) followed by a small kernel that decodes the ids and sorts
them ascending.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qsa_kernels import _topk_radix as _radix
from qsa_kernels._topk_keys import KEY_NONE_JIT

#: Rows of at least this many columns select by :mod:`._radix`, narrower ones by ``torch.topk``.
#: Measured on an H200 (``docs/bench/selection.md``): at 16K-256K columns the radix select with its
#: histogram fused into indexer scoring took 30-82 us where the ``torch.topk`` path took 44-121 us.
RADIX_MIN_WIDTH = 4096
_PACK_BLOCK = 1024


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The interpreter emulates bf16 ``tl.dot`` operands incorrectly, so kernels take fp32 operands
    there (exact for bf16 and fp8 values) and bf16 tensor-core operands on a GPU.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def ordered_bits(x):  # type: ignore[no-untyped-def]
    """Float32 -> int32, strictly increasing in the float value; ``-0.0`` maps like ``+0.0``."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.int32, bitcast=True)
    return tl.where(u >= 0, u, u ^ 0x7FFFFFFF)


@triton.jit
def pack_key(score, index, valid):  # type: ignore[no-untyped-def]
    """``(ordered(score) << 32) | (0xFFFFFFFF - index)`` as int64, ``INT64_MIN`` where invalid."""
    hi = ordered_bits(score).to(tl.int64)
    key = (hi << 32) | (4294967295 - index.to(tl.int64))
    return tl.where(valid, key, KEY_NONE_JIT)


@triton.jit  # type: ignore[untyped-decorator]
def _pack_rows_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    scores_ptr,  # [rows, width] fp32
    lengths_ptr,  # [rows] int32 / int64: candidates are columns [0, n)
    keys_ptr,  # [rows, width] int64
    width,
    stride_s,
    stride_k,
    BLOCK: tl.constexpr,  # constexpr: columns per program
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(lengths_ptr + row).to(tl.int64)
    valid = (col < n) & (col < width)
    s = tl.load(scores_ptr + row * stride_s + col, mask=valid, other=0.0)
    tl.store(keys_ptr + row * stride_k + col, pack_key(s, col, valid), mask=col < width)


@triton.jit  # type: ignore[untyped-decorator]
def _ids_ascending_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    top_ptr,  # [rows, kk] int64 selected keys, any order
    out_ptr,  # [rows, K] int32
    kk,
    stride_t,
    stride_o,
    K: tl.constexpr,  # constexpr: outputs per row
    K_PAD: tl.constexpr,  # constexpr: K rounded up to a power of two for tl.sort
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, K_PAD)
    key = tl.load(top_ptr + row * stride_t + c, mask=c < kk, other=KEY_NONE_JIT)
    none = key == KEY_NONE_JIT
    ids = tl.where(none, 2147483647, 4294967295 - (key & 4294967295)).to(tl.int32)
    ids = tl.sort(ids)
    tl.store(out_ptr + row * stride_o + c, tl.where(ids == 2147483647, -1, ids), mask=c < K)


def uses_radix(width: int) -> bool:
    """Whether rows of ``width`` columns select by the radix select (else ``torch.topk``)."""
    return width >= RADIX_MIN_WIDTH


def topk_from_keys(keys: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Write the ids of the top ``k`` keys of each row into ``out`` ``[rows, k]`` int32, ascending.

    Args:
        keys: ``[rows, width]`` int64 packed keys (:func:`pack_key`) whose index field is the
            key's column, contiguous.
        k: ids per row, ``>= 1``.
        out: ``[rows, k]`` int32, unit last stride; ``-1`` after the ids of real keys.
    """
    rows, width = keys.shape
    if rows == 0:
        return
    if width == 0:
        out.fill_(-1)
        return
    if uses_radix(width):
        _radix.radix_topk_from_keys(keys, k, out)
        return
    top = torch.topk(keys, min(k, width), dim=1, sorted=False).values
    _ids_ascending_kernel[(rows,)](
        top,
        out,
        top.shape[1],
        top.stride(0),
        out.stride(0),
        K=k,
        K_PAD=triton.next_power_of_2(k),
        num_warps=4,
    )


def row_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Write the top ``k`` column indices of each row of ``scores`` into ``out``.

    Args:
        scores: ``[rows, width]`` fp32, unit stride along ``width``. NaN order is unspecified.
        lengths: ``[rows]`` int32 or int64, candidates per row (columns ``[0, n)``; clamped to
            ``[0, width]``).
        k: columns to keep per row, ``>= 1``.
        out: ``[rows, k]`` int32, unit stride along ``k``; receives the indices in ascending order,
            ``-1`` padded when ``n < k``. Every element is written.
    """
    rows, width = scores.shape
    if rows == 0:
        return
    keys = torch.empty((rows, width), dtype=torch.int64, device=scores.device)
    if width > 0:
        _pack_rows_kernel[(rows, triton.cdiv(width, _PACK_BLOCK))](
            scores,
            lengths,
            keys,
            width,
            scores.stride(0),
            keys.stride(0),
            BLOCK=_PACK_BLOCK,
            num_warps=4,
        )
    topk_from_keys(keys, k, out)


def row_topk_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Torch definition of :func:`row_topk`: ``[rows, k]`` int32, ascending, ``-1`` padded."""
    rows, width = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    for r in range(rows):
        n = max(0, min(int(lengths[r]), width))
        if n <= k:
            out[r, :n] = torch.arange(n, dtype=torch.int32, device=scores.device)
            continue
        s = scores[r, :n].float()
        s = torch.where(s == 0, torch.zeros_like(s), s)
        bits = s.view(torch.int32).to(torch.int64)
        ordered = torch.where(bits >= 0, bits + 2**31, (~bits) & 0xFFFFFFFF)
        idx = torch.arange(n, dtype=torch.int64, device=scores.device)
        key = ordered * 2**31 + (2**31 - 1 - idx)
        top = torch.topk(key, k).indices
        out[r] = torch.sort(top).values.to(torch.int32)
    return out
