"""The ``qsa_hisparse`` radix-cache backend's factory (SGLang's radix-cache registry)."""

from __future__ import annotations

from typing import Any

from qsa_sglang_plugin._adapters._offload import runtime_of
from qsa_sglang_plugin._adapters._prefix import build_prefix_cache
from qsa_sglang_plugin._switches import current_switches

__all__ = ("radix_cache_factory",)


def radix_cache_factory(ctx: Any) -> Any:
    """:class:`._tree_cache.HiSparseRadixCache` of one scheduler, its offload and prefix cache."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from qsa_sglang_plugin._adapters._tree_cache import HiSparseRadixCache

    cache = create_unified_radix_cache(ctx, cache_class=HiSparseRadixCache)
    switches = current_switches()
    if switches.offload:  # p2-offload or DS-Offload: one runtime per model runner
        runtime = runtime_of(ctx.tp_worker.model_runner)
        cache.use_offload(runtime)
        if switches.prefix_cache_mb > 0:  # p2-offload only (the switches refuse it otherwise)
            prefix = build_prefix_cache(
                ctx,
                cache,
                runtime,
                budget_bytes=switches.prefix_cache_bytes,
                max_entries=switches.prefix_cache_max_entries,
                store=switches.prefix_cache_store,
                admission=switches.prefix_cache_admission,
                index_sharded=switches.index_sharding,
            )
            cache.use_prefix_cache(prefix)
    return cache
