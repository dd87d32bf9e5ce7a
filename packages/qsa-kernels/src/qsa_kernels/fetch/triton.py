"""Triton selected-block fetch: a plan kernel (hits, LRU victims) and a zero-copy miss copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._checks import next_pow2
from qsa_kernels._errors import KernelInputError
from qsa_kernels._uva import device_view
from qsa_kernels.fetch._tables import HotCacheTables
from qsa_kernels.fetch._validate import check_fetch_args

__all__ = ("fetch_selected_blocks",)

_MAX_SLOTS = 1 << 16  # the victim sort key keeps the slot in 16 bits beside a 46-bit stamp


@triton.jit  # type: ignore[untyped-decorator]
def _plan_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    sel_ptr,  # [B, NL, K] int32 selected block ids, -1 padding
    rows_ptr,  # [B] int32 request row of each batch entry
    layers_ptr,  # [NL] int32 layer of each selection column
    slot_block_ptr,  # [L, R, S] int32 resident block per slot, -1 empty
    slot_stamp_ptr,  # [L, R, S] int64 last-use step per slot, -1 never
    block_slot_ptr,  # [L, R, NB] int32 local slot per resident block, -1 absent
    out_ptr,  # [B, NL, K] int32 global slot (row * S + s) per entry, -1 padding
    miss_block_ptr,  # [B * NL, K] int32 missed block id by miss rank
    miss_slot_ptr,  # [B * NL, K] int32 victim local slot by miss rank
    miss_count_ptr,  # [B * NL] int32 number of misses
    step,
    NL,
    R,
    S,
    NB,
    K,
    BLOCK_K: tl.constexpr,  # next_pow2(K): one register tile holds the whole selection
    BLOCK_S: tl.constexpr,  # next_pow2(S): one tile holds every slot, sorted in registers
    SLOT_BITS: tl.constexpr,  # log2(BLOCK_S): width of the slot field in the sort key
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    g = b * NL + j
    row = tl.load(rows_ptr + b).to(tl.int64)
    layer = tl.load(layers_ptr + j).to(tl.int64)
    tab = layer * R + row
    slot_base = tab * S
    map_base = tab * NB

    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    sel = tl.load(sel_ptr + g.to(tl.int64) * K + offs_k, mask=kmask, other=-1)
    valid = sel >= 0
    sel64 = tl.where(valid, sel, 0).to(tl.int64)
    held = tl.load(block_slot_ptr + map_base + sel64, mask=valid, other=-1)
    hit = valid & (held >= 0)
    miss = valid & (held < 0)

    # (5, hits) Stamp hit slots first: afterwards a slot is a victim candidate iff its stamp is
    # older than this step, since a resident selected block is always a hit.
    step64 = tl.full((BLOCK_K,), step, tl.int64)
    tl.store(slot_stamp_ptr + slot_base + held.to(tl.int64), step64, mask=hit)
    tl.debug_barrier()

    # (3) Victim candidates ordered by (occupied, stamp, slot) through one packed int64 sort key.
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < S
    stamp = tl.load(slot_stamp_ptr + slot_base + offs_s, mask=smask, other=step)
    blk = tl.load(slot_block_ptr + slot_base + offs_s, mask=smask, other=-1)
    cand = smask & (stamp < step)
    occupied = (blk >= 0).to(tl.int64)
    key = (occupied << 62) | ((stamp + 1) << SLOT_BITS) | offs_s.to(tl.int64)
    key = tl.where(cand, key, 0x7FFFFFFFFFFFFFFF)
    ordered = tl.sort(key)
    victim = (ordered & (BLOCK_S - 1)).to(tl.int32)
    scratch = g.to(tl.int64) * K
    tl.store(miss_slot_ptr + scratch + offs_s, victim, mask=offs_s < K)

    # (2, 4) The j-th miss in entry order takes the j-th victim.
    rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    tl.store(miss_block_ptr + scratch + rank, sel, mask=miss)
    tl.store(miss_count_ptr + g, n_miss)
    tl.debug_barrier()
    vslot = tl.load(miss_slot_ptr + scratch + rank, mask=miss, other=0)
    vslot64 = vslot.to(tl.int64)

    # (5, misses) Evict the victims' old blocks from the map, install the missed ids.
    old = tl.load(slot_block_ptr + slot_base + vslot64, mask=miss, other=-1)
    minus1 = tl.full((BLOCK_K,), -1, tl.int32)
    tl.store(block_slot_ptr + map_base + old.to(tl.int64), minus1, mask=miss & (old >= 0))
    tl.store(block_slot_ptr + map_base + sel64, vslot, mask=miss)
    tl.store(slot_block_ptr + slot_base + vslot64, sel, mask=miss)
    tl.store(slot_stamp_ptr + slot_base + vslot64, step64, mask=miss)

    # (6) Selected slots, as global slots of the layer's hot cache.
    local = tl.where(hit, held, vslot).to(tl.int64)
    out = tl.where(valid, row * S + local, -1).to(tl.int32)
    tl.store(out_ptr + g.to(tl.int64) * K + offs_k, out, mask=kmask)


@triton.jit  # type: ignore[untyped-decorator]
def _copy_misses_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    host_ptr,  # [R, L, NB, W] int32 words of the host arena (pinned, device-mapped)
    hot_ptr,  # [L, R, S, W] int32 words of the hot cache
    rows_ptr,  # [B] int32
    layers_ptr,  # [NL] int32
    miss_block_ptr,  # [B * NL, K] int32
    miss_slot_ptr,  # [B * NL, K] int32
    miss_count_ptr,  # [B * NL] int32
    NL,
    L,
    R,
    S,
    NB,
    K,
    W: tl.constexpr,  # 32-bit words per record; constexpr so the copy unrolls into 16-byte moves
    BLOCK_W: tl.constexpr,  # next_pow2(W)
    PER_PROGRAM: tl.constexpr,  # misses copied by one program; constexpr so the loop unrolls
):
    g = tl.program_id(0)
    chunk = tl.program_id(1)
    n = tl.load(miss_count_ptr + g)
    first = chunk * PER_PROGRAM
    if first < n:
        b = g // NL
        j = g % NL
        row = tl.load(rows_ptr + b).to(tl.int64)
        layer = tl.load(layers_ptr + j).to(tl.int64)
        src_base = (row * L + layer) * NB
        dst_base = (layer * R + row) * S
        offs = tl.arange(0, BLOCK_W)
        wmask = offs < W
        for i in tl.static_range(PER_PROGRAM):
            r = first + i
            if r < n:
                blk = tl.load(miss_block_ptr + g.to(tl.int64) * K + r).to(tl.int64)
                slot = tl.load(miss_slot_ptr + g.to(tl.int64) * K + r).to(tl.int64)
                words = tl.load(host_ptr + (src_base + blk) * W + offs, mask=wmask)
                tl.store(hot_ptr + (dst_base + slot) * W + offs, words, mask=wmask)


def fetch_selected_blocks(
    selected: torch.Tensor,
    rows: torch.Tensor,
    layers: torch.Tensor,
    *,
    step: int,
    tables: HotCacheTables,
    hot: torch.Tensor,
    host_arena: torch.Tensor,
    misses_per_program: int = 1,
) -> torch.Tensor:
    """Make every selected block resident in its hot cache and return its slot (two launches).

    For each batch entry ``b`` (request row ``rows[b]``) and layer column ``j`` (layer
    ``layers[j]``), applies one step of the residency contract of ``qsa_core`` to the hot cache of
    ``(layers[j], rows[b])``: (1) an entry is a hit if a slot holds its block; (2) misses are the
    valid non-hit entries in increasing index; (3) victim candidates are the slots whose block is
    not selected (empty slots included), ordered ascending by ``(occupied, stamp, slot)``; (4) the
    n-th miss takes the n-th victim; (5) victims receive the missed ids and every slot holding a
    selected block gets ``stamp = step``; nothing else changes; (6) the slot of each entry is
    returned. Missed records are read straight from pinned host memory by the GPU (zero-copy), so
    no staging buffer and no per-block ``cudaMemcpy`` is involved. Hot-cache slots that receive no
    miss are never written.

    Args:
        selected: ``[B, NL, K]`` int32 block ids; ``-1`` is padding, anywhere. Valid ids of one
            row must be distinct and lie in ``[0, NB)`` (not checked on device).
        rows: ``[B]`` int32 request row of each batch entry (distinct).
        layers: ``[NL]`` int32 layer of each selection column (distinct); all layers of a step may
            be fetched in one call.
        step: Stamp of this step; must exceed every stamp in the touched hot caches.
        tables: Residency state, updated in place.
        hot: ``[L, R, S, 2, 4, Hkv, D]`` hot cache (FP8 E4M3 or bf16), updated in place.
        host_arena: ``[R, L, NB, 2, 4, Hkv, D]`` pinned host arena, same dtype (read only).
        misses_per_program: Records copied per copy program (tuning; 1 is a good default).

    Returns:
        ``[B, NL, K]`` int32 global slots ``rows[b] * S + slot`` of every entry, ``-1`` where
        ``selected`` is ``-1``; ``hot[layers[j]].view(R * S, 2, 4, Hkv, D)`` indexed by it gives the
        selected records.

    Raises:
        KernelInputError: On a bad shape, dtype, device or layout, or ``K > S``.
    """
    check_fetch_args(
        selected, rows, layers, step=step, tables=tables, hot=hot, host_arena=host_arena
    )
    if tables.slots > _MAX_SLOTS:
        msg = f"S={tables.slots!r} slots per hot cache; at most {_MAX_SLOTS!r} supported"
        raise KernelInputError(msg)
    if misses_per_program < 1:
        msg = f"misses_per_program must be >= 1; got {misses_per_program!r}"
        raise KernelInputError(msg)
    device = tables.device
    B, NL, K = selected.shape
    L, R, S, NB = tables.layers, tables.rows, tables.slots, tables.blocks
    out = torch.empty_like(selected)
    G = B * NL
    if G == 0 or K == 0:
        return out.fill_(-1)
    miss_block = torch.empty((G, K), dtype=torch.int32, device=device)
    miss_slot = torch.empty((G, K), dtype=torch.int32, device=device)
    miss_count = torch.empty((G,), dtype=torch.int32, device=device)
    block_s = next_pow2(S)
    _plan_kernel[(B, NL)](
        selected,
        rows,
        layers,
        tables.slot_block,
        tables.slot_stamp,
        tables.block_slot,
        out,
        miss_block,
        miss_slot,
        miss_count,
        step,
        NL,
        R,
        S,
        NB,
        K,
        BLOCK_K=next_pow2(K),
        BLOCK_S=block_s,
        SLOT_BITS=block_s.bit_length() - 1,
        num_warps=8 if block_s >= 1024 else 4,
    )
    words = hot[0, 0, 0].numel() * hot.element_size() // 4
    host_words = device_view(host_arena, device).view(torch.int32)
    hot_words = hot.view(torch.int32)
    _copy_misses_kernel[(G, triton.cdiv(K, misses_per_program))](
        host_words,
        hot_words,
        rows,
        layers,
        miss_block,
        miss_slot,
        miss_count,
        NL,
        L,
        R,
        S,
        NB,
        K,
        W=words,
        BLOCK_W=next_pow2(words),
        PER_PROGRAM=misses_per_program,
        num_warps=4,
    )
    return out
