"""The attention layers' K/V pool when the plugin holds their K/V: slots, one page of storage.

With ``p2-offload`` (QSA) or DS-Offload (``SGLANG_QSA_DS_OFFLOAD=1``) the K/V history of the
attention layers lives in pinned host memory, one prompt's staging area, the hot caches and the
open-block tails (:mod:`._offload`); with cache sharding and no offload, in each TP rank's share
of the sharded store (:mod:`._sharded_kv`). SGLang still allocates a token slot per token, and
what else it keys by slot stays as upstream: the QSA compressed index (``slot // 4``) and the
double-sparsity label cache. Its MHA pool class, which SGLang resolves once per model runner
(``KVCacheConfigurator._resolve_kv_pool_class(kind="mha")``, also the full-KV leaf of the QSA
pool), becomes :func:`no_storage_pool_class`: the same pool with only its padding page
allocated. One AFTER hook on that resolution serves both offloads and the sharded store.
"""

from __future__ import annotations

import functools
from typing import Any

from qsa_sglang_plugin._errors import ConfigurationError, OffloadRuntimeError
from qsa_sglang_plugin._switches import current_switches

__all__ = ("after_resolve_kv_pool_class", "no_storage_pool_class")

#: The pool kind whose class the plugin replaces (SGLang's ``KVPoolKind``).
_MHA: str = "mha"


@functools.cache
def no_storage_pool_class() -> type[Any]:
    """An ``MHATokenToKVPool`` that allocates one page per layer, whatever its size."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    class NoRawKVPool(MHATokenToKVPool):  # type: ignore[misc]
        """The attention layers' K/V pool when the plugin holds the K/V: slots without storage.

        SGLang's allocator still hands out a slot per token (the QSA compressed index is
        addressed by ``slot // 4``, the double-sparsity labels by the slot itself); the K/V
        lives in the staging area, the hot caches, the tails and the host arena, or in the
        sharded store, so the buffers hold only the padding page.
        """

        def _create_buffers(self) -> None:
            size: int = self.size  # type: ignore[has-type]
            self.size = 0  # the buffers get the padding page only
            try:
                super()._create_buffers()
            finally:
                self.size = size

        def set_kv_buffer(self, *args: Any, **kwargs: Any) -> None:
            del args, kwargs
            msg = "the plugin holds the attention layers' K/V; nothing may write SGLang's K/V pool"
            raise OffloadRuntimeError(msg)

        def move_kv_cache(self, tgt_loc: Any, src_loc: Any) -> None:
            # SGLang moves slots for speculative decoding and pool compaction; the plugin's
            # stores are addressed by request rows or owned slots, which such a move would
            # leave behind. Start-up refuses speculative decoding; anything else stops here.
            del tgt_loc, src_loc
            msg = (
                "the plugin holds the attention layers' K/V; SGLang's K/V pool cannot move "
                "slots (speculative decoding and pool compaction are not supported)"
            )
            raise OffloadRuntimeError(msg)

    return NoRawKVPool


def after_resolve_kv_pool_class(
    result: type, configurator: Any, *args: object, kind: str, default: type, **kwargs: object
) -> type | None:
    """AFTER hook on ``KVCacheConfigurator._resolve_kv_pool_class``: the one-page MHA pool.

    Returns:
        :func:`no_storage_pool_class` for the MHA kind when an offload or cache sharding is on;
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
    return no_storage_pool_class()
