"""Owner-side sparse attention: each rank attends over the selected tokens it stores.

The selected blocks expand to token positions (plus the incomplete-group tail), the positions map
through the request's slot table to logical raw slots, and each rank keeps the slots it owns as
local slots, compacted to the front of each row (:func:`compact_owned_slots`) so the attention
kernel runs over a width that shrinks with ``N`` instead of the full ``4 * topk + 3``. Each rank
computes a partial ``(out, lse)`` over its tokens; the partials (fp32, packed ``[..., D + 1]`` with
the LSE last) cross the group in one collective and are combined by
:func:`qsa_kernels.lse_merge.lse_merge` in fp32. The owned token sets are disjoint and cover the
selection, so the merge equals single-rank attention over the whole selection.
"""

from __future__ import annotations

import logging

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels.expand import expand_blocks, expand_blocks_reference
from qsa_kernels.lse_merge import lse_merge, lse_merge_reference
from qsa_kernels.sharded._buffers import HeadLayout, ShardedDecodeBuffers
from qsa_kernels.sharded._group import KernelPath, ShardGroup, all_gather_flat, all_to_all_flat
from qsa_kernels.sharded._layout import compact_owned_slots
from qsa_kernels.sparse_decode import gather_selected_kv, sparse_decode

__all__ = (
    "gather_group_queries",
    "merge_owner_partials",
    "owner_sparse_decode",
    "owner_sparse_prefill",
    "partial_attention_reference",
)

logger = logging.getLogger(__name__)


