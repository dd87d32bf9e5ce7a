"""Exact row-wise top-k on packed 64-bit keys by a one-digit radix select (no ``torch.topk``).

Same input and output contract as :func:`._select.topk_from_keys`: keys ``[rows, width]`` int64
from :func:`._select.pack_key` (distinct per row, ``INT64_MIN`` for non-candidates), output the ids
of the top ``k`` keys in ascending order, ``-1`` padded. Four launches, no host synchronisation and
fixed-size buffers, so the whole select can be captured in a CUDA graph:

1. :func:`_hist_kernel` (grid ``[rows, tiles]``): per-tile histogram of the digit
   ``clamp(key >> 51, 0, 4095)`` of every real key (for the indexer's non-negative scores: the 8
   exponent bits and 4 mantissa bits of the fp32 score). The digit is monotone in the key, so each
   bin holds one contiguous key range.
2. :func:`_threshold_kernel` (grid ``[rows]``): sums the tiles, scans the bins from the top and
   finds the threshold bin ``t`` where the count reaches ``k`` and the number of keys strictly
   above it (``t = -1`` when the row has at most ``k`` real keys: all of them are selected).
3. :func:`_compact_kernel` (grid ``[rows, tiles]``): writes the id of every key above bin ``t``
   straight into the output row (atomic slot counter per row) and appends the keys of bin ``t``
   to a candidate buffer of :data:`CAND_CAP` keys.
4. :func:`_resolve_kernel` (grid ``[rows]``): takes the ``k - above`` largest candidates with one
   ``tl.sort`` when they fit; otherwise (the bin overflowed) finds the exact threshold key by a
   4-bit radix over the row's bin-``t`` keys in one program (16 passes over the row, slow but
   exact) and compacts the keys at or above it. Then one ``tl.sort`` orders the ``k`` ids.

Keys are distinct, so the top ``k`` is one exact set and every step is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Histogram bins of the first (and only global) radix digit.
BINS = 4096
#: The digit is ``clamp(key >> SHIFT, 0, BINS - 1)``.
SHIFT = 51
#: Candidates (keys in the threshold bin) resolved by one ``tl.sort``; more take the slow path.
CAND_CAP = 2048
#: Keys per loop step of the histogram and compaction programs.
CHUNK = 4096
#: At most this many programs per row for the histogram and compaction passes.
MAX_TILES = 16
#: Keys per loop step of the overflow path.
_FALLBACK_CHUNK = 1024
#: Largest ``k`` the final one-program sort of ids handles.
MAX_K = 4096


@triton.jit  # type: ignore[untyped-decorator]
def _digit(key, SH: tl.constexpr, NB: tl.constexpr):  # type: ignore[no-untyped-def]
    return tl.minimum(tl.maximum(key >> SH, 0), NB - 1).to(tl.int32)


@triton.jit  # type: ignore[untyped-decorator]
def _hist_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    keys_ptr,  # [rows, width] int64
    hist_ptr,  # [rows, tiles, NB] int32, every element written
    width,
    span,  # keys per program, a CH multiple
    tiles,
    stride_k,
    NB: tl.constexpr,  # constexpr: bins
    SH: tl.constexpr,  # constexpr: digit shift
    CH: tl.constexpr,  # constexpr: keys per loop step
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    lo = tile * span
    hi = tl.minimum(lo + span, width)
    bins = tl.arange(0, NB)
    acc = tl.zeros([NB], dtype=tl.int32)
    for start in range(lo, hi, CH):
        col = start + tl.arange(0, CH)
        key = tl.load(
            keys_ptr + row * stride_k + col, mask=col < hi, other=-9223372036854775807 - 1
        )
        valid = key != -9223372036854775807 - 1
        d = tl.where(valid, _digit(key, SH, NB), 0)
        # Invalid keys land in bin 0 and are taken back out (no reliance on a histogram mask).
        n_invalid = tl.sum((~valid).to(tl.int32))
        acc += tl.histogram(d, NB) - tl.where(bins == 0, n_invalid, 0)
    tl.store(hist_ptr + (row * tiles + tile) * NB + bins, acc)


@triton.jit  # type: ignore[untyped-decorator]
def _threshold_kernel(  # type: ignore[no-untyped-def]
    hist_ptr,  # [rows, tiles, NB] int32
    state_ptr,  # [rows, 4] int32: threshold bin, keys above it, slot counter, candidate counter
    tiles,
    k,
    NB: tl.constexpr,  # constexpr: bins
):
    row = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, NB)
    counts = tl.zeros([NB], dtype=tl.int32)
    for tile in range(tiles):
        counts += tl.load(hist_ptr + (row * tiles + tile) * NB + bins)
    total = tl.sum(counts)
    above = total - tl.cumsum(counts, 0)
    hit = (above < k) & (above + counts >= k)
    t = tl.max(tl.where(hit, bins, -1))
    t = tl.where(total <= k, -1, t)
    above_t = tl.sum(tl.where(bins > t, counts, 0))
    tl.store(state_ptr + row * 4, t)
    tl.store(state_ptr + row * 4 + 1, above_t)
    tl.store(state_ptr + row * 4 + 2, 0)
    tl.store(state_ptr + row * 4 + 3, 0)


@triton.jit  # type: ignore[untyped-decorator]
def _compact_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    keys_ptr,  # [rows, width] int64
    state_ptr,  # [rows, 4] int32
    out_ptr,  # [rows, >= k] int32: ids above the threshold bin, unordered
    cand_ptr,  # [rows, CAP] int64: keys of the threshold bin (first CAP of them)
    width,
    span,
    stride_k,
    stride_o,
    NB: tl.constexpr,  # constexpr: bins
    SH: tl.constexpr,  # constexpr: digit shift
    CH: tl.constexpr,  # constexpr: keys per loop step
    CAP: tl.constexpr,  # constexpr: candidate buffer keys per row
):
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, width)
    t = tl.load(state_ptr + row * 4)
    for start in range(lo, hi, CH):
        col = start + tl.arange(0, CH)
        key = tl.load(
            keys_ptr + row * stride_k + col, mask=col < hi, other=-9223372036854775807 - 1
        )
        valid = key != -9223372036854775807 - 1
        d = tl.where(valid, _digit(key, SH, NB), -2)
        up = (d > t).to(tl.int32)
        n_up = tl.sum(up)
        if n_up > 0:
            base = tl.atomic_add(state_ptr + row * 4 + 2, n_up)
            pos = base + tl.cumsum(up, 0) - 1
            tl.store(out_ptr + row * stride_o + pos, col.to(tl.int32), mask=up > 0)
        eq = (d == t).to(tl.int32)
        n_eq = tl.sum(eq)
        if n_eq > 0:
            base = tl.atomic_add(state_ptr + row * 4 + 3, n_eq)
            pos = base + tl.cumsum(eq, 0) - 1
            tl.store(cand_ptr + row * CAP + pos, key, mask=(eq > 0) & (pos < CAP))


@triton.jit  # type: ignore[untyped-decorator]
def _resolve_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    keys_ptr,  # [rows, width] int64 (read only on the overflow path)
    state_ptr,  # [rows, 4] int32
    cand_ptr,  # [rows, CAP] int64
    out_ptr,  # [rows, K] int32
    width,
    stride_k,
    stride_o,
    K: tl.constexpr,  # constexpr: ids per row
    K_PAD: tl.constexpr,  # constexpr: K rounded up to a power of two
    NB: tl.constexpr,  # constexpr: bins
    SH: tl.constexpr,  # constexpr: digit shift
    CAP: tl.constexpr,  # constexpr: candidate buffer keys per row
    FCH: tl.constexpr,  # constexpr: keys per loop step of the overflow path
):
    key_none = -9223372036854775807 - 1
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(state_ptr + row * 4)
    above = tl.load(state_ptr + row * 4 + 1)
    cnt = tl.load(state_ptr + row * 4 + 3)
    need = tl.where(t < 0, 0, K - above)
    if need > 0:
        if cnt <= CAP:
            c = tl.arange(0, CAP)
            ck = tl.load(cand_ptr + row * CAP + c, mask=c < cnt, other=key_none)
            s = tl.sort(ck, descending=True)
            ids = (4294967295 - (s & 4294967295)).to(tl.int32)
            tl.store(out_ptr + row * stride_o + above + c, ids, mask=c < need)
        else:
            # Exact threshold key among the bin-t keys: 4-bit radix on the sign-flipped key.
            b16 = tl.arange(0, 16)
            prefix = row * 0
            rem = need
            for r in tl.static_range(16):
                sh = 60 - 4 * r
                cnt16 = tl.zeros([16], dtype=tl.int32)
                for start in range(0, width, FCH):
                    col = start + tl.arange(0, FCH)
                    key = tl.load(keys_ptr + row * stride_k + col, mask=col < width, other=key_none)
                    match = (key != key_none) & (_digit(key, SH, NB) == t)
                    u = key ^ key_none
                    if r > 0:
                        match = match & ((u >> (sh + 4)) == (prefix >> (sh + 4)))
                    dig = ((u >> sh) & 15).to(tl.int32)
                    hit16 = (dig[:, None] == b16[None, :]) & match[:, None]
                    cnt16 += tl.sum(hit16.to(tl.int32), 0)
                above16 = tl.sum(cnt16) - tl.cumsum(cnt16, 0)
                pick = (above16 < rem) & (above16 + cnt16 >= rem)
                dsel = tl.max(tl.where(pick, b16, -1))
                rem -= tl.sum(tl.where(b16 > dsel, cnt16, 0))
                prefix = prefix | (dsel.to(tl.int64) << sh)
            threshold = prefix ^ key_none
            off = above
            for start in range(0, width, FCH):
                col = start + tl.arange(0, FCH)
                key = tl.load(keys_ptr + row * stride_k + col, mask=col < width, other=key_none)
                take = (key != key_none) & (_digit(key, SH, NB) == t) & (key >= threshold)
                take_i = take.to(tl.int32)
                pos = off + tl.cumsum(take_i, 0) - 1
                tl.store(out_ptr + row * stride_o + pos, col.to(tl.int32), mask=take)
                off += tl.sum(take_i)
    tl.debug_barrier()
    n_sel = tl.where(t < 0, above, K)
    i = tl.arange(0, K_PAD)
    ids = tl.load(out_ptr + row * stride_o + i, mask=i < n_sel, other=2147483647)
    ids = tl.sort(ids)
    tl.store(out_ptr + row * stride_o + i, tl.where(ids == 2147483647, -1, ids), mask=i < K)


def tiles_for(width: int) -> tuple[int, int]:
    """Programs per row and keys per program for rows of ``width`` keys."""
    tiles = max(1, min(MAX_TILES, triton.cdiv(width, CHUNK)))
    span = triton.cdiv(triton.cdiv(width, tiles), CHUNK) * CHUNK
    return triton.cdiv(width, span), span


def radix_stage_hist(keys: torch.Tensor) -> torch.Tensor:
    """Stage 1: ``[rows, tiles, BINS]`` int32 per-tile digit histograms of ``keys``."""
    rows, width = keys.shape
    tiles, span = tiles_for(width)
    hist = torch.empty((rows, tiles, BINS), dtype=torch.int32, device=keys.device)
    _hist_kernel[(rows, tiles)](
        keys, hist, width, span, tiles, keys.stride(0), NB=BINS, SH=SHIFT, CH=CHUNK, num_warps=8
    )
    return hist


def radix_stage_threshold(hist: torch.Tensor, k: int) -> torch.Tensor:
    """Stage 2: ``[rows, 4]`` int32 state (threshold bin, keys above it, two zeroed counters)."""
    rows, tiles, _ = hist.shape
    state = torch.empty((rows, 4), dtype=torch.int32, device=hist.device)
    _threshold_kernel[(rows,)](hist, state, tiles, k, NB=BINS, num_warps=8)
    return state


def radix_stage_compact(keys: torch.Tensor, state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Stage 3: ids above the threshold bin into ``out``; returns the candidate buffer."""
    rows, width = keys.shape
    tiles, span = tiles_for(width)
    cand = torch.empty((rows, CAND_CAP), dtype=torch.int64, device=keys.device)
    _compact_kernel[(rows, tiles)](
        keys,
        state,
        out,
        cand,
        width,
        span,
        keys.stride(0),
        out.stride(0),
        NB=BINS,
        SH=SHIFT,
        CH=CHUNK,
        CAP=CAND_CAP,
        num_warps=8,
    )
    return cand


