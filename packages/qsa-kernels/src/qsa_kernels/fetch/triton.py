"""Triton selected-block fetch: a plan kernel (hits, LRU victims) and a zero-copy miss copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_kernels._checks import next_pow2, sm_count
from qsa_kernels._errors import KernelInputError
from qsa_kernels._uva import device_view
from qsa_kernels.fetch._tables import MAX_HOT_SLOTS, HotCacheTables
from qsa_kernels.fetch._validate import check_fetch_args

__all__ = ("fetch_selected_blocks",)

_INT64_MAX = tl.constexpr(0x7FFFFFFFFFFFFFFF)
#: Victim groups (slots sharing one (occupied, stamp) rank) taken by min-extraction before the
#: plan kernel falls back to sorting the remaining candidates.
_MAX_GROUPS = 8


@triton.jit  # type: ignore[untyped-decorator]
def _plan_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    sel_ptr,  # [B, NL, K] int32 selected block ids, -1 padding
    rows_ptr,  # [B] int32 request row of each batch entry
    layers_ptr,  # [NL] int32 layer of each selection column
    slot_block_ptr,  # [L, R, S] int32 resident block per slot, -1 empty
    slot_stamp_ptr,  # [L, R, S] int64 last-use step per slot, -1 never
    block_slot_ptr,  # [L, R, NB] int32 local slot per resident block, -1 absent
    out_ptr,  # [B, NL, K] int32 global slot (row * S + s) per entry, -1 padding
    victim_ptr,  # [B * NL, K] int32 scratch: victim local slot by victim rank
    copy_src_ptr,  # [B * NL * K] int64 miss list: host record index (row * L + layer) * NB + blk
    copy_dst_ptr,  # [B * NL * K] int64 miss list: hot record index (layer * R + row) * S + slot
    copy_count_ptr,  # [1] int32 entries in the miss list (zero on entry)
    step_ptr,  # [1] int64 this step's stamp when STEP_FROM_PTR
    counters_ptr,  # [2] int64 (selected, missing) entries added to when COUNT
    step_arg,  # this step's stamp otherwise
    NL,
    L,
    R,
    S,
    NB,
    K,
    BLOCK_K: tl.constexpr,  # next_pow2(K): one register tile holds the whole selection
    BLOCK_S: tl.constexpr,  # next_pow2(S): one tile holds every slot
    SLOT_BITS: tl.constexpr,  # log2(BLOCK_S): width of the slot field in the fallback sort key
    MAX_GROUPS: tl.constexpr,  # rank groups extracted by min before falling back to a sort
    STEP_FROM_PTR: tl.constexpr,
    COUNT: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    g = b * NL + j
    if STEP_FROM_PTR:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        step = tl.load(step_ptr)
    else:
        step = step_arg
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
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    if COUNT:
        tl.atomic_add(counters_ptr, tl.sum(valid.to(tl.int64), axis=0))
        tl.atomic_add(counters_ptr + 1, n_miss.to(tl.int64))

    # (5, hits) Stamp hit slots first: afterwards a slot is a victim candidate iff its stamp is
    # older than this step, since a resident selected block is always a hit.
    step64 = tl.zeros((BLOCK_K,), tl.int64) + step
    tl.store(slot_stamp_ptr + slot_base + held.to(tl.int64), step64, mask=hit)
    tl.debug_barrier()

    # (3, 4) The n_miss smallest candidates by (occupied, stamp, slot), without a full sort:
    # repeatedly take every candidate of the smallest (occupied, stamp) rank, in slot order (a
    # prefix sum), until n_miss are taken. Stamps are step numbers, so the oldest rank usually
    # covers a whole step's evictions and one or two rounds suffice.
    scratch = g.to(tl.int64) * K
    if n_miss > 0:
        offs_s = tl.arange(0, BLOCK_S)
        smask = offs_s < S
        stamp = tl.load(slot_stamp_ptr + slot_base + offs_s, mask=smask, other=0)
        blk = tl.load(slot_block_ptr + slot_base + offs_s, mask=smask, other=-1)
        cand = smask & (stamp < step)
        occupied = (blk >= 0).to(tl.int64)
        rank_key = tl.where(cand, (occupied << 62) | (stamp + 1), _INT64_MAX)
        taken = n_miss * 0
        rounds = taken
        while (taken < n_miss) & (rounds < MAX_GROUPS):
            low = tl.min(rank_key, axis=0)
            group = rank_key == low
            pos = taken + tl.cumsum(group.to(tl.int32), axis=0) - 1
            tl.store(victim_ptr + scratch + pos, offs_s.to(tl.int32), mask=group & (pos < n_miss))
            taken += tl.sum(group.to(tl.int32), axis=0)
            rank_key = tl.where(group, _INT64_MAX, rank_key)
            rounds += 1
        if taken < n_miss:
            # Many distinct stamps among the victims: sort what is left (rare).
            key = (occupied << 62) | ((stamp + 1) << SLOT_BITS) | offs_s.to(tl.int64)
            key = tl.where(rank_key != _INT64_MAX, key, _INT64_MAX)
            ordered = tl.sort(key)
            victim = (ordered & (BLOCK_S - 1)).to(tl.int32)
            tl.store(victim_ptr + scratch + taken + offs_s, victim, mask=offs_s < n_miss - taken)
    tl.debug_barrier()

    # (2, 4) The j-th miss in entry order takes the j-th victim.
    rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    vslot = tl.load(victim_ptr + scratch + rank, mask=miss, other=0)
    vslot64 = vslot.to(tl.int64)

    # (5, misses) Evict the victims' old blocks from the map, install the missed ids.
    old = tl.load(slot_block_ptr + slot_base + vslot64, mask=miss, other=-1)
    minus1 = tl.full((BLOCK_K,), -1, tl.int32)
    tl.store(block_slot_ptr + map_base + old.to(tl.int64), minus1, mask=miss & (old >= 0))
    tl.store(block_slot_ptr + map_base + sel64, vslot, mask=miss)
    tl.store(slot_block_ptr + slot_base + vslot64, sel, mask=miss)
    tl.store(slot_stamp_ptr + slot_base + vslot64, step64, mask=miss)

    # Append this hot cache's misses to the step's copy list (order across caches is free).
    if n_miss > 0:
        first = tl.atomic_add(copy_count_ptr, n_miss)
        at = first + rank
        tl.store(copy_src_ptr + at, (row * L + layer) * NB + sel64, mask=miss)
        tl.store(copy_dst_ptr + at, slot_base + vslot64, mask=miss)

    # (6) Selected slots, as global slots of the layer's hot cache.
    local = tl.where(hit, held, vslot).to(tl.int64)
    out = tl.where(valid, row * S + local, -1).to(tl.int32)
    tl.store(out_ptr + g.to(tl.int64) * K + offs_k, out, mask=kmask)


@triton.jit  # type: ignore[untyped-decorator]
def _copy_misses_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    host_ptr,  # [R * L * NB, W] int32 words of the host arena (pinned, device-mapped)
    hot_ptr,  # [L * R * S, W] int32 words of the hot cache
    copy_src_ptr,  # [N] int64 host record index per miss
    copy_dst_ptr,  # [N] int64 hot record index per miss
    copy_count_ptr,  # [1] int32 number of misses N
    step_ptr,  # [1] int64 step tensor, advanced by one when ADVANCE_STEP
    W: tl.constexpr,  # 32-bit words per record; constexpr so the copy unrolls into 16-byte moves
    BLOCK_W: tl.constexpr,  # next_pow2(W)
    RECORDS: tl.constexpr,  # records one program moves per iteration (loads issued together)
    ADVANCE_STEP: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = tl.load(copy_count_ptr)
    offs_w = tl.arange(0, BLOCK_W)
    if RECORDS == 1:
        wmask1 = offs_w < W
        for i in range(pid, n, nprog):
            src1 = tl.load(copy_src_ptr + i)
            dst1 = tl.load(copy_dst_ptr + i)
            words1 = tl.load(host_ptr + src1 * W + offs_w, mask=wmask1)
            tl.store(hot_ptr + dst1 * W + offs_w, words1, mask=wmask1)
    else:
        offs_r = tl.arange(0, RECORDS)
        wmask = offs_w[None, :] < W
        for first in range(pid * RECORDS, n, nprog * RECORDS):
            idx = first + offs_r
            live = idx < n
            src = tl.load(copy_src_ptr + idx, mask=live, other=0)
            dst = tl.load(copy_dst_ptr + idx, mask=live, other=0)
            m = live[:, None] & wmask
            words = tl.load(host_ptr + src[:, None] * W + offs_w[None, :], mask=m)
            tl.store(hot_ptr + dst[:, None] * W + offs_w[None, :], words, mask=m)
    if ADVANCE_STEP:  # noqa: SIM102 (constexpr outer test, run-time inner test)
        if pid == 0:
            tl.store(step_ptr, tl.load(step_ptr) + 1)


def fetch_selected_blocks(
    selected: torch.Tensor,
    rows: torch.Tensor,
    layers: torch.Tensor,
    *,
    step: int | torch.Tensor,
    tables: HotCacheTables,
    hot: torch.Tensor,
    host_arena: torch.Tensor,
    counters: torch.Tensor | None = None,
    copy_programs_per_sm: int = 16,
    copy_records: int = 1,
    copy_warps: int = 4,
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

    The call never synchronises with the device and, given a step tensor, reads no device value
    on the host, so it can be captured in a CUDA graph and replayed step after step.

    Args:
        selected: ``[B, NL, K]`` int32 block ids; ``-1`` is padding, anywhere. Valid ids of one
            row must be distinct and lie in ``[0, NB)`` (not checked on device).
        rows: ``[B]`` int32 request row of each batch entry (distinct).
        layers: ``[NL]`` int32 layer of each selection column (distinct); all layers of a step may
            be fetched in one call.
        step: Stamp of this step; must exceed every stamp in the touched hot caches. Either an
            int, or a ``[1]`` int64 tensor on the tables' device whose value is read by the kernel
            and then advanced by one (stream-ordered), so consecutive calls or graph replays use
            consecutive stamps.
        tables: Residency state, updated in place.
        hot: ``[L, R, S, 2, 4, Hkv, D]`` hot cache (FP8 E4M3 or bf16), updated in place.
        host_arena: ``[R, L, NB, 2, 4, Hkv, D]`` pinned host arena, same dtype (read only).
        counters: ``[2]`` int64 on the tables' device, or None: the call adds its selected
            entries and its misses (the records it copies) to it, on the device.
        copy_programs_per_sm: Copy programs launched per SM (tuning; they loop over the misses).
        copy_records: Records one copy program loads at once (tuning; a power of two).
        copy_warps: Warps per copy program (tuning).

    Returns:
        ``[B, NL, K]`` int32 global slots ``rows[b] * S + slot`` of every entry, ``-1`` where
        ``selected`` is ``-1``; ``hot[layers[j]].view(R * S, 2, 4, Hkv, D)`` indexed by it gives the
        selected records.

    Raises:
        KernelInputError: On a bad shape, dtype, device or layout, ``K > S``, or bad tuning values.
    """
    check_fetch_args(
        selected,
        rows,
        layers,
        step=step,
        tables=tables,
        hot=hot,
        host_arena=host_arena,
        counters=counters,
    )
    if tables.slots > MAX_HOT_SLOTS:
        msg = f"S={tables.slots!r} slots per hot cache; at most {MAX_HOT_SLOTS!r} supported"
        raise KernelInputError(msg)
    if copy_programs_per_sm < 1 or copy_warps < 1:
        msg = (
            f"copy_programs_per_sm and copy_warps must be >= 1; got {copy_programs_per_sm!r} "
            f"and {copy_warps!r}"
        )
        raise KernelInputError(msg)
    if copy_records < 1 or copy_records & (copy_records - 1):
        msg = f"copy_records must be a power of two >= 1; got {copy_records!r}"
        raise KernelInputError(msg)
    device = tables.device
    B, NL, K = selected.shape
    L, R, S, NB = tables.layers, tables.rows, tables.slots, tables.blocks
    out = torch.empty_like(selected)
    step_tensor = step if isinstance(step, torch.Tensor) else None
    G = B * NL
    if G == 0 or K == 0:
        if step_tensor is not None:
            step_tensor.add_(1)
        return out.fill_(-1)
    victims = torch.empty((G, K), dtype=torch.int32, device=device)
    copy_src = torch.empty((G * K,), dtype=torch.int64, device=device)
    copy_dst = torch.empty((G * K,), dtype=torch.int64, device=device)
    copy_count = torch.zeros((1,), dtype=torch.int32, device=device)
    step_ptr = step_tensor if step_tensor is not None else copy_src
    block_s = next_pow2(S)
    _plan_kernel[(B, NL)](
        selected,
        rows,
        layers,
        tables.slot_block,
        tables.slot_stamp,
        tables.block_slot,
        out,
        victims,
        copy_src,
        copy_dst,
        copy_count,
        step_ptr,
        counters if counters is not None else copy_src,
        0 if step_tensor is not None else int(step),
        NL,
        L,
        R,
        S,
        NB,
        K,
        BLOCK_K=next_pow2(K),
        BLOCK_S=block_s,
        SLOT_BITS=block_s.bit_length() - 1,
        MAX_GROUPS=_MAX_GROUPS,
        STEP_FROM_PTR=step_tensor is not None,
        COUNT=counters is not None,
        num_warps=8 if block_s >= 1024 else 4,
    )
    words = hot[0, 0, 0].numel() * hot.element_size() // 4
    host_words = device_view(host_arena, device).view(torch.int32)
    hot_words = hot.view(torch.int32)
    programs = min(G * K, sm_count(device, cpu=2) * copy_programs_per_sm)
    _copy_misses_kernel[(programs,)](
        host_words,
        hot_words,
        copy_src,
        copy_dst,
        copy_count,
        step_ptr,
        W=words,
        BLOCK_W=next_pow2(words),
        RECORDS=copy_records,
        ADVANCE_STEP=step_tensor is not None,
        num_warps=copy_warps,
    )
    return out
