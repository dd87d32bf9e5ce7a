"""Torch definition of double-sparsity label scoring and heavy-token selection.

Double Sparsity (arXiv 2408.07092) keeps, per layer and KV head, ``C`` calibrated heavy channels of
the key (the original SGLang options ``--ds-heavy-channel-num``, ``--ds-heavy-token-num``). A label
cache stores ``k[:, h, channels[h]]`` for every token; decode scores every context token with
``q[:, channels] · k_label`` and attends only the ``heavy_token_num`` best tokens. Here a query
head uses the channels of its KV head, and a KV head group's score is the sum over its query heads,
so one selection serves the whole group.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from qsa_kernels._checks import check_dim, check_dtype, check_ndim, check_same_device
from qsa_kernels._errors import KernelInputError
from qsa_kernels._topk_select import row_topk_reference

__all__ = (
    "LabelTopK",
    "fixed_width_lists_reference",
    "label_keys_reference",
    "label_topk_reference",
)


class LabelTopK(NamedTuple):
    """Label scores and the selected heavy tokens.

    Attributes:
        scores: ``[B, Hkv, S]`` fp32 group scores per logical token position, ``-inf`` at
            positions ``>= seq_lens[b]``.
        positions: ``[B, Hkv, heavy_token_num]`` int32 logical token positions, ascending, ``-1``
            padded when ``seq_lens[b] < heavy_token_num``.
    """

    scores: torch.Tensor
    positions: torch.Tensor


def check_label_inputs(  # noqa: PLR0917
    q: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    heavy_token_num: int,
) -> None:
    """Raise :class:`KernelInputError` unless the tensors match the label-scoring contract."""
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        msg = f"q must be [B, Hq, D] bf16/fp16/fp32, got {tuple(q.shape)!r} {q.dtype!r}"
        raise KernelInputError(msg)
    if label_cache.dim() != 3 or label_cache.dtype not in (torch.bfloat16, torch.float16):
        msg = (
            f"label_cache must be [slots, Hkv, C] bf16/fp16, got {tuple(label_cache.shape)!r} "
            f"{label_cache.dtype!r}"
        )
        raise KernelInputError(msg)
    _, hkv, c = label_cache.shape
    if tuple(channels.shape) != (hkv, c) or channels.dtype not in (torch.int32, torch.int64):
        msg = f"channels must be [Hkv={hkv}, C={c}] int32/int64, got {tuple(channels.shape)!r}"
        raise KernelInputError(msg)
    if hkv == 0 or q.shape[1] % hkv != 0:
        msg = f"query heads {q.shape[1]!r} must be a multiple of KV heads {hkv!r}"
        raise KernelInputError(msg)
    batch = q.shape[0]
    if req_to_token.dim() != 2 or req_to_token.shape[0] != batch:
        msg = f"req_to_token must be [B={batch}, S], got {tuple(req_to_token.shape)!r}"
        raise KernelInputError(msg)
    if seq_lens.shape != (batch,) or seq_lens.dtype not in (torch.int32, torch.int64):
        msg = f"seq_lens must be [B={batch}] int32/int64, got {tuple(seq_lens.shape)!r}"
        raise KernelInputError(msg)
    if heavy_token_num < 1:
        msg = f"heavy_token_num must be >= 1, got {heavy_token_num!r}"
        raise KernelInputError(msg)


def label_keys_reference(k: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """Label-cache rows: keys ``[T, Hkv, D]``, channels ``[Hkv, C]`` -> ``[T, Hkv, C]``."""
    index = channels.to(torch.int64).unsqueeze(0).expand(k.shape[0], -1, -1)
    return torch.gather(k, 2, index)


def label_topk_reference(
    q: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    heavy_token_num: int,
) -> LabelTopK:
    """Approximate scores of every context token and the heavy tokens per request and KV group.

    ``score[b, g, t] = sum over query heads h of group g (h // (Hq/Hkv) == g) of
    sum_c q[b, h, channels[g, c]] * label_cache[req_to_token[b, t], g, c]``, products and sums in
    fp32. Selection per ``(b, g)``: top ``heavy_token_num`` positions ``t < seq_lens[b]`` by score,
    ties to the smaller position; all of them when ``seq_lens[b] <= heavy_token_num`` (the dense
    fallback of the original integration).

    Args:
        q: ``[B, Hq, D]`` bf16/fp16/fp32 decode queries.
        label_cache: ``[slots, Hkv, C]`` bf16/fp16 heavy-channel keys.
        channels: ``[Hkv, C]`` int32/int64 heavy channel indices into ``D`` for this layer.
        req_to_token: ``[B, S]`` int32/int64 slot of each logical position.
        seq_lens: ``[B]`` int32/int64 context length in tokens (``<= S``).
        heavy_token_num: tokens to keep per request and KV head.

    Returns:
        :class:`LabelTopK` with ``scores [B, Hkv, S]`` and ``positions [B, Hkv, heavy_token_num]``.
    """
    check_label_inputs(q, label_cache, channels, req_to_token, seq_lens, heavy_token_num)
    batch, hq, _ = q.shape
    _, hkv, _ = label_cache.shape
    group = hq // hkv
    width = req_to_token.shape[1]
    scores = torch.full((batch, hkv, width), -math.inf, dtype=torch.float32, device=q.device)
    ch = channels.to(torch.int64)
    for b in range(batch):
        n = max(0, min(int(seq_lens[b]), width))
        slots = req_to_token[b, :n].to(torch.int64)
        labels = label_cache[slots].float()  # [n, Hkv, C]
        for g in range(hkv):
            q_label = q[b, g * group : (g + 1) * group][:, ch[g]].float()  # [G, C]
            scores[b, g, :n] = (q_label @ labels[:, g, :].T).sum(0)
    lengths = seq_lens.to(torch.int64).clamp(0, width).repeat_interleave(hkv)
    positions = row_topk_reference(scores.view(batch * hkv, width), lengths, heavy_token_num)
    return LabelTopK(scores, positions.view(batch, hkv, heavy_token_num))


def check_fixed_width_args(
    chosen: torch.Tensor, seq_lens: torch.Tensor, width: int, threshold: int
) -> None:
    """Validate a fixed-width lists call (no device sync)."""
    check_ndim("chosen", chosen, 3, "[B, Hkv, heavy]")
    check_dtype("chosen", chosen, (torch.int32,))
    check_ndim("seq_lens", seq_lens, 1, "[B]")
    check_dtype("seq_lens", seq_lens, (torch.int32, torch.int64))
    check_dim("seq_lens", seq_lens, 0, chosen.shape[0], "B of chosen")
    check_same_device(chosen.device, seq_lens=seq_lens)
    if width < chosen.shape[2]:
        msg = f"width={width!r} is not allowed; allowed: at least heavy={chosen.shape[2]!r}"
        raise KernelInputError(msg)
    if threshold < 0:
        msg = f"threshold={threshold!r} is not allowed; allowed: >= 0"
        raise KernelInputError(msg)


def fixed_width_lists_reference(
    chosen: torch.Tensor, seq_lens: torch.Tensor, *, width: int, threshold: int
) -> torch.Tensor:
    """Every row's token list at one width: a sparse row's heavy tokens, a dense row's context.

    A row is sparse when ``seq_len >= threshold`` and ``seq_len > heavy`` (``DSConfig``'s
    ``sparse_decode_threshold`` and ``heavy_token_num``); it lists ``chosen``, a dense row
    ``0 .. seq_len - 1``; both ``-1`` padded to ``width``.

    Args:
        chosen: ``[B, Hkv, heavy]`` int32 heavy-token positions (``label_topk``'s).
        seq_lens: ``[B]`` int32/int64 device context lengths.
        width: the lists' width, at least ``heavy``.
        threshold: the sparse-decode threshold.

    Returns:
        ``[B, Hkv, width]`` int32 positions.
    """
    check_fixed_width_args(chosen, seq_lens, width, threshold)
    heavy = int(chosen.shape[2])
    lengths = seq_lens.view(-1, 1, 1)
    ramp = torch.arange(width, dtype=torch.int32, device=chosen.device)
    dense_lists = torch.where(ramp < lengths, ramp, -1)  # [B, 1, W]
    sparse_lists = torch.nn.functional.pad(chosen, (0, width - heavy), value=-1)
    sparse = (lengths >= threshold) & (lengths > heavy)
    return torch.where(sparse, sparse_lists, dense_lists).to(torch.int32).contiguous()
