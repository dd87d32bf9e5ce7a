"""Double sparsity's price of a token on one rank, as an engine's pool sizing charges it.

The geometry and options give the label rows of a token (their dtype follows the keys':
:meth:`LabelCache.dtype_for`) and, with DS-Offload, the hot-cache slots of one KV head
(:meth:`DSConfig.hot_blocks`); qsa-core's :func:`qsa_core.labelled_capacity` prices them.
"""

from __future__ import annotations

import torch

from qsa_core import LabelledCapacity, labelled_capacity
from qsa_kernels.double_sparsity._config import DSConfig
from qsa_kernels.double_sparsity._label_cache import LabelCache

__all__ = ("label_capacity",)


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
