"""Exact distributed QSA block top-k: local scoring, local top-k, one all-gather, one merge.

Each rank scores only the compressed blocks it owns (:func:`qsa_kernels.indexer_topk.indexer_scores`
on its local pages), keeps its best ``topk`` as ``(fp32 score, int32 global block id)`` under the
``qsa_core`` order (score descending, ties to the smaller id, ``-0.0 == +0.0``), all-gathers the
candidates and merges them with :func:`qsa_kernels.topk_merge.merge_candidates`. Ownership is
disjoint and a block of the global top-k is in its owner's local top-k, so the merge is the
single-rank :func:`qsa_kernels.indexer_topk.indexer_topk` set on every rank. Every rank always
scores: a rank whose own blocks number ``<= topk`` still sends their scores, because the global row
can hold more.

Exactness needs each block's score to be computed identically wherever it is scored. The Triton
scorer computes a block from its key and the query alone (the tile it lands in does not change
the arithmetic). The CPU reference uses a BLAS product whose last bit can depend on how many
blocks one call holds, so on CPU the selection is exact only up to such one-ulp differences.
"""

from __future__ import annotations

import math

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._topk_keys import KEY_NONE
from qsa_kernels.indexer_topk import indexer_scores, indexer_scores_reference
from qsa_kernels.sharded._buffers import ShardedDecodeBuffers
from qsa_kernels.sharded._group import KernelPath, ShardGroup, all_gather_flat
from qsa_kernels.sharded._layout import LocalIndexTable
from qsa_kernels.topk_merge import MergedTopK, merge_candidates, merge_candidates_reference

__all__ = ("local_topk_candidates", "sharded_indexer_topk")

_LOW32 = 0xFFFFFFFF


def local_topk_candidates(
    scores: torch.Tensor, table: LocalIndexTable, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's best ``topk`` owned blocks with their global ids, any order.

    Args:
        scores: ``[B, W * 16]`` fp32 indexer scores of the local columns (from
            ``indexer_scores(q, local_cache, table.page_table, table.seq_lens)``).
        table: the rank's :class:`LocalIndexTable` (``W`` page columns).
        topk: candidates per row, ``>= 1``.

    Returns:
        ``(scores [B, topk] fp32, ids [B, topk] int32)``: ``-0.0`` canonicalised to ``+0.0``;
        ``(-inf, -1)`` where the rank owns fewer than ``topk`` visible blocks.
    """
    batch, width = scores.shape
    bpp = width // table.page_table.shape[1] if table.page_table.shape[1] else 0
    if scores.dtype != torch.float32 or bpp * table.page_table.shape[1] != width:
        msg = (
            f"scores must be [B, W * 16] fp32 for W={table.page_table.shape[1]!r}; got "
            f"{tuple(scores.shape)!r} {scores.dtype!r}"
        )
        raise KernelInputError(msg)
    if topk < 1:
        msg = f"topk={topk!r} must be >= 1"
        raise KernelInputError(msg)
    dev = scores.device
    col = torch.arange(width, device=dev)
    blocks = torch.div(table.seq_lens.to(torch.int64), 4, rounding_mode="floor")
    valid = col[None, :] < blocks[:, None]
    req_page = table.request_pages.to(torch.int64).repeat_interleave(bpp, dim=1)
    gid = req_page * bpp + torch.remainder(col, bpp)[None, :]
    s = torch.where(scores == 0, 0.0, scores)
    bits = s.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    keys = torch.where(valid, (ordered << 32) | (_LOW32 - gid), KEY_NONE)
    if width < topk:
        pad = torch.full((batch, topk - width), KEY_NONE, dtype=torch.int64, device=dev)
        keys = torch.cat([keys, pad], dim=1)
    top = torch.topk(keys, topk, dim=1, sorted=False).values
    live = top != KEY_NONE
    hi = (top >> 32).to(torch.int32)
    top_scores = torch.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).view(torch.float32)
    top_ids = (_LOW32 - (top & _LOW32)).to(torch.int32)
    return (
        torch.where(live, top_scores, -math.inf),
        torch.where(live, top_ids, -1),
    )


def sharded_indexer_topk(
    q: torch.Tensor,
    local_index: torch.Tensor,
    table: LocalIndexTable,
    *,
    shard: ShardGroup,
    buffers: ShardedDecodeBuffers,
    path: KernelPath = KernelPath.AUTO,
    check_nan: bool = False,
) -> MergedTopK:
    """The global top-``buffers.topk`` blocks of each decode row, identical on every rank.

    Collective: one all-gather of ``B * topk * 8`` bytes per rank (``[B, topk, 2]`` fp32 pairs,
    the id bit-cast), into ``buffers.candidate_recv``.

    Args:
        q: ``[B, 4, 128]`` bf16/fp8 index queries, replicated on every rank of the group.
        local_index: ``[local pages, 16, 128]`` this rank's compressed index shard.
        table: this rank's :func:`local_index_table` of the batch.
        shard: this rank's shard group.
        buffers: static buffers with ``max_rows >= B``.
        path: kernels or references for scoring and merge.
        check_nan: reject NaN scores in the merge (a host synchronisation).

    Returns:
        :class:`MergedTopK` ``[B, topk]``: best first; ids are request-relative block ids
        (``-1`` padding when a row has fewer than ``topk`` complete blocks).
    """
    batch = q.shape[0]
    buffers.check_rows(batch)
    if buffers.world_size != shard.world_size:
        msg = (
            f"buffers are for world_size={buffers.world_size!r}, the group has {shard.world_size!r}"
        )
        raise KernelInputError(msg)
    k = buffers.topk
    concrete = path.resolve(q.device)
    score_fn = indexer_scores if concrete is KernelPath.TRITON else indexer_scores_reference
    scores = score_fn(q, local_index, table.page_table, table.seq_lens)
    cand_scores, cand_ids = local_topk_candidates(scores, table, k)
    n_words = batch * k * 2
    send = buffers.candidate_send[:n_words].view(batch, k, 2)
    send[..., 0] = cand_scores
    send[..., 1] = cand_ids.view(torch.float32)
    recv_flat = buffers.candidate_recv[: shard.world_size * n_words]
    all_gather_flat(shard, buffers.candidate_send[:n_words], recv_flat)
    recv = recv_flat.view(shard.world_size, batch, k, 2)
    all_scores = recv[..., 0]
    all_ids = recv[..., 1].view(torch.int32)
    if concrete is KernelPath.TRITON:
        return merge_candidates(all_scores, all_ids, topk=k, check_nan=check_nan)
    return merge_candidates_reference(all_scores.contiguous(), all_ids.contiguous(), topk=k)
