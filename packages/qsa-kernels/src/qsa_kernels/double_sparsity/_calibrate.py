"""Calibration of the heavy channels: which query or key channels carry each head's attention.

Double Sparsity scores a context token with a few channels of the query and key only. Which
channels, per head, comes from a calibration pass over a small text set: the channels whose
activations are largest on average carry most of ``q · k``. :func:`calibrate_channels` runs a
Hugging Face decoder (``model.model.layers[i].self_attn.{q,k}_proj``) over token batches and
ranks every head's channels by

* ``k``: the mean ``|k_c|`` over tokens, one row per KV head;
* ``q``: the mean ``|q_c|``, one row per query head;
* ``qk``: the mean ``|q_c · k_c|`` of each query head with its KV head, one row per query head;

largest first (ties: the smaller channel first). The result is the calibration file format
:meth:`ChannelConfig.load` reads (``{"model.layers.{i}.self_attn.{type}_proj": [[channel, ...],
...]}``); rows per query head are reduced per KV group when loaded, so grouped-query models need
nothing else. The projections' outputs are read before RoPE, as the original calibration did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from qsa_kernels.double_sparsity._config import (
    HeavyChannelType,
    check_attention_shape,
    layer_key,
)
from qsa_kernels.double_sparsity._errors import DSConfigError

__all__ = ("calibrate_channels",)


class _LayerStats:
    """Sums of one layer's per-channel importance and the token count behind them."""

    def __init__(self, rows: int, head_dim: int) -> None:
        self.sums = torch.zeros(rows, head_dim, dtype=torch.float64)
        self.tokens = 0
        self.q: torch.Tensor | None = None
        self.k: torch.Tensor | None = None


def _capture(stats: _LayerStats, name: str) -> Callable[..., None]:
    def hook(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        setattr(stats, name, output.detach().reshape(-1, output.shape[-1]).double().cpu())

    return hook


def _score(
    stats: _LayerStats, channel_type: HeavyChannelType, q_heads: int, kv_heads: int, dim: int
) -> None:
    """Fold the captured projections of one forward pass into the layer's sums."""
    q = None if stats.q is None else stats.q.reshape(-1, q_heads, dim)
    k = None if stats.k is None else stats.k.reshape(-1, kv_heads, dim)
    if channel_type is HeavyChannelType.K:
        assert k is not None
        part, tokens = k.abs().sum(0), k.shape[0]
    elif channel_type is HeavyChannelType.Q:
        assert q is not None
        part, tokens = q.abs().sum(0), q.shape[0]
    else:
        assert q is not None
        assert k is not None
        k_per_q = k.repeat_interleave(q_heads // kv_heads, dim=1)
        part, tokens = (q * k_per_q).abs().sum(0), q.shape[0]
    stats.sums += part
    stats.tokens += tokens
    stats.q = stats.k = None


def calibrate_channels(
    model: torch.nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    channel_type: HeavyChannelType | str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, list[list[int]]]:
    """Rank every attention head's channels over ``batches`` (the calibration file's content).

    Args:
        model: a Hugging Face decoder whose layers are ``model.model.layers`` with
            ``self_attn.q_proj`` and ``self_attn.k_proj`` (Llama, Qwen2/3, Mistral); in eval mode.
        batches: ``[B, T]`` int64 token ids per forward pass (a ``[T]`` tensor is one sequence).
        channel_type: ``"q"``, ``"k"`` or ``"qk"`` (:class:`HeavyChannelType`).
        num_q_heads: query heads per layer.
        num_kv_heads: key/value heads per layer (divides ``num_q_heads``).
        head_dim: channels per head.
        on_batch: called with the number of tokens of each batch once it has run (progress).

    Returns:
        ``{layer_key(i, type): rows}`` for every layer, ``rows`` one list per KV head (``k``) or
        per query head (``q``, ``qk``) of all ``head_dim`` channels, most important first.

    Raises:
        DSConfigError: a bad shape or channel type (:func:`check_attention_shape`), a model
            without that layer layout or without layers, or no tokens at all.
    """
    kind = HeavyChannelType.parse(channel_type)
    check_attention_shape(num_q_heads, num_kv_heads, head_dim)
    try:
        layers = list(model.model.layers)  # type: ignore[union-attr, arg-type]
        projections = [(layer.self_attn.q_proj, layer.self_attn.k_proj) for layer in layers]
    except AttributeError as exc:
        msg = (
            f"{type(model).__name__} has no model.layers[i].self_attn.q_proj/k_proj ({exc}); "
            "allowed: a Hugging Face decoder with that layout (Llama, Qwen2/3, Mistral)"
        )
        raise DSConfigError(msg) from None
    if not layers:
        msg = f"{type(model).__name__} has no layers in model.layers; nothing to calibrate"
        raise DSConfigError(msg)
    rows = num_kv_heads if kind is HeavyChannelType.K else num_q_heads
    stats = [_LayerStats(rows, head_dim) for _ in layers]
    with contextlib.ExitStack() as hooks, torch.no_grad():
        for layer_stats, (q_proj, k_proj) in zip(stats, projections, strict=True):
            if kind is not HeavyChannelType.K:
                hooks.enter_context(_hooked(q_proj, _capture(layer_stats, "q")))
            if kind is not HeavyChannelType.Q:
                hooks.enter_context(_hooked(k_proj, _capture(layer_stats, "k")))
        for batch in batches:
            ids = batch.reshape(1, -1) if batch.dim() == 1 else batch
            model(input_ids=ids)
            for layer_stats in stats:
                _score(layer_stats, kind, num_q_heads, num_kv_heads, head_dim)
            if on_batch is not None:
                on_batch(int(ids.numel()))
    if stats[0].tokens == 0:
        msg = "the calibration saw no tokens; give at least one non-empty batch"
        raise DSConfigError(msg)
    result = {}
    for index, layer_stats in enumerate(stats):
        mean = layer_stats.sums / layer_stats.tokens
        # Largest first; a stable sort of the negated means keeps ties in channel order.
        order = torch.sort(-mean, dim=1, stable=True).indices
        result[layer_key(index, kind)] = [[int(c) for c in row] for row in order.tolist()]
    return result


@contextlib.contextmanager
def _hooked(module: torch.nn.Module, hook: Callable[..., None]) -> Iterator[None]:
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
