"""Prefill attention over one request's context, or over packed no-prefix chunks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from qsa_kernels._path import KernelPath
from qsa_kernels.context.reference import (
    chunk_prefill_reference,
    packed_prefill_reference,
    slot_attention_reference,
)

__all__ = ("PrefillKernels", "ZigzagEntries", "attend_chunks", "attend_context")


class SlotKernel(Protocol):
    """``(q [T, Hq, D], k [S, Hkv, D], v, slots [T, W], scale) -> [T, Hq, D]``."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
        /,
    ) -> torch.Tensor: ...


class PackedKernel(Protocol):
    """``(q [N, Hq, D], k [N, Hkv, D], v, max_len, indices [N, W], cu_q [B + 1], scale)``."""

    def __call__(  # noqa: PLR0917 (the kernel's own order)
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        max_len: int,
        indices: torch.Tensor,
        cu_q: torch.Tensor,
        scale: float,
        /,
    ) -> torch.Tensor: ...


class ChunkKernel(Protocol):
    """``(q, k, v, indices, cu_q [E + 1], cu_k, kv_lens [E], scale, max_q=) -> [N, Hq, D]``."""

    def __call__(  # noqa: PLR0917 (the kernel's own order)
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        indices: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
        /,
        max_q: int | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class PrefillKernels:
    """An engine's sparse GQA prefill kernels (contracts: :mod:`qsa_kernels.context.reference`).

    Attributes:
        slots: each query row over the K/V rows it names
            (:func:`~qsa_kernels.context.slot_attention_reference`); the reference path.
        packed: packed requests with no prefix, each over its own rows
            (:func:`~qsa_kernels.context.packed_prefill_reference`).
        chunk: query entries over packed contexts, causal from each entry's end
            (:func:`~qsa_kernels.context.chunk_prefill_reference`).
    """

    slots: SlotKernel
    packed: PackedKernel
    chunk: ChunkKernel

    @classmethod
    def reference(cls) -> PrefillKernels:
        """The torch references of the three contracts."""
        return cls(slot_attention_reference, packed_prefill_reference, chunk_prefill_reference)


@dataclass(frozen=True, slots=True)
class ZigzagEntries:
    """This rank's zigzag blocks of one request's chunk, as entries of the chunk kernel.

    Under zigzag context parallelism of ``C`` ranks a chunk is cut into ``2C`` blocks and a rank
    holds blocks ``r`` and ``2C - 1 - r``; each is one entry, based at the request's row 0.

    Attributes:
        cu_q: ``[E + 1]`` int32 first query row of each entry, then the rank's row count.
        kv_ends: ``[E]`` int32 each entry's end in the request: its last row's position plus one.
        max_rows: the longest entry's rows.
    """

    cu_q: torch.Tensor
    kv_ends: torch.Tensor
    max_rows: int

    @staticmethod
    def applies(requests: int, seq_lens: Sequence[int], extend_lens: Sequence[int]) -> bool:
        """Whether a context-parallel extend batch attends by this rank's zigzag rows.

        Only one request whose chunk is its whole prompt (no prefix: its first ``seq_lens`` equals
        its first ``extend_lens``) does; any other batch is gathered into token order and
        attended as without context parallelism.
        """
        return requests == 1 and list(seq_lens[:1]) == list(extend_lens[:1])


def attend_context(  # noqa: PLR0917 (the attention call's own order)
    q: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    kernels: PrefillKernels,
    *,
    zigzag: ZigzagEntries | None = None,
    path: KernelPath = KernelPath.AUTO,
) -> torch.Tensor:
    """Prefill rows of one request over its context.

    On the reference path (:attr:`KernelPath.AUTO` on CPU) each row reads the positions it
    selected inside the context (``slot = position``); otherwise the chunk kernel runs, one entry
    for the context's last ``T`` rows, or one per zigzag block.

    Args:
        q: ``[T, Hq, D]`` query rows. Without ``zigzag`` they are the context's last ``T``
            tokens; with it, this rank's zigzag blocks of the chunk, in that order.
        context_k: ``[S, Hkv, D]`` keys of the request's first ``S`` tokens, row ``t`` token
            ``t`` (an offload's staging area, or a whole prompt gathered over CP ranks).
        context_v: its values.
        indices: ``[T, W]`` the indexer's selection per row: token positions, ``-1`` padded.
        scale: softmax scale.
        kernels: the engine's prefill kernels.
        zigzag: this rank's zigzag entries, or None.
        path: the reference or the engine's kernels (AUTO: the kernels on CUDA).

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
    tokens = int(context_k.shape[0])
    if path.resolve(q.device) is KernelPath.REFERENCE:
        inside = (indices >= 0) & (indices < tokens)
        slots = torch.where(inside, indices, -1).to(torch.int32)
        return kernels.slots(q, context_k, context_v, slots, scale)
    topk = indices.to(torch.int32).contiguous()
    if zigzag is None:  # one entry: the last T rows, causal from the bottom right
        device = q.device
        cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        ends = torch.tensor([tokens], dtype=torch.int32, device=device)
        max_q = None
    else:  # one entry per zigzag block; the kernel reads cu_k[e] as the request's base row
        cu_q = zigzag.cu_q
        cu_k = torch.zeros(2, dtype=torch.int32, device=q.device)
        ends = zigzag.kv_ends
        max_q = zigzag.max_rows
    return kernels.chunk(
        q.contiguous(),
        context_k.to(q.dtype),
        context_v.to(q.dtype),
        topk,
        cu_q,
        cu_k,
        ends,
        scale,
        max_q=max_q,
    )


def attend_chunks(  # noqa: PLR0917 (the attention call's own order)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    extend_lens: Sequence[int],
    scale: float,
    kernels: PrefillKernels,
    *,
    path: KernelPath = KernelPath.AUTO,
) -> torch.Tensor:
    """Packed prefill chunks with no prefix: each request's queries over its own chunk.

    Args:
        q: ``[T, Hq, D]`` query rows of the packed requests.
        k: ``[>= T, Hkv * D]`` (or ``[>= T, Hkv, D]``) their keys; the first ``T`` rows are read.
        v: their values, shaped like ``k``.
        indices: ``[T, W]`` token positions inside each row's request, ``-1`` padded.
        extend_lens: each request's tokens (its whole prompt), summing to ``T``.
        scale: softmax scale.
        kernels: the engine's prefill kernels.
        path: the reference or the engine's kernels (AUTO: the kernels on CUDA).

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
    tokens, d = q.shape[0], q.shape[2]
    k = k[:tokens].reshape(tokens, -1, d)
    v = v[:tokens].reshape(tokens, -1, d)
    device = q.device
    lens = torch.tensor(list(extend_lens), device=device)
    starts = torch.tensor([0, *extend_lens], device=device).cumsum(0)[:-1]
    if path.resolve(device) is KernelPath.REFERENCE:
        owner = torch.repeat_interleave(torch.arange(len(extend_lens), device=device), lens)
        inside = (indices >= 0) & (indices < lens[owner].unsqueeze(1))
        slots = torch.where(inside, indices + starts[owner].unsqueeze(1), -1).to(torch.int32)
        return kernels.slots(q, k, v, slots, scale)
    cu_q = torch.nn.functional.pad(starts.new_tensor(list(extend_lens)).cumsum(0), (1, 0))
    return kernels.packed(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        max(extend_lens, default=1),
        indices.to(torch.int32).contiguous(),
        cu_q.to(torch.int32),
        scale,
    )
