"""Exact row-wise top-k on packed 64-bit keys by a one-digit radix select (no ``torch.topk``).

Same contract as :func:`._select.topk_from_keys`: keys ``[rows, width]`` int64 from
:func:`._select.pack_key` whose index field is the key's column (distinct per row, ``INT64_MIN``
for non-candidates); output the columns of the top ``k`` keys in ascending order, ``-1`` padded.
Nothing is sorted: each output slice is written in column order at an offset known in advance.
Three launches after one zeroed workspace, no host synchronisation and fixed-size buffers, so the
select can be captured in a CUDA graph. Passes 1 and 2 end with a per-row epilogue in the row's
last program to finish, so no extra launch waits on it. That program is found by a ticket counter:
every program writes its results, passes a CTA barrier (so every warp's writes precede the
release), takes an ``acq_rel`` ticket, and the last one reads the others' results with ``.cg``
loads (from L2, past any stale L1 line):

1. Histogram (:func:`hist_add` + :func:`hist_done`, fused into the indexer's scoring kernel, or
   :func:`_hist_kernel`): per row, the count of real keys per digit ``clamp(key >> 51, 0, 4095)``.
   For the indexer's non-negative scores the digit is the fp32 score's 8 exponent bits and top 4
   mantissa bits; it is monotone in the key, so a bin is one contiguous key range. A key outside
   bin 0 is one relaxed global atomic into one of :data:`COPIES` copies of the row's histogram
   (chosen by program, to spread contention on popular bins); bin 0 (zeros, negatives) takes one
   atomic per :func:`hist_add` call. Epilogue: the threshold bin ``t`` (where the count from the
   top reaches ``k``; ``-1`` when the row has at most ``k`` keys) and the count of keys above it.
2. :func:`_flag_kernel` (grid ``[rows, tiles]``): one int8 flag per column (2: above ``t``, 1: in
   ``t``, 0: below or not a key), the tile's count of 2s, and the keys of bin ``t`` appended to a
   candidate buffer of :data:`CAND_CAP` keys per row. Epilogue: the exact threshold key, i.e. the
   ``(k - above)``-th largest key of bin ``t``, by ranking the candidates against each other;
   when the bin holds more than :data:`CAND_CAP` keys (ties, all-equal scores, or signed scores
   whose threshold falls among the negatives, which all share bin 0), by a 4-bit radix over the
   row's bin-``t`` keys instead (16 passes over the row by one program: exact, but about 1.3 ms
   for a 256K-column row on an H200). Then each tile's output offset: the exclusive prefix sum
   of its selected keys.
3. :func:`_write_kernel` (grid ``[rows, tiles]``): each tile writes its selected ids in column
   order at its offset; the last tile pads the row with ``-1``.

Keys are distinct, so the top ``k`` is one exact set and every step is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._topk_keys import KEY_NONE_JIT

#: Histogram bins of the radix digit.
BINS = 4096
#: The digit is ``clamp(key >> SHIFT, 0, BINS - 1)``.
SHIFT = 51
#: Copies of each row's histogram; program ``i`` counts into copy ``i % COPIES``.
COPIES = 4
#: Candidates (keys in the threshold bin) resolved by ranking; more take the slow exact path.
#: Ranking costs grow with the count actually found, not with the cap: random bf16 indexer rows
#: of 64K blocks put about 250 keys in the bin for k = 512 and about 900 for k = 2048.
CAND_CAP = 4096
#: Keys per loop step of the histogram, flag and write passes.
CHUNK = 4096
#: At most this many flag and write programs per row (a power of two).
MAX_TILES = 32
#: Keys per loop step of the overflow path.
_FALLBACK_CHUNK = 1024
#: Candidate ranking tile: ``_RANK_I`` candidates against ``_RANK_J`` at a time.
_RANK_I = 64
_RANK_J = 256

# Workspace row layout (int32, zeroed): the histogram copies, then these fields.
_TICKET_HIST = tl.constexpr(0)  # programs of pass 1 done
_TICKET_FLAGS = tl.constexpr(1)  # programs of pass 2 done
_CAND_COUNT = tl.constexpr(2)  # keys of the threshold bin seen (the first CAND_CAP are kept)
_BIN = tl.constexpr(3)  # threshold bin, -1: every key is taken
_ABOVE = tl.constexpr(4)  # keys above the threshold bin
_TILE_SEL = tl.constexpr(5)  # MAX_TILES per-tile counts, then MAX_TILES per-tile output offsets

_KEY_MAX = tl.constexpr(2**63 - 1)


@triton.jit  # type: ignore[untyped-decorator]
def _digit(key, SH: tl.constexpr, NB: tl.constexpr):  # type: ignore[no-untyped-def]
    return tl.minimum(tl.maximum(key >> SH, 0), NB - 1).to(tl.int32)


@triton.jit  # type: ignore[untyped-decorator]
def hist_add(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    ws_row_ptr, program, key, valid, SH: tl.constexpr, NB: tl.constexpr, COPIES: tl.constexpr
):
    """Count the ``valid`` keys of a 1-D tile into one row's histogram (relaxed atomics)."""
    hist = ws_row_ptr + (program % COPIES) * NB
    d = _digit(key, SH, NB)
    tl.atomic_add(hist + d, 1, mask=valid & (d > 0), sem="relaxed")
    zeros = tl.sum((valid & (d == 0)).to(tl.int32))
    if zeros > 0:
        tl.atomic_add(hist, zeros, sem="relaxed")


