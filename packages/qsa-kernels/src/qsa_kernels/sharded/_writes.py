"""Write routing: new raw K/V rows and closed compressed index blocks land only on their owner.

A write (prefill or decode) arrives on every rank of the shard group with the logical slots of
its rows and the full rows (K/V projections and the index compressor run replicated). Each rank
keeps the rows it owns: raw K/V token-interleaved (logical slot ``g`` -> rank ``g % N``, local
slot ``g // N``), compressed index blocks page-interleaved (logical block slot ``s`` -> rank
``(s // 16) % N``, local block ``(s // 16) // N * 16 + s % 16``). The pending index ring is not
routed: it stays replicated, since the token that closes a group can arrive before the group's
page owner matters, and every rank then compresses the same closed group and keeps it only if
it owns the page.

:func:`raw_write_targets` / :func:`index_write_targets` give per-row local targets with an owner
mask (fixed shape, no host synchronisation); :func:`write_owned_raw_kv` /
:func:`write_owned_index_blocks` apply them in place without host synchronisation (CUDA-graph
capturable); :func:`route_write_rows` returns the compacted ``(local slot, row)`` pairs of one
rank (data-dependent size: eager only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qsa_core import ShardPlacement
from qsa_kernels._checks import check_ndim
from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS
from qsa_kernels.sharded._layout import _check_rank

__all__ = (
    "LocalWriteTargets",
    "index_write_targets",
    "raw_write_targets",
    "route_write_rows",
    "write_owned_index_blocks",
    "write_owned_raw_kv",
)


class LocalWriteTargets(NamedTuple):
    """One rank's share of a write of ``M`` rows.

    Attributes:
        local: ``[M]`` int64 local slot (raw K/V) or local block (index) of each owned row,
            ``-1`` where another rank owns the row or the logical slot is negative (padding).
        owned: ``[M]`` bool, ``local >= 0``.
    """

    local: torch.Tensor
    owned: torch.Tensor


def _check_slots(name: str, slots: torch.Tensor) -> None:
    check_ndim(name, slots, 1, "[M]")
    if slots.dtype not in {torch.int32, torch.int64}:
        msg = f"{name} must be int32 or int64; got {slots.dtype!r}"
        raise KernelInputError(msg)


def raw_write_targets(
    slots: torch.Tensor, placement: ShardPlacement, rank: int
) -> LocalWriteTargets:
    """Targets of a raw K/V write on rank ``rank`` (token-interleaved placement).

    Args:
        slots: ``[M]`` int32/int64 logical raw token slots of the new tokens (``out_cache_loc``),
            negative for padding rows.
        placement: the shard group's placement.
        rank: this rank.
    """
    _check_slots("slots", slots)
    _check_rank(placement, rank)
    n = placement.world_size
    s = slots.to(torch.int64)
    owned = (s >= 0) & (torch.remainder(s, n) == rank)
    return LocalWriteTargets(torch.where(owned, torch.div(s, n, rounding_mode="floor"), -1), owned)


def index_write_targets(
    block_slots: torch.Tensor, placement: ShardPlacement, rank: int
) -> LocalWriteTargets:
    """Targets of a compressed index write on rank ``rank`` (page-interleaved placement).

    Args:
        block_slots: ``[M]`` int32/int64 logical compressed block slots of the closed blocks
            (``raw slot of any of the block's tokens // 4`` with a page-contiguous slot table:
            page ``s // 16``, offset ``s % 16``), negative for padding rows.
        placement: the shard group's placement.
        rank: this rank.
    """
    _check_slots("block_slots", block_slots)
    _check_rank(placement, rank)
    n, bpp = placement.world_size, placement.blocks_per_page
    s = block_slots.to(torch.int64)
    page = torch.div(s, bpp, rounding_mode="floor")
    owned = (s >= 0) & (torch.remainder(page, n) == rank)
    local = torch.div(page, n, rounding_mode="floor") * bpp + torch.remainder(s, bpp)
    return LocalWriteTargets(torch.where(owned, local, -1), owned)


def _check_rows(name: str, rows: torch.Tensor, targets: LocalWriteTargets) -> None:
    if rows.dim() < 1 or rows.shape[0] != targets.local.shape[0]:
        msg = (
            f"{name} must have one row per target ({targets.local.shape[0]!r}); got shape "
            f"{tuple(rows.shape)!r}"
        )
        raise KernelInputError(msg)


def route_write_rows(
    targets: LocalWriteTargets, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compacted ``(local slot, row)`` pairs this rank must store, in write order.

    Args:
        targets: from :func:`raw_write_targets` or :func:`index_write_targets`.
        rows: ``[M, ...]`` the full rows of the write, any dtype.

    Returns:
        ``(local [M_r] int64, rows [M_r, ...])`` for the ``M_r`` owned rows. ``M_r`` depends on
        the data, so this synchronises with the host; the hot path uses the ``write_owned_*``
        functions instead.
    """
    _check_rows("rows", rows, targets)
    idx = torch.nonzero(targets.owned, as_tuple=True)[0]
    return targets.local.index_select(0, idx), rows.index_select(0, idx)


def _redirect(targets: LocalWriteTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row destination and source row for a sync-free masked write.

    A row another rank owns is redirected to the first owned row's destination with that row's
    value, so every duplicate destination receives identical bytes and the write order does not
    matter. When the rank owns no row at all, every row targets destination 0 with source
    ``M`` (the caller appends destination 0's current value there): a no-op write.
    """
    m = targets.owned.shape[0]
    if m == 0:
        return targets.local, targets.local
    any_owned = targets.owned.any()
    first = torch.argmax(targets.owned.to(torch.int32))  # 0 when none is owned
    rows = torch.arange(m, device=targets.local.device)
    fallback_src = torch.where(any_owned, first, m)
    fallback_dst = torch.where(any_owned, targets.local[first], 0)
    src = torch.where(targets.owned, rows, fallback_src)
    dst = torch.where(targets.owned, targets.local, fallback_dst)
    return dst, src


def write_owned_raw_kv(
    local_kv: torch.Tensor, targets: LocalWriteTargets, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store the owned rows of a raw K/V write into this rank's shard, in place.

    No host synchronisation and fixed shapes (CUDA-graph capturable). Rows another rank owns
    leave the shard unchanged. Two owned rows with one destination is the caller's error, as on
    one rank.

    Args:
        local_kv: ``[NS_local, 2, 4, Hkv, D]`` this rank's shard (:func:`shard_raw_kv` layout).
        targets: :func:`raw_write_targets` of the write's ``M`` slots on this rank.
        k: ``[M, Hkv, D]`` new keys, ``local_kv``'s dtype.
        v: ``[M, Hkv, D]`` new values, ``local_kv``'s dtype.

    Raises:
        KernelInputError: bad shapes or dtypes.
    """
    check_ndim("local_kv", local_kv, 5, "[NS_local, 2, 4, Hkv, D]")
    row_shape = (targets.local.shape[0], local_kv.shape[3], local_kv.shape[4])
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != row_shape or t.dtype != local_kv.dtype:
            msg = (
                f"{name} must be {row_shape!r} {local_kv.dtype!r}; got {tuple(t.shape)!r} "
                f"{t.dtype!r}"
            )
            raise KernelInputError(msg)
    dst, src = _redirect(targets)
    rec = torch.div(dst, BLOCK_TOKENS, rounding_mode="floor")
    pos = torch.remainder(dst, BLOCK_TOKENS)
    for half, rows in ((0, k), (1, v)):
        view = local_kv[:, half]  # [NS_local, 4, Hkv, D], a view of the shard
        values = torch.cat([rows, view[0, 0].unsqueeze(0)]).index_select(0, src)
        view.index_put_((rec, pos), values)


def write_owned_index_blocks(
    local_index: torch.Tensor, targets: LocalWriteTargets, rows: torch.Tensor
) -> None:
    """Store the owned closed blocks of an index write into this rank's shard, in place.

    No host synchronisation and fixed shapes (CUDA-graph capturable).

    Args:
        local_index: ``[P_local, 16, Dk]`` this rank's compressed index shard
            (:func:`shard_index_pages` layout), contiguous.
        targets: :func:`index_write_targets` of the write's ``M`` block slots on this rank.
        rows: ``[M, Dk]`` compressed index keys of the closed blocks, ``local_index``'s dtype.

    Raises:
        KernelInputError: bad shapes or dtypes, or a non-contiguous shard.
    """
    check_ndim("local_index", local_index, 3, "[P_local, 16, Dk]")
    if not local_index.is_contiguous():
        msg = f"local_index must be contiguous; got strides {local_index.stride()!r}"
        raise KernelInputError(msg)
    row_shape = (targets.local.shape[0], local_index.shape[2])
    if tuple(rows.shape) != row_shape or rows.dtype != local_index.dtype:
        msg = (
            f"rows must be {row_shape!r} {local_index.dtype!r}; got {tuple(rows.shape)!r} "
            f"{rows.dtype!r}"
        )
        raise KernelInputError(msg)
    flat = local_index.view(-1, local_index.shape[2])
    dst, src = _redirect(targets)
    values = torch.cat([rows, flat[0:1]]).index_select(0, src)
    flat.index_copy_(0, dst, values)
