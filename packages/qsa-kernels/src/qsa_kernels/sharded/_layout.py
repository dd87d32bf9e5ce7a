"""Tensor adapters from :class:`qsa_core.ShardPlacement` to per-rank shards of the QSA caches.

Raw K/V is token-interleaved: logical raw slot ``g`` (a token slot, ``req_to_token`` value) lives
on rank ``g % N`` at local slot ``g // N``. Both the logical cache and each local shard use the
record layout of :mod:`qsa_kernels.sparse_decode`: ``[NS, 2, 4, Hkv, D]``, token slot ``t`` at
record ``t // 4``, position ``t % 4``; so a local slot is directly a token slot of the local cache.

The compressed index is page-interleaved: compressed page ``p`` (16 blocks) lives on rank
``p % N`` at local page ``p // N``. A request's blocks are numbered by position (block ``j`` holds
tokens ``4j .. 4j + 3`` and sits at ``page_table[b, j // 16]``, offset ``j % 16``); these
request-relative ids are the global block ids of the distributed top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from qsa_core import ShardPlacement
from qsa_kernels._checks import check_ndim
from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS

__all__ = (
    "LocalIndexTable",
    "compact_owned_slots",
    "local_index_table",
    "localize_blocks",
    "localize_token_slots",
    "owned_token_bound",
    "shard_index_pages",
    "shard_raw_kv",
    "unshard_index_pages",
    "unshard_raw_kv",
)


def _check_rank(placement: ShardPlacement, rank: int) -> None:
    if not 0 <= rank < placement.world_size:
        msg = f"rank={rank!r} is not allowed; allowed: 0..{placement.world_size - 1}"
        raise KernelInputError(msg)


def _local_records(placement: ShardPlacement, num_records: int) -> int:
    """Records of every rank's local shard of ``num_records`` logical records (equal on all)."""
    return -(-placement.local_capacity(num_records * BLOCK_TOKENS) // BLOCK_TOKENS)


def shard_raw_kv(kv: torch.Tensor, placement: ShardPlacement, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local shard of a logical raw K/V cache.

    Args:
        kv: ``[NS, 2, 4, Hkv, D]`` logical cache (token slot ``g`` = record ``g // 4``, row
            ``g % 4``), any dtype.
        placement: the shard group's placement.
        rank: the rank whose shard to build.

    Returns:
        ``[ceil(ceil(4 NS / N) / 4), 2, 4, Hkv, D]`` contiguous, same dtype; local token slot ``l``
        holds logical slot ``l * N + rank``; slots past the logical end are zero. Every rank's
        shard has the same shape.
    """
    check_ndim("kv", kv, 5, "[NS, 2, 4, Hkv, D]")
    _check_rank(placement, rank)
    ns, _, tokens, hkv, d = kv.shape
    if tokens != BLOCK_TOKENS:
        msg = (
            f"kv must have {BLOCK_TOKENS} tokens per record (dim 2); got shape {tuple(kv.shape)!r}"
        )
        raise KernelInputError(msg)
    n = placement.world_size
    records = _local_records(placement, ns)
    by_token = kv.transpose(0, 1).reshape(2, ns * BLOCK_TOKENS, hkv, d)[:, rank::n]
    out = torch.zeros((2, records * BLOCK_TOKENS, hkv, d), dtype=kv.dtype, device=kv.device)
    out[:, : by_token.shape[1]] = by_token
    return out.view(2, records, BLOCK_TOKENS, hkv, d).transpose(0, 1).contiguous()


def unshard_raw_kv(
    shards: Sequence[torch.Tensor], placement: ShardPlacement, num_records: int
) -> torch.Tensor:
    """Inverse of :func:`shard_raw_kv`: the logical ``[num_records, 2, 4, Hkv, D]`` cache.

    Args:
        shards: one local shard per rank, in rank order, as :func:`shard_raw_kv` returns them.
        placement: the shard group's placement.
        num_records: logical records ``NS``.
    """
    n = placement.world_size
    if len(shards) != n:
        msg = f"need one shard per rank ({n!r}); got {len(shards)!r}"
        raise KernelInputError(msg)
    records = _local_records(placement, num_records)
    first = shards[0]
    check_ndim("shards[0]", first, 5, "[NS_local, 2, 4, Hkv, D]")
    hkv, d = first.shape[3], first.shape[4]
    out = torch.empty(
        (2, num_records * BLOCK_TOKENS, hkv, d), dtype=first.dtype, device=first.device
    )
    for rank, shard in enumerate(shards):
        if tuple(shard.shape) != (records, 2, BLOCK_TOKENS, hkv, d):
            msg = (
                f"shards[{rank}] has shape {tuple(shard.shape)!r}; expected "
                f"{(records, 2, BLOCK_TOKENS, hkv, d)!r}"
            )
            raise KernelInputError(msg)
        count = placement.raw_slots_on_rank(num_records * BLOCK_TOKENS, rank)
        tokens = shard.transpose(0, 1).reshape(2, records * BLOCK_TOKENS, hkv, d)
        out[:, rank::n] = tokens[:, :count]
    return out.view(2, num_records, BLOCK_TOKENS, hkv, d).transpose(0, 1).contiguous()


def shard_index_pages(pages: torch.Tensor, placement: ShardPlacement, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local shard of a compressed index cache.

    Args:
        pages: ``[NP, 16, 128]`` (any ``[NP, ...]``) compressed pages by logical page id.
        placement: the shard group's placement.
        rank: the rank whose shard to build.

    Returns:
        ``[ceil(NP / N), ...]`` contiguous; local page ``l`` holds logical page ``l * N + rank``;
        pages past the logical end are zero. Every rank's shard has the same shape.
    """
    _check_rank(placement, rank)
    n = placement.world_size
    local = pages[rank::n]
    out = torch.zeros(
        (placement.local_capacity(pages.shape[0]), *pages.shape[1:]),
        dtype=pages.dtype,
        device=pages.device,
    )
    out[: local.shape[0]] = local
    return out


def unshard_index_pages(
    shards: Sequence[torch.Tensor], placement: ShardPlacement, num_pages: int
) -> torch.Tensor:
    """Inverse of :func:`shard_index_pages`: the logical ``[num_pages, ...]`` index cache."""
    n = placement.world_size
    if len(shards) != n:
        msg = f"need one shard per rank ({n!r}); got {len(shards)!r}"
        raise KernelInputError(msg)
    first = shards[0]
    out = torch.empty((num_pages, *first.shape[1:]), dtype=first.dtype, device=first.device)
    for rank, shard in enumerate(shards):
        count = len(range(rank, num_pages, n))
        if shard.shape[0] < count or tuple(shard.shape[1:]) != tuple(first.shape[1:]):
            msg = f"shards[{rank}] has shape {tuple(shard.shape)!r}; it needs {count!r} pages"
            raise KernelInputError(msg)
        out[rank::n] = shard[:count]
    return out


def localize_token_slots(
    slots: torch.Tensor, placement: ShardPlacement, rank: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep the logical raw slots rank ``rank`` owns, as local slots.

    Args:
        slots: ``[B, T]`` int32/int64 logical raw slots, ``-1`` (any negative) padding.
        placement: the shard group's placement.
        rank: this rank.
        out: optional ``[B, T]`` int32 destination (fully written).

    Returns:
        ``[B, T]`` int32: ``slot // N`` where ``slot >= 0 and slot % N == rank``, else ``-1``.
        Positions are kept (no compaction); sparse decode accepts ``-1`` anywhere.
    """
    _check_rank(placement, rank)
    n = placement.world_size
    owned = (slots >= 0) & (torch.remainder(slots, n) == rank)
    local = torch.where(owned, torch.div(slots, n, rounding_mode="floor"), -1)
    if out is None:
        return local.to(torch.int32)
    out.copy_(local)
    return out


def localize_blocks(blocks: torch.Tensor, placement: ShardPlacement, rank: int) -> torch.Tensor:
    """Keep the request-relative blocks rank ``rank`` owns, as its local block ids.

    The tensor form of :meth:`qsa_core.ShardPlacement.block_owner` and
    :meth:`~qsa_core.ShardPlacement.block_local`: block ``j`` lies on page ``j // 16``, owned by
    rank ``(j // 16) % N``, at local block ``(j // 16 // N) * 16 + j % 16``. The owned blocks of
    any range ``[a, b)`` have consecutive local ids. Elementwise, no host synchronisation.

    Args:
        blocks: int32/int64 block ids of any shape, ``-1`` (any negative) padding.
        placement: the shard group's placement.
        rank: this rank.

    Returns:
        int32, shaped like ``blocks``: the local id where ``rank`` owns the block, else ``-1``.
    """
    _check_rank(placement, rank)
    n, bpp = placement.world_size, placement.blocks_per_page
    page = torch.div(blocks, bpp, rounding_mode="floor")
    owned = (blocks >= 0) & (torch.remainder(page, n) == rank)
    local = torch.div(page, n, rounding_mode="floor") * bpp + torch.remainder(blocks, bpp)
    return torch.where(owned, local, -1).to(torch.int32)


def owned_token_bound(
    placement: ShardPlacement, topk: int, *, contiguous_blocks: bool = True
) -> int:
    """Most selected tokens one rank can own in one decode row: the static compacted width.

    A row selects ``topk`` blocks of ``r = compress_ratio`` tokens plus at most ``r - 1`` tail
    tokens. When each block's tokens sit on ``r`` consecutive raw slots (true whenever the raw
    page size is a multiple of ``r`` and ``req_to_token`` is page-contiguous, as SGLang's paged
    allocator with QSA's page of 64 guarantees), ``c`` consecutive slots give one rank at most
    ``ceil(c / N)`` of them, so the bound is ``topk * ceil(r / N) + ceil((r - 1) / N)``
    (``N = 1, 2, 3, 4`` and ``topk = 512``: 2051, 1026, 1025, 513). Without that layout
    guarantee every selected token can land on one rank and the bound is ``topk * r + r - 1``.

    Args:
        placement: the shard group's placement.
        topk: blocks selected per row, ``>= 1``.
        contiguous_blocks: whether every block occupies ``r`` consecutive raw slots.

    Raises:
        KernelInputError: ``topk < 1``.
    """
    checked: object = topk
    if isinstance(checked, bool) or not isinstance(checked, int) or topk < 1:
        msg = f"topk={topk!r} must be a positive int"
        raise KernelInputError(msg)
    r = placement.compress_ratio
    n = placement.world_size if contiguous_blocks else 1
    return topk * -(-r // n) + -(-(r - 1) // n)


def compact_owned_slots(
    slots: torch.Tensor, placement: ShardPlacement, rank: int, *, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s owned local slots of each row, moved to the front in their original order.

    A fixed-size permutation of each row (cumulative sums and one scatter): no host
    synchronisation and no data-dependent shape, so it is CUDA-graph capturable.

    Args:
        slots: ``[B, T]`` int32/int64 logical raw slots, ``-1`` (any negative) padding.
        placement: the shard group's placement.
        rank: this rank.
        out: optional ``[B, T]`` int32 destination (fully written; must not alias ``slots``).

    Returns:
        ``(local [B, T] int32, counts [B] int32)``: row ``b`` holds its ``counts[b]`` owned local
        slots (``slot // N`` of each ``slot % N == rank``) in the order they appear in
        ``slots[b]``, then ``-1``. Attention over ``local[:, :w]`` with ``w >= counts.max()``
        equals attention over all of ``local``.
    """
    check_ndim("slots", slots, 2, "[B, T]")
    _check_rank(placement, rank)
    n = placement.world_size
    batch, width = slots.shape
    owned = (slots >= 0) & (torch.remainder(slots, n) == rank)
    local = torch.where(owned, torch.div(slots, n, rounding_mode="floor"), -1).to(torch.int32)
    before = torch.cumsum(owned.to(torch.int64), dim=1)
    counts = before[:, -1] if width else torch.zeros(batch, dtype=torch.int64, device=slots.device)
    col = torch.arange(width, device=slots.device)
    # Owned entry -> its rank among owned; non-owned -> count + its rank among non-owned.
    dest = torch.where(owned, before - 1, counts[:, None] + col[None, :] - before)
    if out is not None and (out.shape != slots.shape or out.dtype != torch.int32):
        msg = (
            f"out must be [B, T]={tuple(slots.shape)!r} int32; got {tuple(out.shape)!r} "
            f"{out.dtype!r}"
        )
        raise KernelInputError(msg)
    target = (
        torch.empty((batch, width), dtype=torch.int32, device=slots.device) if out is None else out
    )
    target.scatter_(1, dest, local)
    return target, counts.to(torch.int32)


class LocalIndexTable(NamedTuple):
    """A decode batch's view of the compressed index pages one rank owns.

    Attributes:
        page_table: ``[B, W]`` int32 local page ids, the owned pages of each row in request
            order; ``0`` in unused columns (never read: see ``seq_lens``).
        request_pages: ``[B, W]`` int32 request page index of each column (``global block id =
            16 * request_pages[b, c // 16] + c % 16``); ``-1`` in unused columns.
        seq_lens: ``[B]`` int32 ``4 x`` the owned visible blocks, the ``seq_lens`` to give the
            indexer so it scores exactly the owned complete blocks.
    """

    page_table: torch.Tensor
    request_pages: torch.Tensor
    seq_lens: torch.Tensor


def local_index_table(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    placement: ShardPlacement,
    rank: int,
    *,
    width: int | None = None,
) -> LocalIndexTable:
    """Restrict a decode batch's compressed page table to the pages rank ``rank`` owns.

    Row ``b`` sees ``n = min(seq_lens[b] // 4, P * 16)`` complete blocks on ``ceil(n / 16)``
    pages; of those, the pages ``p`` with ``p % N == rank`` are kept in request order. Only the
    last visible page can be partial, so it is also last locally, and the owned blocks are a
    prefix of the local columns. No host synchronisation unless ``width`` is given.

    Args:
        page_table: ``[B, P]`` int32/int64 logical compressed page ids (``req_to_token[:, ::64] //
            64``); entries past a row's visible pages are ignored.
        seq_lens: ``[B]`` int32/int64 tokens visible to each query (position + 1).
        placement: the shard group's placement (``blocks_per_page`` 16, ``compress_ratio`` 4).
        rank: this rank.
        width: local page columns ``W``; default ``P`` (enough for any allocation). A smaller
            bound (``ceil(P / N)`` with an interleaving allocator) shrinks the local top-k; it is
            checked, which synchronises with the host.

    Raises:
        KernelInputError: bad shapes or dtypes, or a row owning more than ``width`` pages.
    """
    check_ndim("page_table", page_table, 2, "[B, P]")
    _check_rank(placement, rank)
    batch, p = page_table.shape
    if p < 1:
        msg = f"page_table must have at least one column; got shape {tuple(page_table.shape)!r}"
        raise KernelInputError(msg)
    if seq_lens.shape != (batch,):
        msg = f"seq_lens must be [B={batch}]; got {tuple(seq_lens.shape)!r}"
        raise KernelInputError(msg)
    w = p if width is None else width
    if w < 1:
        msg = f"width={w!r} must be >= 1"
        raise KernelInputError(msg)
    n = placement.world_size
    bpp = placement.blocks_per_page
    ratio = placement.compress_ratio
    dev = page_table.device
    pt = page_table.to(torch.int64)
    blocks = torch.clamp(
        torch.div(seq_lens.to(torch.int64), ratio, rounding_mode="floor"), 0, p * bpp
    )
    npages = torch.div(blocks + bpp - 1, bpp, rounding_mode="floor")
    col = torch.arange(p, device=dev)
    owned = (col[None, :] < npages[:, None]) & (torch.remainder(pt, n) == rank)
    count = owned.sum(dim=1)
    if width is not None and bool((count > w).any()):
        worst = int(count.max())
        msg = f"a row owns {worst!r} pages on rank {rank!r}, more than width={w!r}"
        raise KernelInputError(msg)
    pos = torch.where(owned, torch.cumsum(owned.to(torch.int64), dim=1) - 1, w)
    local_pt = torch.zeros((batch, w + 1), dtype=torch.int64, device=dev)
    local_pt.scatter_(1, pos, torch.where(owned, torch.div(pt, n, rounding_mode="floor"), 0))
    req_pages = torch.full((batch, w + 1), -1, dtype=torch.int64, device=dev)
    req_pages.scatter_(1, pos, torch.where(owned, col[None, :].expand(batch, p), -1))
    last = torch.clamp(npages - 1, min=0)
    last_owned = (npages > 0) & owned.gather(1, last[:, None]).squeeze(1)
    tail = torch.remainder(blocks, bpp)
    local_blocks = count * bpp - torch.where(last_owned & (tail > 0), bpp - tail, 0)
    return LocalIndexTable(
        local_pt[:, :w].to(torch.int32),
        req_pages[:, :w].to(torch.int32),
        (local_blocks * ratio).to(torch.int32),
    )