@triton.jit  # type: ignore[untyped-decorator]
def hist_done(ws_row_ptr, programs, k, NB: tl.constexpr, COPIES: tl.constexpr):  # type: ignore[no-untyped-def]
    """Call once per program after its :func:`hist_add`; the row's last one finds the threshold."""
    fields = ws_row_ptr + COPIES * NB
    tl.debug_barrier()  # every warp's histogram atomics precede the ticket's release
    if tl.atomic_add(fields + _TICKET_HIST, 1, sem="acq_rel") == programs - 1:
        bins = tl.arange(0, NB)
        counts = tl.zeros([NB], dtype=tl.int32)
        for c in tl.static_range(COPIES):
            counts += tl.load(ws_row_ptr + c * NB + bins, cache_modifier=".cg")
        total = tl.sum(counts)
        above = total - tl.cumsum(counts, 0)
        hit = (above < k) & (above + counts >= k)
        t = tl.where(total <= k, -1, tl.max(tl.where(hit, bins, -1)))
        tl.store(fields + _BIN, t)
        tl.store(fields + _ABOVE, tl.sum(tl.where(bins > t, counts, 0)))


@triton.jit  # type: ignore[untyped-decorator]
def _hist_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    keys_ptr,  # [rows, width] int64
    ws_ptr,  # [rows, new_workspace columns] int32, zeroed
    width,
    span,  # keys per program, a CH multiple
    k,
    stride_k,
    stride_w,
    NB: tl.constexpr,  # constexpr: bins
    SH: tl.constexpr,  # constexpr: digit shift
    COPIES: tl.constexpr,  # constexpr: histogram copies per row
    CH: tl.constexpr,  # constexpr: keys per loop step
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    lo = tile * span
    hi = tl.minimum(lo + span, width)
    for start in range(lo, hi, CH):
        col = start + tl.arange(0, CH)
        key = tl.load(keys_ptr + row * stride_k + col, mask=col < hi, other=KEY_NONE_JIT)
        hist_add(ws_ptr + row * stride_w, tile, key, key != KEY_NONE_JIT, SH, NB, COPIES)
    hist_done(ws_ptr + row * stride_w, tl.num_programs(1), k, NB, COPIES)


@triton.jit  # type: ignore[untyped-decorator]
def _rank_threshold(cand_row_ptr, cnt, need, RI: tl.constexpr, RJ: tl.constexpr):  # type: ignore[no-untyped-def]
    """The ``need``-th largest of ``cnt`` distinct candidate keys, by pairwise ranking."""
    thr = tl.full((), KEY_NONE_JIT, tl.int64)
    for i0 in range(0, cnt, RI):
        ci = i0 + tl.arange(0, RI)
        ki = tl.load(cand_row_ptr + ci, mask=ci < cnt, other=KEY_NONE_JIT, cache_modifier=".cg")
        rank = tl.zeros([RI], dtype=tl.int32)
        for j0 in range(0, cnt, RJ):
            cj = j0 + tl.arange(0, RJ)
            kj = tl.load(cand_row_ptr + cj, mask=cj < cnt, other=KEY_NONE_JIT, cache_modifier=".cg")
            rank += tl.sum((kj[None, :] > ki[:, None]).to(tl.int32), 1)
        hit = (rank == need - 1) & (ci < cnt)
        thr = tl.maximum(thr, tl.max(tl.where(hit, ki, KEY_NONE_JIT)))
    return thr