def partial_attention_reference(
    q: torch.Tensor, token_slots: torch.Tensor, kv_cache: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the valid token slots, kept in fp32 (the partial of one owner).

    Same math as :func:`qsa_kernels.sparse_decode.sparse_decode_reference` without the final bf16
    cast.

    Args:
        q: ``[B, Hq, D]`` bf16.
        token_slots: ``[B, T]`` int32 local token slots, ``-1`` padding anywhere.
        kv_cache: ``[NS, 2, 4, Hkv, D]`` bf16/fp8 local K/V.
        scale: softmax scale.

    Returns:
        ``(out [B, Hq, D] fp32, lse [B, Hq] fp32)``; an empty row gives ``(0, -inf)``.
    """
    batch, hq, d = q.shape
    hkv = kv_cache.shape[3]
    k, v, valid = gather_selected_kv(token_slots, kv_cache)
    qg = q.float().view(batch, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bhtd->bhgt", qg, k.float()) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isneginf(lse), 0.0, lse)
    probs = torch.exp(scores - finite.unsqueeze(-1))
    out = torch.einsum("bhgt,bhtd->bhgd", probs, v.float())
    return out.reshape(batch, hq, d), lse.reshape(batch, hq)


def owner_sparse_decode(
    q: torch.Tensor,
    block_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_table: torch.Tensor,
    local_kv: torch.Tensor,
    *,
    shard: ShardGroup,
    buffers: ShardedDecodeBuffers,
    scale: float | None = None,
    path: KernelPath = KernelPath.AUTO,
    owned_width: int | None = None,
    check_width: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse GQA decode over the selection, each rank reading only the K/V it stores.

    Collectives (``B`` rows, ``Hq`` heads of the KV group, ``N`` ranks): REPLICATED, one
    all-gather of ``B * Hq * (D + 1) * 4`` bytes per rank; SHARDED, one all-gather of ``B * Hq /
    N * D * 2`` bytes of queries, then one all-to-all of ``B * Hq * (D + 1) * 4`` bytes per rank.

    Args:
        q: REPLICATED ``[B, Hq, D]``; SHARDED ``[B, Hq / N, D]`` (this rank's heads ``[rank *
            Hq / N, (rank + 1) * Hq / N)``); bf16, roped.
        block_ids: ``[B, topk]`` int32 selected request-relative block ids (any order), ``-1``
            padding; identical on every rank (:func:`sharded_indexer_topk`).
        seq_lens: ``[B]`` int32/int64 tokens visible to each query (position + 1).
        slot_table: ``[B, >= max seq_len]`` int32/int64 logical raw slot of each position
            (``req_to_token`` rows).
        local_kv: ``[NS_local, 2, 4, Hkv, D]`` this rank's raw K/V shard (:func:`shard_raw_kv`
            layout); ``Hkv`` divides ``Hq``.
        shard: this rank's shard group.
        buffers: static buffers with ``max_rows >= B``, ``topk == block_ids.shape[1]``, and
            ``q_heads == Hq``.
        scale: softmax scale, ``1 / sqrt(D)`` if ``None``.
        path: kernels or references (the kernel's partial is bf16-rounded before the fp32 merge;
            the reference's stays fp32).
        owned_width: token columns ``T`` the local attention runs over, after the owned slots
            are compacted to the front of each row. ``None``: the step's largest owned count
            (exact for any slot table; one host synchronisation to read it, so eager only).
            An int (``owned_token_bound(placement, topk)`` for page-contiguous slot tables, in
            ``1 .. 4 * topk + 3``): a static width, no synchronisation beyond ``check_width``;
            the CUDA-graph setting.
        check_width: with an int ``owned_width``, verify that no row owns more tokens (one
            host synchronisation; raises instead of silently dropping tokens). Pass ``False``
            under graph capture, where the slot-table layout must guarantee the bound.

    Returns:
        ``(out, lse)``: REPLICATED ``[B, Hq, D]`` bf16 and ``[B, Hq]`` fp32 on every rank;
        SHARDED the rank's own heads, ``[B, Hq / N, D]`` and ``[B, Hq / N]``.

    Raises:
        KernelInputError: bad shapes, an ``owned_width`` outside ``1 .. 4 * topk + 3``, or (with
            ``check_width``) a row owning more than ``owned_width`` selected tokens.
    """
    batch, k, d = q.shape[0], buffers.topk, buffers.head_dim
    q_full = gather_group_queries(q, shard=shard, buffers=buffers)  # checks q and the rows
    if block_ids.shape != (batch, k):
        msg = f"block_ids must be [B={batch!r}, topk={k!r}]; got {tuple(block_ids.shape)!r}"
        raise KernelInputError(msg)
    width = 4 * k + 3
    width_obj: object = owned_width
    if owned_width is not None and (
        isinstance(width_obj, bool)
        or not isinstance(width_obj, int)
        or not 1 <= owned_width <= width
    ):
        msg = f"owned_width={owned_width!r} is not allowed; allowed: None or 1..{width!r}"
        raise KernelInputError(msg)
    concrete = path.resolve(q.device)
    sm_scale = d**-0.5 if scale is None else scale
    positions = buffers.positions[: batch * width].view(batch, width)
    if concrete is KernelPath.TRITON:
        expand_blocks(block_ids, seq_lens, ratio=4, token_topk=4 * k, out=positions)
    else:
        positions.copy_(expand_blocks_reference(block_ids, seq_lens, ratio=4, token_topk=4 * k))
    valid = positions >= 0
    slots = torch.gather(slot_table, 1, torch.where(valid, positions, 0).to(torch.int64))
    slots = torch.where(valid, slots, -1)
    local = buffers.local_slots[: batch * width].view(batch, width)
    _, counts = compact_owned_slots(slots, shard.placement, shard.rank, out=local)
    if owned_width is None:
        columns = int(counts.max()) if batch else 0  # the one host synchronisation
    else:
        columns = owned_width
        if check_width and batch and bool((counts > columns).any()):
            msg = (
                f"a row owns {int(counts.max())!r} selected tokens on rank {shard.rank!r}, more "
                f"than owned_width={columns!r}"
            )
            raise KernelInputError(msg)
    logger.debug("rank %d attends over %d of %d token columns", shard.rank, columns, width)
    local = local[:, : max(columns, 1)]
    if concrete is KernelPath.TRITON:
        out_b, lse = sparse_decode(q_full, local, local_kv, scale=sm_scale)
        out = out_b.float()
    else:
        out, lse = partial_attention_reference(q_full, local, local_kv, scale=sm_scale)
    return merge_owner_partials(out, lse, shard=shard, buffers=buffers, path=concrete)


def owner_sparse_prefill(
    q: torch.Tensor,
    block_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_row: torch.Tensor,
    local_kv: torch.Tensor,
    *,
    shard: ShardGroup,
    buffers: ShardedDecodeBuffers,
    scale: float | None = None,
    path: KernelPath = KernelPath.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse GQA prefill of one request's chunk over sharded raw K/V, a prefix included.

    A prefill query at position ``p`` attends what a decode row of length ``p + 1`` attends: its
    selected complete blocks and the tokens of its own open block up to ``p`` (causal). So each
    group of ``buffers.max_rows`` query tokens runs :func:`owner_sparse_decode` with lengths
    ``positions + 1`` over the request's one slot-table row: every rank attends the tokens it owns
    (of the prefix, a restored prefix, or the chunk itself), and the LSE merge gives the
    attention over the whole selection. Every rank of the group calls this with the same ``T``
    (the groups' collectives must pair up). The chunk's own K/V must already be in the owners'
    shards (:func:`write_owned_raw_kv`). Eager: each group reads its owned width on the host.

    Collectives: those of :func:`owner_sparse_decode`, once per group of ``max_rows`` tokens.

    Args:
        q: REPLICATED ``[T, Hq, D]``; SHARDED ``[T, Hq / N, D]``; bf16, roped.
        block_ids: ``[T, topk]`` int32 each query's selected request-relative blocks, ``-1``
            padded; identical on every rank.
        positions: ``[T]`` int32/int64 each query token's position in the request.
        slot_row: ``[S]`` int32/int64 the request's logical raw slot of each position, ``S >
            max(positions)`` (its ``req_to_token`` row).
        local_kv: ``[NS_local, 2, 4, Hkv, D]`` this rank's raw K/V shard.
        shard: this rank's shard group.
        buffers: static buffers with ``topk == block_ids.shape[1]`` and ``q_heads == Hq``; their
            ``max_rows`` sets the group size.
        scale: softmax scale, ``1 / sqrt(D)`` if ``None``.
        path: kernels or references.

    Returns:
        ``(out, lse)`` as :func:`owner_sparse_decode` returns them, ``T`` rows.

    Raises:
        KernelInputError: bad shapes, or a position outside the slot row.
    """
    tokens = q.shape[0]
    if block_ids.dim() != 2 or block_ids.shape[0] != tokens or positions.shape != (tokens,):
        msg = (
            f"block_ids must be [T={tokens!r}, topk] and positions [T]; got "
            f"{tuple(block_ids.shape)!r} and {tuple(positions.shape)!r}"
        )
        raise KernelInputError(msg)
    if slot_row.dim() != 1:
        msg = f"slot_row must be [S]; got {tuple(slot_row.shape)!r}"
        raise KernelInputError(msg)
    if tokens and not 0 <= int(positions.min()) <= int(positions.max()) < slot_row.shape[0]:
        msg = (
            f"positions span [{int(positions.min())!r}, {int(positions.max())!r}]; the slot row "
            f"holds [0, {slot_row.shape[0]!r})"
        )
        raise KernelInputError(msg)
    seq_lens = positions.to(torch.int32) + 1
    outs, lses = [], []
    for start in range(0, tokens, buffers.max_rows):
        rows = slice(start, min(start + buffers.max_rows, tokens))
        count = rows.stop - rows.start
        out, lse = owner_sparse_decode(
            q[rows],
            block_ids[rows],
            seq_lens[rows],
            slot_row.unsqueeze(0).expand(count, -1),
            local_kv,
            shard=shard,
            buffers=buffers,
            scale=scale,
            path=path,
        )
        outs.append(out)
        lses.append(lse)
    if not outs:
        heads = q.shape[1]
        return q.new_empty(0, heads, q.shape[2]), torch.empty(0, heads, device=q.device)
    return torch.cat(outs), torch.cat(lses)


def gather_group_queries(
    q: torch.Tensor, *, shard: ShardGroup, buffers: ShardedDecodeBuffers
) -> torch.Tensor:
    """The queries of every head of the KV group, on every rank: what each owner attends with.

    SHARDED: one all-gather of the ranks' heads through ``buffers.query_send``/``query_recv``;
    REPLICATED: ``q`` itself (every rank holds every head).

    Args:
        q: REPLICATED ``[B, Hq, D]``; SHARDED ``[B, Hq / N, D]``, this rank's heads; bf16.
        shard: this rank's shard group.
        buffers: the static transport buffers (``max_rows >= B``).

    Returns:
        ``[B, Hq, D]`` bf16, heads in rank order (a view of ``buffers.query_recv`` when SHARDED).
    """
    batch = q.shape[0]
    buffers.check_rows(batch)
    n, d, hq = shard.world_size, buffers.head_dim, buffers.q_heads
    sharded = buffers.layout is HeadLayout.SHARDED
    heads_in = hq // n if sharded else hq
    if tuple(q.shape[1:]) != (heads_in, d) or buffers.world_size != n:
        msg = (
            f"q must be [B, {heads_in!r}, {d!r}] for {buffers.layout!r} with world_size={n!r}; "
            f"got {tuple(q.shape)!r} (buffers for world_size={buffers.world_size!r})"
        )
        raise KernelInputError(msg)
    if not sharded:
        return q.contiguous()
    q_words = batch * heads_in * d
    q_send = buffers.query_send[:q_words]
    q_send.view(batch, heads_in, d).copy_(q)
    q_recv = buffers.query_recv[: n * q_words]
    all_gather_flat(shard, q_send, q_recv)
    return q_recv.view(n, batch, heads_in, d).transpose(0, 1).reshape(batch, hq, d)


def merge_owner_partials(
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    shard: ShardGroup,
    buffers: ShardedDecodeBuffers,
    path: KernelPath = KernelPath.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine every owner's partial attention into the attention over the whole selection.

    Each rank attended every head of the KV group over the tokens it owns (disjoint sets that
    cover the selection; a rank owning none contributes ``(0, -inf)``). REPLICATED: one
    all-gather of the packed fp32 partials, every rank merges every head. SHARDED: one all-to-all
    hands each rank the partials of its own heads, which it merges. The merge is fp32
    (:func:`qsa_kernels.lse_merge.lse_merge`), rounded to bf16 once.

    Args:
        out: ``[B, Hq, D]`` this rank's partial output, fp32 (or bf16).
        lse: ``[B, Hq]`` fp32 natural-log LSE of it.
        shard: this rank's shard group.
        buffers: the static transport buffers (``max_rows >= B``).
        path: the merge's kernel or reference.

    Returns:
        REPLICATED ``([B, Hq, D] bf16, [B, Hq] fp32)``; SHARDED this rank's heads, ``[B, Hq / N,
        D]`` and ``[B, Hq / N]``.
    """
    batch = out.shape[0]
    buffers.check_rows(batch)
    n, d, hq = shard.world_size, buffers.head_dim, buffers.q_heads
    if tuple(out.shape) != (batch, hq, d) or tuple(lse.shape) != (batch, hq):
        msg = (
            f"out and lse must be [B, Hq={hq!r}, D={d!r}] and [B, Hq]; got {tuple(out.shape)!r} "
            f"and {tuple(lse.shape)!r}"
        )
        raise KernelInputError(msg)
    sharded = buffers.layout is HeadLayout.SHARDED
    heads_in = hq // n if sharded else hq
    p_words = batch * hq * (d + 1)
    p_send = buffers.partial_send[:p_words]
    if sharded:
        # Destination-major: chunk j holds rank j's heads, [N, B, Hq / N, D + 1].
        packed = p_send.view(n, batch, heads_in, d + 1)
        packed[..., :d] = out.view(batch, n, heads_in, d).transpose(0, 1)
        packed[..., d] = lse.view(batch, n, heads_in).transpose(0, 1)
        p_recv = buffers.partial_recv[:p_words]
        all_to_all_flat(shard, p_send, p_recv)
    else:
        packed = p_send.view(batch, hq, d + 1)
        packed[..., :d] = out
        packed[..., d] = lse
        p_recv = buffers.partial_recv[: n * p_words]
        all_gather_flat(shard, p_send, p_recv)
    parts = p_recv.view(n, batch, heads_in, d + 1)
    merge = lse_merge if path.resolve(out.device) is KernelPath.TRITON else lse_merge_reference
    return merge(parts[..., :d], parts[..., d].contiguous(), out_dtype=torch.bfloat16)