def radix_stage_resolve(
    keys: torch.Tensor, state: torch.Tensor, cand: torch.Tensor, k: int, out: torch.Tensor
) -> None:
    """Stage 4: resolve the threshold bin and sort each row's ``k`` ids ascending into ``out``."""
    rows, width = keys.shape
    _resolve_kernel[(rows,)](
        keys,
        state,
        cand,
        out,
        width,
        keys.stride(0),
        out.stride(0),
        K=k,
        K_PAD=triton.next_power_of_2(k),
        NB=BINS,
        SH=SHIFT,
        CAP=CAND_CAP,
        FCH=_FALLBACK_CHUNK,
        num_warps=8,
    )


def radix_topk_from_keys(keys: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Contract of :func:`._select.topk_from_keys` for ``1 <= k <= MAX_K``, by radix select.

    Args:
        keys: ``[rows, width]`` int64 packed keys (:func:`._select.pack_key`), unit last stride.
        k: ids per row, ``1 <= k <= MAX_K``.
        out: ``[rows, k]`` int32, unit last stride; ids ascending, ``-1`` after the real ones.
    """
    rows, width = keys.shape
    if rows == 0:
        return
    if width == 0:
        out.fill_(-1)
        return
    hist = radix_stage_hist(keys)
    state = radix_stage_threshold(hist, k)
    cand = radix_stage_compact(keys, state, out)
    radix_stage_resolve(keys, state, cand, k, out)
