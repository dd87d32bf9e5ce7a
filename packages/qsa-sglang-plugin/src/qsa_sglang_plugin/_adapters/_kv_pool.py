"""The attention layers' K/V pool when the plugin holds their K/V: slots, one page of storage.

With ``p2-offload`` (QSA) or DS-Offload (``SGLANG_QSA_DS_OFFLOAD=1``) the K/V history of the
attention layers lives in pinned host memory, one prompt's staging area, the hot caches and the
open-block tails (:mod:`._offload`); with cache sharding and no offload, in each TP rank's share
of the sharded store (:mod:`._sharded_kv`). SGLang still allocates a token slot per token, and
what else it keys by slot stays as upstream: the QSA compressed index (``slot // 4``) and the
double-sparsity label cache. Its MHA pool class, which SGLang resolves once per model runner
(``KVCacheConfigurator._resolve_kv_pool_class(kind="mha")``, also the full-KV leaf of the QSA
pool), becomes :class:`._pool.NoRawKVPool`: the same pool with only its padding page
allocated. One AFTER hook on that resolution serves both offloads and the sharded store.
"""

from __future__ import annotations

from typing import Any

from qsa_sglang_plugin._errors import ConfigurationError
from qsa_sglang_plugin._switches import current_switches

__all__ = ("after_resolve_kv_pool_class",)

#: The pool kind whose class the plugin replaces (SGLang's ``KVPoolKind``).
_MHA: str = "mha"


def after_resolve_kv_pool_class(
    result: type, configurator: Any, *args: object, kind: str, default: type, **kwargs: object
) -> type | None:
    """AFTER hook on ``KVCacheConfigurator._resolve_kv_pool_class``: the one-page MHA pool.

    Returns:
        :class:`._pool.NoRawKVPool` for the MHA kind when an offload or cache sharding is on;
        None (SGLang's result stands) otherwise.

    Raises:
        ConfigurationError: a platform that brings its own MHA pool class, or a layout other
            than upstream's plain per-layer pool.
    """
    del configurator, args, default, kwargs
    if kind != _MHA or not current_switches().plugin_holds_raw_kv:
        return None
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if result is not MHATokenToKVPool:  # a platform's own pool, or the page-major layout
        msg = (
            f"SGLang resolved the MHA K/V pool to {result.__name__}; the plugin replaces only "
            f"{MHATokenToKVPool.__name__} (upstream's per-layer layout)"
        )
        raise ConfigurationError(msg)
    from qsa_sglang_plugin._adapters._pool import NoRawKVPool

    return NoRawKVPool
