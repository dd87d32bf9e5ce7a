"""Double sparsity's price of a token on one rank, as an engine's pool sizing charges it.

The geometry and options give the label rows of a token (their dtype follows the keys':
:meth:`LabelCache.dtype_for`) and, with DS-Offload, the hot-cache slots of one KV head
(:meth:`DSConfig.hot_blocks`); qsa-core's :func:`qsa_core.labelled_capacity` prices them.
:func:`model_label_capacity` reads the geometry from a model's text config and its channel file,
as an engine's doctor does before the engine starts.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qsa_core import CapacityError, LabelledCapacity, QSAProfile, labelled_capacity
from qsa_kernels.double_sparsity._attention import AttentionGeometry
from qsa_kernels.double_sparsity._config import ChannelConfig, DSConfig
from qsa_kernels.double_sparsity._label_cache import LabelCache

__all__ = ("label_capacity", "model_label_capacity")


def label_capacity(
    config: DSConfig,
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    offload: bool = False,
    kv_token_bytes: int | None = None,
    rows: int | None = None,
    context_len: int | None = None,
    verify: bool = False,
) -> LabelledCapacity:
    """:func:`qsa_core.labelled_capacity` of ``config`` over one rank's attention geometry.

    Args:
        config: the double-sparsity options (``heavy_channel_num`` label channels per KV head;
            with ``offload``, :meth:`DSConfig.hot_blocks` hot blocks per KV head).
        layers: attention layers (each carries labels).
        kv_heads: the rank's KV heads.
        head_dim: ``D``.
        kv_dtype: the K/V cache's dtype (the labels' is :meth:`LabelCache.dtype_for` of it).
        offload: DS-Offload: the K/V history in the host arena (its staging area windowed as
            ``config.staging_window`` says).
        kv_token_bytes: the engine's own price of a token's K/V, B; None: from the geometry.
        rows: DS-Offload's request rows; None prices no offload buffers.
        context_len: tokens of one request's context (DS-Offload with ``rows``).
        verify: DS-Offload keeps a resident copy of every row.

    Raises:
        qsa_core.CapacityError: a size qsa-core refuses (DS-Offload with ``rows`` and no
            ``context_len``).
    """
    return labelled_capacity(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        heavy_channels=config.heavy_channel_num,
        kv_element_bytes=kv_dtype.itemsize,
        label_element_bytes=LabelCache.dtype_for(kv_dtype).itemsize,
        kv_token_bytes=kv_token_bytes,
        offload_hot_blocks=config.hot_blocks() if offload else None,
        rows=rows,
        context_len=context_len,
        verify=verify,
        windowed_staging=config.staging_window,
    )


def model_label_capacity(
    text_config: Mapping[str, object],
    config: DSConfig,
    channels: ChannelConfig,
    *,
    tp_size: int = 1,
    kv_dtype: torch.dtype = torch.bfloat16,
    offload: bool = False,
    rows: int | None = None,
    context_len: int | None = None,
    verify: bool = False,
) -> LabelledCapacity:
    """:func:`label_capacity` on TP rank 0 of ``tp_size``, from a GQA model's text config.

    The layers and head dim are :meth:`AttentionGeometry.from_text_config`'s; the rank's KV heads
    those of ``channels`` (the model's channel file, ``[L, Hkv, C]``) that
    :meth:`ChannelConfig.for_tp_rank` gives rank 0, so a file that does not split at ``tp_size``
    is refused here as at start-up. ``context_len`` None is the config's
    ``max_position_embeddings`` (:meth:`qsa_core.QSAProfile.config_context_len`); the other
    arguments are :func:`label_capacity`'s (``kv_dtype`` the K/V cache's, bf16 by default).

    Raises:
        DSConfigError: the config has no GQA geometry, or ``channels`` do not split at
            ``tp_size`` (the message names the sizes).
        qsa_core.CapacityError: a size qsa-core refuses, or DS-Offload with ``rows`` and neither
            ``context_len`` nor an integer ``max_position_embeddings`` (named).
    """
    geometry = AttentionGeometry.from_text_config(text_config)
    kv_heads = int(channels.for_tp_rank(tp_size, 0).channels.shape[1])
    if context_len is None:
        found = QSAProfile.config_context_len(text_config)
        if found is not None and (not isinstance(found, int) or isinstance(found, bool)):
            msg = (
                f"context_len=None and the config's max_position_embeddings={found!r}; "
                "allowed: a positive integer"
            )
            raise CapacityError(msg)
        context_len = found
    return label_capacity(
        config,
        layers=geometry.layers,
        kv_heads=kv_heads,
        head_dim=geometry.head_dim,
        kv_dtype=kv_dtype,
        offload=offload,
        rows=rows,
        context_len=context_len,
        verify=verify,
    )
