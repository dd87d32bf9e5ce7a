"""SGLang's MHA pool class becomes :class:`._pool.NoRawKVPool` when the plugin holds the K/V.

With an offload (:mod:`._offload`) or cache sharding (:mod:`._sharded_kv`) SGLang still hands
out a slot per token (the compressed index and the labels are keyed by slot); the pool keeps
only its padding page. One AFTER hook on ``KVCacheConfigurator._resolve_kv_pool_class``.
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
    """AFTER hook: :class:`._pool.NoRawKVPool` for the MHA kind (None: SGLang's stands).

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
