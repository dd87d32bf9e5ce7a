"""The price of a token in SGLang's pool sizing, under each feature that changes it.

One AFTER hook on ``DefaultPoolConfigurator.__init__`` (SGLang has no registry for pool sizing):
with ``p2-offload`` a token costs its compressed index only and the offload's device buffers are
fixed overhead (:func:`._offload.price_offloaded_pool`); with cache sharding and no offload its
index and ``1 / N`` of its raw K/V (:func:`._sharded_kv.price_sharded_pool`); with double sparsity
a token also costs its label rows (:func:`._double_sparsity.price_label_cache`). The switches
turn on at most one of them.
"""

from __future__ import annotations

from typing import Any

from qsa_sglang_plugin._switches import HiSparseMode, current_switches

__all__ = ("after_pool_configurator_init",)


def after_pool_configurator_init(
    result: object, configurator: Any, kvc: Any, *args: object, **kwargs: object
) -> None:
    """AFTER hook on ``DefaultPoolConfigurator.__init__``: reprice for the requested features."""
    del result, args, kwargs
    switches = current_switches()
    if switches.hisparse is HiSparseMode.P2_OFFLOAD:
        from qsa_sglang_plugin._adapters._offload import price_offloaded_pool

        price_offloaded_pool(configurator, kvc)
    if switches.resident_sharding:
        from qsa_sglang_plugin._adapters._sharded_kv import price_sharded_pool

        price_sharded_pool(configurator, kvc)
    if switches.double_sparsity is not None:
        from qsa_sglang_plugin._adapters._double_sparsity import price_label_cache

        price_label_cache(configurator, kvc, switches.double_sparsity)
