"""Double-sparsity decode of one layer: label scores, heavy tokens per KV head, sparse attention."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels.double_sparsity._config import DSConfig
from qsa_kernels.ds_label import (
    LabelTopK,
    fixed_width_lists,
    fixed_width_lists_reference,
    label_topk,
    label_topk_reference,
)
from qsa_kernels.sparse_decode import (
    sparse_decode,
    sparse_decode_reference,
    sparse_decode_split,
    sparse_decode_split_reference,
)

__all__ = (
    "DSDecodeOutput",
    "ds_decode",
    "ds_decode_reference",
    "ds_decode_split",
    "ds_decode_split_reference",
    "ds_heavy_decode_split",
    "ds_heavy_decode_split_reference",
    "ds_positions",
    "ds_positions_fixed",
    "positions_to_slots",
)

_Selector = Callable[..., LabelTopK]


class DSDecodeOutput(NamedTuple):
    """Result of one double-sparsity decode step of one layer.

    Attributes:
        out: ``[B, Hq, D]`` bf16 attention output.
        lse: ``[B, Hq]`` fp32 natural-log log-sum-exp of the attended scores.
        positions: ``[B, Hkv, W]`` int32 logical positions each (row, KV head) attended, ``-1``
            padded; ``W = max(heavy_token_num, longest dense row)``. Sparse rows list their heavy
            tokens in ascending order; dense rows list ``0 .. seq_len - 1``.
    """

    out: torch.Tensor
    lse: torch.Tensor
    positions: torch.Tensor


def _check_lengths(seq_lens: Sequence[int], batch: int, width: int) -> list[int]:
    lengths = [int(n) for n in seq_lens]
    if len(lengths) != batch:
        msg = f"seq_lens has {len(lengths)!r} entries; expected B={batch!r}"
        raise KernelInputError(msg)
    for b, n in enumerate(lengths):
        if not 1 <= n <= width:
            msg = (
                f"seq_lens[{b}]={n!r} is not allowed; allowed: [1, {width!r}] (req_to_token width)"
            )
            raise KernelInputError(msg)
    return lengths


def ds_positions(
    q: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    config: DSConfig,
    reference: bool = False,
) -> torch.Tensor:
    """Logical positions each (row, KV head) attends under double sparsity.

    A row is dense (attends ``0 .. seq_len - 1`` with every KV head) when
    ``config.is_dense(seq_len)``: its context is shorter than ``sparse_decode_threshold`` or fits in
    ``heavy_token_num``. Other rows keep the ``heavy_token_num`` best tokens per KV head by the
    label score of :func:`qsa_kernels.ds_label.label_topk_reference`. The decision is per row (the
    original integration decided per batch, so a short request turned its batch-mates dense).

    Args:
        q: ``[B, Hq, D]`` bf16 queries.
        label_cache: ``[slots, Hkv, C]`` bf16/fp16 label rows (``LabelCache.layer(l)``).
        channels: ``[Hkv, C]`` int32/int64 heavy channels of this layer.
        req_to_token: ``[B, S]`` int32/int64 slot of each logical position in ``label_cache``.
        seq_lens: ``B`` host ints, context lengths in tokens, ``1 <= seq_len <= S``.
        config: the double-sparsity options.
        reference: select with the torch reference instead of the Triton kernel.

    Returns:
        ``[B, Hkv, W]`` int32 positions, ``-1`` padded (see :class:`DSDecodeOutput`).
    """
    batch = q.shape[0]
    hkv = label_cache.shape[1]
    lengths = _check_lengths(seq_lens, batch, req_to_token.shape[1])
    heavy = config.heavy_token_num
    dense = [config.is_dense(n) for n in lengths]
    width = max([heavy] + [n for n, d in zip(lengths, dense, strict=True) if d])
    positions = torch.full((batch, hkv, width), -1, dtype=torch.int32, device=q.device)
    sparse_rows = [b for b, d in enumerate(dense) if not d]
    if sparse_rows:
        idx = torch.tensor(sparse_rows, dtype=torch.long, device=q.device)
        span = max(lengths[b] for b in sparse_rows)
        select: _Selector = label_topk_reference if reference else label_topk
        chosen = select(
            q.index_select(0, idx).contiguous(),
            label_cache,
            channels,
            req_to_token.index_select(0, idx)[:, :span].contiguous(),
            torch.tensor([lengths[b] for b in sparse_rows], dtype=torch.int32, device=q.device),
            heavy_token_num=heavy,
        ).positions
        positions[idx, :, :heavy] = chosen.to(torch.int32)
    dense_rows = [b for b, d in enumerate(dense) if d]
    if dense_rows:
        # One fill for every dense row: position t where t < seq_len, else the -1 padding.
        ramp = torch.arange(width, dtype=torch.int32, device=q.device)
        dense_lens = torch.tensor(
            [lengths[b] for b in dense_rows], dtype=torch.int32, device=q.device
        )
        filled = torch.where(ramp < dense_lens[:, None], ramp, -1)
        idx = torch.tensor(dense_rows, dtype=torch.long, device=q.device)
        positions[idx] = filled[:, None, :].expand(-1, hkv, -1)
    return positions


def ds_positions_fixed(
    q: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    config: DSConfig,
    reference: bool = False,
) -> torch.Tensor:
    """:func:`ds_positions` with the lengths on the device and a fixed width: CUDA-graph safe.

    No host input and fixed shapes: heavy tokens are scored over the whole ``req_to_token``
    width (tiles past a row's length skipped), and every row's list is ``config.fixed_width()``
    long, so one captured step serves every replay. Each row is dense or sparse as in
    :func:`ds_positions` (:meth:`DSConfig.sparse_rows`, on the device), and the result equals
    :func:`ds_positions`' padded with ``-1`` to the fixed width. A slot table narrower than the
    fixed width holds only rows that are dense (``seq_len <= S < max(threshold - 1, heavy)``):
    no token is scored then.

    Args:
        q: ``[B, Hq, D]`` bf16 queries.
        label_cache: ``[slots, Hkv, C]`` bf16/fp16 label rows.
        channels: ``[Hkv, C]`` int32/int64 heavy channels of this layer.
        req_to_token: ``[B, S]`` int32/int64 slot of each logical position in ``label_cache``,
            at least every row's length.
        seq_lens: ``[B]`` int32/int64 device context lengths, ``1 <= seq_len <= S``.
        config: the double-sparsity options.
        reference: select with the torch reference instead of the Triton kernel.

    Returns:
        ``[B, Hkv, config.fixed_width()]`` int32 positions, ``-1`` padded.
    """
    width = config.fixed_width()
    lengths = seq_lens.to(torch.int32)
    if req_to_token.shape[1] < width:  # every row is dense (the shape is fixed per capture)
        ramp = torch.arange(width, dtype=torch.int32, device=q.device)
        dense_lists = torch.where(ramp < lengths.view(-1, 1, 1), ramp, -1)  # [B, 1, W]
        return dense_lists.expand(-1, label_cache.shape[1], -1).contiguous()
    heavy = config.heavy_token_num
    select: _Selector = label_topk_reference if reference else label_topk
    chosen = select(
        q, label_cache, channels, req_to_token, lengths, heavy_token_num=heavy
    ).positions.to(torch.int32)
    lists = fixed_width_lists_reference if reference else fixed_width_lists
    return lists(chosen, seq_lens, width=width, threshold=config.sparse_decode_threshold)


def positions_to_slots(positions: torch.Tensor, req_to_token: torch.Tensor) -> torch.Tensor:
    """Map ``[B, Hkv, W]`` logical positions to int32 token slots through ``req_to_token [B, S]``.

    ``-1`` stays ``-1``.
    """
    batch, hkv, width = positions.shape
    flat = positions.reshape(batch, hkv * width).clamp_min(0).to(torch.int64)
    slots = torch.gather(req_to_token.to(torch.int64), 1, flat).view(batch, hkv, width)
    return torch.where(positions >= 0, slots, -1).to(torch.int32).contiguous()


#: ``(q [B, Hq, D], token_slots [B, Hkv, W]) -> (out, lse)``: attention over one K/V layout.
_Attend = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _decode(  # noqa: PLR0917
    q: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: Sequence[int],
    attend: _Attend,
    *,
    config: DSConfig,
    reference: bool,
) -> DSDecodeOutput:
    """Select (kernel, or the torch reference if ``reference``), map to token slots, attend."""
    positions = ds_positions(
        q, label_cache, channels, req_to_token, seq_lens, config=config, reference=reference
    )
    out, lse = attend(q, positions_to_slots(positions, req_to_token))
    return DSDecodeOutput(out, lse, positions)


def ds_decode(  # noqa: PLR0917
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    config: DSConfig,
    scale: float | None = None,
) -> DSDecodeOutput:
    """Double-sparsity decode of one layer over a resident K/V store.

    Selects positions with :func:`ds_positions`, maps them to token slots through ``req_to_token``
    and attends exactly over each (row, KV head)'s own tokens with
    :func:`qsa_kernels.sparse_decode.sparse_decode` given ``[B, Hkv, T]`` lists (one launch for all
    heads).

    Args:
        q: ``[B, Hq, D]`` bf16 queries.
        kv_cache: ``[NS, 2, 4, Hkv, D]`` FP8 E4M3 / bf16 records; token slot ``4 * record + j``.
        label_cache: ``[4 * NS, Hkv, C]`` bf16/fp16 label rows indexed by the same token slot.
        channels: ``[Hkv, C]`` int32/int64 heavy channels of this layer.
        req_to_token: ``[B, S]`` int32/int64 token slot of each logical position.
        seq_lens: ``B`` host ints, context lengths in tokens, ``1 <= seq_len <= S``.
        config: the double-sparsity options.
        scale: softmax scale, ``1 / sqrt(D)`` if ``None``.

    Returns:
        :class:`DSDecodeOutput`.

    Raises:
        KernelInputError: On a ``seq_lens`` entry outside ``[1, S]``, a wrong count of them, or a
            bad shape, dtype or device of the tensors.
    """
    return _decode(
        q,
        label_cache,
        channels,
        req_to_token,
        seq_lens,
        lambda q, slots: sparse_decode(q, slots, kv_cache, scale=scale),
        config=config,
        reference=False,
    )


def ds_decode_reference(  # noqa: PLR0917
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    config: DSConfig,
    scale: float | None = None,
) -> DSDecodeOutput:
    """Torch reference of :func:`ds_decode` (reference selection, gather, fp32 attention)."""
    return _decode(
        q,
        label_cache,
        channels,
        req_to_token,
        seq_lens,
        lambda q, slots: sparse_decode_reference(q, slots, kv_cache, scale=scale),
        config=config,
        reference=True,
    )


def ds_decode_split(  # noqa: PLR0917
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    config: DSConfig,
    scale: float | None = None,
) -> DSDecodeOutput:
    """Double-sparsity decode of one layer over a pool that keeps K and V apart.

    SGLang's MHA pool: one ``[N, Hkv, D]`` key buffer and one value buffer per layer, and a label
    cache indexed by the same token slots (``LabelCache(channels, rows=1, max_tokens=N)``, written
    with :meth:`LabelCache.write_slots`), so one ``req_to_token`` maps positions for all three.
    Selection as :func:`ds_positions` (the label kernel); attention with
    :func:`qsa_kernels.sparse_decode.sparse_decode_split`, reading the buffers in place.

    Args:
        q: ``[B, Hq, D]`` bf16 queries; ``D`` a power of two >= 16.
        k_buffer: ``[N, Hkv, D]`` keys of every token slot (bf16/fp16/FP8 E4M3).
        v_buffer: ``[N, Hkv, D]`` values, same shape and dtype.
        label_cache: ``[N, Hkv, C]`` label rows by token slot.
        channels: ``[Hkv, C]`` int32/int64 heavy channels of this layer.
        req_to_token: ``[B, S]`` int32/int64 token slot of each logical position.
        seq_lens: ``B`` host ints, ``1 <= seq_len <= S``.
        config: the double-sparsity options.
        scale: softmax scale, ``1 / sqrt(D)`` if ``None``.

    Returns:
        :class:`DSDecodeOutput`.

    Raises:
        KernelInputError: On a ``seq_lens`` entry outside ``[1, S]``, a wrong count of them, or a
            bad shape, dtype or device of the tensors.
    """
    return _decode(
        q,
        label_cache,
        channels,
        req_to_token,
        seq_lens,
        lambda q, slots: sparse_decode_split(q, slots, k_buffer, v_buffer, scale=scale),
        config=config,
        reference=False,
    )


def ds_decode_split_reference(  # noqa: PLR0917
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    config: DSConfig,
    scale: float | None = None,
) -> DSDecodeOutput:
    """Torch reference of :func:`ds_decode_split` (reference selection, gather, fp32 attention)."""
    return _decode(
        q,
        label_cache,
        channels,
        req_to_token,
        seq_lens,
        lambda q, slots: sparse_decode_split_reference(q, slots, k_buffer, v_buffer, scale=scale),
        config=config,
        reference=True,
    )


def _heavy_decode_split(  # noqa: PLR0917
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    heavy_token_num: int,
    scale: float | None,
    reference: bool,
) -> DSDecodeOutput:
    select: _Selector = label_topk_reference if reference else label_topk
    attend = sparse_decode_split_reference if reference else sparse_decode_split
    positions = select(
        q, label_cache, channels, req_to_token, seq_lens, heavy_token_num=heavy_token_num
    ).positions
    slots = positions_to_slots(positions, req_to_token)
    out, lse = attend(q, slots, k_buffer, v_buffer, scale=scale)
    return DSDecodeOutput(out, lse, positions)


def ds_heavy_decode_split(  # noqa: PLR0917
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    heavy_token_num: int,
    scale: float | None = None,
) -> DSDecodeOutput:
    """Every row attends its heavy tokens, with the lengths on the device: CUDA-graph capturable.

    :func:`ds_decode_split` decides per row on the host which rows are dense and sizes its work by
    the longest; this one has no host input and fixed shapes (``[B, Hkv, heavy_token_num]`` lists
    over the whole ``req_to_token`` width, tiles past a row's length skipped), so one captured step
    serves every replay. A row of at most ``heavy_token_num`` tokens attends all of them, so it
    is dense; a caller that wants a longer row dense (below ``sparse_decode_threshold``) takes
    that row's output from the dense backend.

    Args:
        q: ``[B, Hq, D]`` bf16 queries; ``D`` a power of two >= 16.
        k_buffer: ``[N, Hkv, D]`` keys of every token slot.
        v_buffer: ``[N, Hkv, D]`` values, same shape and dtype.
        label_cache: ``[N, Hkv, C]`` label rows by token slot.
        channels: ``[Hkv, C]`` int32/int64 heavy channels of this layer.
        req_to_token: ``[B, S]`` int32/int64 token slot of each logical position.
        seq_lens: ``[B]`` int32/int64 device context lengths (clamped to ``[0, S]``).
        heavy_token_num: tokens kept per row and KV head, ``>= 1``.
        scale: softmax scale, ``1 / sqrt(D)`` if ``None``.

    Returns:
        :class:`DSDecodeOutput` with ``[B, Hkv, heavy_token_num]`` positions.
    """
    return _heavy_decode_split(
        q,
        k_buffer,
        v_buffer,
        label_cache,
        channels,
        req_to_token,
        seq_lens,
        heavy_token_num=heavy_token_num,
        scale=scale,
        reference=False,
    )


def ds_heavy_decode_split_reference(  # noqa: PLR0917
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    label_cache: torch.Tensor,
    channels: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    heavy_token_num: int,
    scale: float | None = None,
) -> DSDecodeOutput:
    """Torch reference of :func:`ds_heavy_decode_split`."""
    return _heavy_decode_split(
        q,
        k_buffer,
        v_buffer,
        label_cache,
        channels,
        req_to_token,
        seq_lens,
        heavy_token_num=heavy_token_num,
        scale=scale,
        reference=True,
    )
