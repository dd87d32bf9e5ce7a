"""The AFTER hook that puts the plugin's QSA backend in SGLang's hybrid GDN backend."""

from __future__ import annotations

import logging
from typing import Any

from qsa_sglang_plugin._errors import ConfigurationError
from qsa_sglang_plugin._switches import HiSparseMode, current_switches

__all__ = ("after_attn_backend_wrapper",)

logger = logging.getLogger(__name__)


def after_attn_backend_wrapper(
    result: Any, runner: Any, full_attn_backend: Any, *args: object, **kwargs: object
) -> None:
    """AFTER hook on ``attn_backend_wrapper``: the plugin's QSA backend as the full-attention side.

    The offload or sharded backend replaces the hybrid GDN backend's ``full_attn_backend`` and
    ``attn_backend_list[0]``.

    Raises:
        ConfigurationError: a model whose wrapper did not build upstream's
            ``QwenSparseAttnBackend``.
    """
    del full_attn_backend, args, kwargs
    switches = current_switches()
    offload = switches.hisparse is HiSparseMode.P2_OFFLOAD
    if not (offload or switches.resident_sharding):
        return
    from sglang.srt.layers.attention.qwen_sparse_attn_backend import QwenSparseAttnBackend

    from qsa_sglang_plugin._adapters._backends import (
        HiSparseOffloadBackend,
        HiSparseShardedBackend,
    )

    upstream = getattr(result, "full_attn_backend", None)
    if type(upstream) is not QwenSparseAttnBackend:
        what = "p2-offload" if offload else "cache sharding"
        msg = (
            f"{what} needs the hybrid GDN backend with upstream's QwenSparseAttnBackend; "
            f"attn_backend_wrapper built {type(result).__name__} with {type(upstream).__name__}"
        )
        raise ConfigurationError(msg)
    make = HiSparseShardedBackend if switches.resident_sharding else HiSparseOffloadBackend
    backend = make(runner)
    result.full_attn_backend = backend
    result.attn_backend_list[0] = backend
    logger.info("the QSA layers attend through %s", type(backend).__name__)
