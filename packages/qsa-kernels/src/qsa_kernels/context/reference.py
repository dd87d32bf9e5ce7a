"""Torch references of the three sparse GQA prefill kernel contracts :class:`PrefillKernels` names.

Each takes what the engine's kernel takes and computes every selected token's softmax in fp32
(host loops: not for CUDA graphs). Query head ``h`` reads KV head ``h // (Hq // Hkv)``; an index
below ``0`` is padding; a row that selects nothing is zero. The output has ``q``'s dtype.
"""

from __future__ import annotations

import torch

__all__ = ("chunk_prefill_reference", "packed_prefill_reference", "slot_attention_reference")


def slot_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """Each query row over the K/V rows it names.

    Args:
        q: ``[T, Hq, D]`` query rows.
        k: ``[S, Hkv, D]`` keys; row ``s`` is slot ``s``.
        v: ``[S, Hkv, D]`` values.
        slots: ``[T, W]`` int32/int64 rows of ``k``/``v`` per query row, ``-1`` padded.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
    rows, hq = q.shape[0], q.shape[1]
    group = hq // k.shape[1]
    out = torch.zeros_like(q)
    for row in range(rows):
        picked = slots[row][slots[row] >= 0].long()
        if picked.numel() == 0:
            continue
        keys = k.index_select(0, picked).float().repeat_interleave(group, dim=1)
        values = v.index_select(0, picked).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[row].float(), keys) * scale
        out[row] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out


def packed_prefill_reference(  # noqa: PLR0917 (the kernel's own order)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    max_len: int,
    indices: torch.Tensor,
    cu_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Packed requests with no prefix, each over its own rows (the no-prefix kernel's contract).

    Args:
        q: ``[N, Hq, D]`` queries of the packed requests.
        k: ``[N, Hkv, D]`` their keys, same rows.
        v: ``[N, Hkv, D]`` their values.
        max_len: the longest request's tokens (the kernel's grid; unused here).
        indices: ``[N, W]`` positions inside each row's own request, ``-1`` padded.
        cu_q: ``[B + 1]`` int32 first row of each request, then ``N``.
        scale: softmax scale.

    Returns:
        ``[N, Hq, D]`` in ``q``'s dtype.
    """
    del max_len
    starts = cu_q[:-1].long()
    owner = torch.repeat_interleave(torch.arange(starts.numel()), (cu_q[1:] - cu_q[:-1]).long())
    base = starts.to(q.device)[owner.to(q.device)].unsqueeze(1)
    slots = torch.where(indices >= 0, indices.long() + base, -1)
    return slot_attention_reference(q, k, v, slots, scale)


def chunk_prefill_reference(  # noqa: PLR0917 (the kernel's own order)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    max_q: int | None = None,
) -> torch.Tensor:
    """Query entries over packed contexts (the chunk-prefill kernel's contract).

    Args:
        q: ``[N, Hq, D]`` query rows, entry ``e`` the rows ``[cu_q[e], cu_q[e + 1])``.
        k: ``[M, Hkv, D]`` keys of the contexts; entry ``e``'s position ``p`` is row
            ``cu_k[e] + p``.
        v: ``[M, Hkv, D]`` values.
        indices: ``[N, W]`` positions in the entry's context, ``-1`` padded.
        cu_q: ``[E + 1]`` int32 query row offsets.
        cu_k: ``[>= E]`` int32 first context row of each entry.
        kv_lens: ``[E]`` int32 each entry's end: its last row's position plus one (its rows end
            there, causal from the bottom right).
        scale: softmax scale.
        max_q: the longest entry's rows (the kernel's grid; unused here).

    Returns:
        ``[N, Hq, D]`` in ``q``'s dtype.
    """
    del kv_lens, max_q
    sizes = (cu_q[1:] - cu_q[:-1]).long().cpu()
    owner = torch.repeat_interleave(torch.arange(sizes.numel()), sizes).to(q.device)
    base = cu_k[: sizes.numel()].long().to(q.device)[owner].unsqueeze(1)
    slots = torch.where(indices >= 0, indices.long() + base, -1)
    return slot_attention_reference(q, k, v, slots, scale)