@triton.jit  # type: ignore[untyped-decorator]
def _tile_counts(col, sel, span, MT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``[MT]`` int32: how many of the ``sel`` columns fall in each tile ``col // span``."""
    owner = (col // span)[:, None] == tl.arange(0, MT)[None, :]
    return tl.sum((owner & sel[:, None]).to(tl.int32), 0)


@triton.jit  # type: ignore[untyped-decorator]
def _radix_threshold(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    row_keys_ptr, width, t, need, SH: tl.constexpr, NB: tl.constexpr, FCH: tl.constexpr
):
    """The ``need``-th largest key of digit ``t`` in the row, by a 4-bit radix (16 passes)."""
    b16 = tl.arange(0, 16)
    prefix = tl.full((), 0, tl.int64)
    rem = need
    for r in tl.static_range(16):
        sh = 60 - 4 * r
        cnt16 = tl.zeros([16], dtype=tl.int32)
        for start in range(0, width, FCH):
            col = start + tl.arange(0, FCH)
            key = tl.load(row_keys_ptr + col, mask=col < width, other=KEY_NONE_JIT)
            match = (key != KEY_NONE_JIT) & (_digit(key, SH, NB) == t)
            # Unsigned order of the key: flip the sign bit.
            u = key ^ KEY_NONE_JIT
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
    return prefix ^ KEY_NONE_JIT


@triton.jit  # type: ignore[untyped-decorator]
def _flag_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    keys_ptr,  # [rows, width] int64
    ws_ptr,  # [rows, new_workspace columns] int32 after pass 1
    flags_ptr,  # [rows, width] int8, every element written
    cand_ptr,  # [rows, CAP + 1] int64: keys of the threshold bin, then (slot CAP) the threshold key
    width,
    span,
    k,
    stride_k,
    stride_w,
    stride_f,
    NB: tl.constexpr,  # constexpr: bins
    SH: tl.constexpr,  # constexpr: digit shift
    COPIES: tl.constexpr,  # constexpr: histogram copies per row
    CH: tl.constexpr,  # constexpr: keys per loop step
    CAP: tl.constexpr,  # constexpr: candidate buffer keys per row
    MT: tl.constexpr,  # constexpr: MAX_TILES
    RI: tl.constexpr,  # constexpr: ranking tile rows
    RJ: tl.constexpr,  # constexpr: ranking tile columns
    FCH: tl.constexpr,  # constexpr: keys per loop step of the overflow path
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    tiles = tl.num_programs(1)
    lo = tile * span
    hi = tl.minimum(lo + span, width)
    fields = ws_ptr + row * stride_w + COPIES * NB
    cand_row = cand_ptr + row * (CAP + 1)
    t = tl.load(fields + _BIN)
    n_up = 0
    for start in range(lo, hi, CH):
        col = start + tl.arange(0, CH)
        key = tl.load(keys_ptr + row * stride_k + col, mask=col < hi, other=KEY_NONE_JIT)
        d = tl.where(key != KEY_NONE_JIT, _digit(key, SH, NB), -2)
        flag = tl.where(d > t, 2, tl.where(d == t, 1, 0)).to(tl.int8)
        tl.store(flags_ptr + row * stride_f + col, flag, mask=col < hi)
        n_up += tl.sum((d > t).to(tl.int32))
        eq = (d == t).to(tl.int32)
        n_eq = tl.sum(eq)
        if n_eq > 0:
            base = tl.atomic_add(fields + _CAND_COUNT, n_eq, sem="relaxed")
            pos = base + tl.cumsum(eq, 0) - 1
            tl.store(cand_row + pos, key, mask=(eq > 0) & (pos < CAP))
    tl.store(fields + _TILE_SEL + tile, n_up)
    tl.debug_barrier()  # every warp's candidate stores precede the ticket's release
    if tl.atomic_add(fields + _TICKET_FLAGS, 1, sem="acq_rel") == tiles - 1:
        # Epilogue, in the row's last program: the threshold key and every tile's offset.
        cnt = tl.load(fields + _CAND_COUNT, cache_modifier=".cg")
        above = tl.load(fields + _ABOVE)
        need = tl.where(t < 0, 0, k - above)
        tid = tl.arange(0, MT)
        from_bin = tl.zeros([MT], dtype=tl.int32)  # per tile, selected keys of bin t
        thr = tl.full((), _KEY_MAX, tl.int64)
        if need > 0:
            if cnt <= CAP:
                thr = _rank_threshold(cand_row, cnt, need, RI, RJ)
                for c0 in range(0, cnt, RJ):
                    c = c0 + tl.arange(0, RJ)
                    ck = tl.load(
                        cand_row + c, mask=c < cnt, other=KEY_NONE_JIT, cache_modifier=".cg"
                    )
                    ccol = (4294967295 - (ck & 4294967295)).to(tl.int32)
                    from_bin += _tile_counts(ccol, (ck >= thr) & (c < cnt), span, MT)
            else:
                thr = _radix_threshold(keys_ptr + row * stride_k, width, t, need, SH, NB, FCH)
                for start in range(0, width, FCH):
                    col = start + tl.arange(0, FCH)
                    key = tl.load(
                        keys_ptr + row * stride_k + col, mask=col < width, other=KEY_NONE_JIT
                    )
                    hit = (key != KEY_NONE_JIT) & (_digit(key, SH, NB) == t) & (key >= thr)
                    from_bin += _tile_counts(col, hit, span, MT)
        per_tile = tl.load(
            fields + _TILE_SEL + tid, mask=tid < tiles, other=0, cache_modifier=".cg"
        )
        per_tile += from_bin
        tl.store(fields + _TILE_SEL + MT + tid, tl.cumsum(per_tile, 0) - per_tile, mask=tid < tiles)
        tl.store(cand_row + CAP, thr)  # the threshold-key slot, after the CAP candidates


@triton.jit  # type: ignore[untyped-decorator]
def _write_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    keys_ptr,  # [rows, width] int64
    ws_ptr,  # [rows, new_workspace columns] int32 after pass 2
    flags_ptr,  # [rows, width] int8
    cand_ptr,  # [rows, CAP + 1] int64: the threshold key in slot CAP
    out_ptr,  # [rows, >= k] int32
    width,
    span,
    k,
    stride_k,
    stride_w,
    stride_f,
    stride_o,
    NB: tl.constexpr,  # constexpr: bins
    COPIES: tl.constexpr,  # constexpr: histogram copies per row
    CH: tl.constexpr,  # constexpr: columns per loop step
    CAP: tl.constexpr,  # constexpr: candidate buffer keys per row
    MT: tl.constexpr,  # constexpr: MAX_TILES
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    lo = tile * span
    hi = tl.minimum(lo + span, width)
    fields = ws_ptr + row * stride_w + COPIES * NB
    thr = tl.load(cand_ptr + row * (CAP + 1) + CAP)
    off = tl.load(fields + _TILE_SEL + MT + tile)
    for start in range(lo, hi, CH):
        col = start + tl.arange(0, CH)
        f = tl.load(flags_ptr + row * stride_f + col, mask=col < hi, other=0)
        in_bin = f == 1
        key = tl.load(keys_ptr + row * stride_k + col, mask=in_bin, other=0)
        sel = (f == 2) | (in_bin & (key >= thr))
        s = sel.to(tl.int32)
        pos = off + tl.cumsum(s, 0) - 1
        # pos < k always holds for exact inputs; the guard keeps any slip inside the row.
        tl.store(out_ptr + row * stride_o + pos, col.to(tl.int32), mask=sel & (pos < k))
        off += tl.sum(s)
    if tile == tl.num_programs(1) - 1:
        for p0 in range(0, k, CH):
            p = p0 + tl.arange(0, CH)
            tl.store(out_ptr + row * stride_o + p, -1, mask=(p >= off) & (p < k))


def tiles_for(width: int) -> tuple[int, int]:
    """Programs per row and keys per program of :func:`_hist_kernel` and the flag and write passes.

    (The histogram fused into indexer scoring runs on the scoring kernel's grid instead.)
    """
    tiles = max(1, min(MAX_TILES, triton.cdiv(width, CHUNK)))
    span = triton.cdiv(triton.cdiv(width, tiles), CHUNK) * CHUNK
    return triton.cdiv(width, span), span


def new_workspace(rows: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 workspace for one select of ``rows`` rows, never reused.

    Each row holds the :data:`COPIES` histograms, then the ticket, counter and threshold fields,
    then two :data:`MAX_TILES` arrays (per-tile counts and output offsets).
    """
    cols = COPIES * BINS + _TILE_SEL.value + 2 * MAX_TILES
    return torch.zeros((rows, cols), dtype=torch.int32, device=device)


def stage_hist(keys: torch.Tensor, ws: torch.Tensor, k: int) -> None:
    """Pass 1 for keys made elsewhere: count every real key of ``keys`` into ``ws``."""
    rows, width = keys.shape
    tiles, span = tiles_for(width)
    _hist_kernel[(rows, tiles)](
        keys, ws, width, span, k, keys.stride(0), ws.stride(0),
        NB=BINS, SH=SHIFT, COPIES=COPIES, CH=CHUNK, num_warps=8,
    )  # fmt: skip


def stage_flags(keys: torch.Tensor, ws: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2: ``[rows, width]`` int8 flags and the ``[rows, CAND_CAP + 1]`` candidate buffer."""
    rows, width = keys.shape
    tiles, span = tiles_for(width)
    flags = torch.empty((rows, width), dtype=torch.int8, device=keys.device)
    # CAND_CAP keys of the threshold bin, then the threshold-key slot.
    cand = torch.empty((rows, CAND_CAP + 1), dtype=torch.int64, device=keys.device)
    _flag_kernel[(rows, tiles)](
        keys, ws, flags, cand, width, span, k, keys.stride(0), ws.stride(0), flags.stride(0),
        NB=BINS, SH=SHIFT, COPIES=COPIES, CH=CHUNK, CAP=CAND_CAP, MT=MAX_TILES, RI=_RANK_I,
        RJ=_RANK_J, FCH=_FALLBACK_CHUNK, num_warps=8,
    )  # fmt: skip
    return flags, cand


def stage_write(  # noqa: PLR0917
    keys: torch.Tensor,
    ws: torch.Tensor,
    flags: torch.Tensor,
    cand: torch.Tensor,
    k: int,
    out: torch.Tensor,
) -> None:
    """Pass 3: every tile writes its selected ids, ascending, at its offset into ``out``."""
    rows, width = keys.shape
    tiles, span = tiles_for(width)
    _write_kernel[(rows, tiles)](
        keys, ws, flags, cand, out, width, span, k,
        keys.stride(0), ws.stride(0), flags.stride(0), out.stride(0),
        NB=BINS, COPIES=COPIES, CH=CHUNK, CAP=CAND_CAP, MT=MAX_TILES, num_warps=4,
    )  # fmt: skip


def select(keys: torch.Tensor, ws: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Passes 2 and 3, for keys whose pass 1 has filled ``ws``."""
    flags, cand = stage_flags(keys, ws, k)
    stage_write(keys, ws, flags, cand, k, out)


def radix_topk_from_keys(keys: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Contract of :func:`._select.topk_from_keys`, by radix select (that function dispatches here).

    Args:
        keys: ``[rows, width]`` int64 packed keys (:func:`._select.pack_key`) whose index field is
            the key's column, unit last stride; ``rows >= 1`` and ``width >= 1``.
        k: ids per row, ``>= 1``.
        out: ``[rows, k]`` int32, unit last stride; ids ascending, ``-1`` after the real ones.
    """
    ws = new_workspace(keys.shape[0], keys.device)
    stage_hist(keys, ws, k)
    select(keys, ws, k, out)
