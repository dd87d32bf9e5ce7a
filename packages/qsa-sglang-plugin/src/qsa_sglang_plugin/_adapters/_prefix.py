"""The host prefix cache inside SGLang: SGLang's requests and pools -> ``qsa_hostcache`` calls.

One :class:`PrefixCacheRuntime` per scheduler (``SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB > 0``, with
``p2-offload``) turns the ``qsa_hisparse`` tree cache's calls (:mod:`._tree_cache`) into
:class:`qsa_hostcache.PromptPools` and :class:`qsa_hostcache.PromptKeys` calls (page extras
from ``qsa_mm_prefix.prompt_page_extras``), which compose the checkpoint. It keeps what is
SGLang's: a ``Req``'s fields, SGLang's pools and token-slot allocator, and the series. The
calls and the checkpoint: ``docs/plugin.md`` ("The host prefix cache").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import torch

from qsa_core import format_bytes
from qsa_hostcache import (
    CacheStats,
    HostPrefixCache,
    PrefixKey,
    PromptCheckpoints,
    PromptCounts,
    PromptKeys,
    PromptPools,
    SharedCheckpoints,
    StateSegments,
    TierStats,
    TokenSlots,
    agree_min,
)
from qsa_mm_prefix import BypassReason, ProcessorFingerprint, prompt_page_extras, spatial_merge_size
from qsa_sglang_plugin._adapters._metrics import CountsMirror, RankMetrics
from qsa_sglang_plugin._adapters._multimodal import engine_processor_fingerprint, sglang_items
from qsa_sglang_plugin._adapters._namespace import cache_namespace_from_sglang
from qsa_sglang_plugin._errors import OffloadRuntimeError, SwitchError
from qsa_sglang_plugin._switches import ENV_PREFIX_CACHE_STORE

if TYPE_CHECKING:
    from qsa_hostcache import CacheNamespace, StoreAddress
    from qsa_kernels.offload import OffloadRuntime

__all__ = ("METRIC_PREFIX", "PrefixCacheRuntime", "build_prefix_cache")

logger = logging.getLogger(__name__)

#: Prefix of the prefix cache's Prometheus series (the library's counters and occupancy).
METRIC_PREFIX: Final = "qsa_hisparse_prefix_cache"


class _Metrics:
    """The cache's own counters and occupancy, mirrored into SGLang's Prometheus registry."""

    def __init__(self, tp_rank: int, tier: str | None) -> None:
        make = RankMetrics(tp_rank)
        self._stats = CountsMirror(make, METRIC_PREFIX, CacheStats.series())
        self._counts = CountsMirror(make, METRIC_PREFIX, PromptCounts.series())
        self._tier = (
            None if tier is None else CountsMirror(make, METRIC_PREFIX, TierStats.series(tier))
        )
        self.bypassed = make.counters_by(
            f"{METRIC_PREFIX}_bypassed",
            "Requests the prefix cache does not key (not matched, not published), by reason.",
            "reason",
            BypassReason,
        )

    def update(self, stats: CacheStats, counts: PromptCounts, tier: TierStats | None) -> None:
        """The cache's, the prompt calls' and the shared tier's counts, as increments."""
        self._stats.update(stats)
        self._counts.update(counts)
        if self._tier is not None and tier is not None:
            self._tier.update(tier)


class PrefixCacheRuntime:
    """The host prefix cache of one scheduler and the SGLang state it checkpoints.

    Args:
        cache, offload: the checkpoints (one host arena); the offload, whose staging area holds
            the prompt being prefilled.
        kv_pool, req_to_token_pool, allocator: SGLang's ``QSATokenToKVPool`` (the compressed
            index keys), ``HybridReqToTokenPool`` (rows; ``mamba_pool``, the recurrent state,
            if any) and token-slot allocator (KV slots for a loaded prefix).
        namespace: this rank's namespace without a request's salt.
        tp_group, tp_rank: SGLang's TP ``GroupCoordinator`` (``None``: one rank); this rank.
        weight_version: the served weights' version now, read before every lookup and publish.
        processor, spatial_merge_size: the image processor's fingerprint (``None``: image
            prompts bypass, ``no-processor``) and the vision tower's patch merge.
        shared: the shared tier below the arena (``SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE``).
    """

    def __init__(
        self,
        cache: HostPrefixCache,
        offload: OffloadRuntime,
        *,
        kv_pool: Any,
        req_to_token_pool: Any,
        allocator: Any,
        namespace: CacheNamespace,
        tp_group: Any = None,
        tp_rank: int = 0,
        weight_version: Callable[[], object] = lambda: None,
        processor: ProcessorFingerprint | None = None,
        spatial_merge_size: int | None = None,
        shared: SharedCheckpoints | None = None,
    ) -> None:
        self.cache = cache
        self.shared = shared
        group = getattr(tp_group, "cpu_group", None)
        checkpoints: PromptCheckpoints[torch.Tensor] = PromptCheckpoints(
            cache,
            agree=agree_min(group if int(getattr(tp_group, "world_size", 1)) > 1 else None),
            weights=weight_version,
            shared=shared,
        )
        self._processor = processor
        self._merge = spatial_merge_size
        self._metrics = _Metrics(tp_rank, None if shared is None else shared.tier.name)
        self._keys: PromptKeys[Any] = PromptKeys(
            cache.page_size,
            self._page_extras,
            request_id=lambda req: req.rid,
            on_bypass=lambda req, reason: self._metrics.bypassed[BypassReason(reason)].inc(),
        )
        self._offload = offload
        self._req_to_token = req_to_token_pool
        self._slots = TokenSlots(allocator.alloc, allocator.free)
        self._namespace = namespace
        self._mamba = getattr(req_to_token_pool, "mamba_pool", None)
        state = None
        if self._mamba is not None:  # the pool's own round-trip structure, read from slot 0
            zero = torch.zeros(1, dtype=torch.int64, device="cpu")
            state = StateSegments(self._mamba.get_cpu_copy(zero))
        self._pools = PromptPools(
            checkpoints,
            kv_pool.qsa_compressed_k_buffer_pool,
            int(kv_pool.qsa_compress_ratio),
            state=state,
        )
        self._sync_metrics()

    # ---- keys ------------------------------------------------------------------------------------

    def key(self, req: Any, tokens: Any) -> PrefixKey:
        """The key of ``tokens`` (``req``'s first token ids) in ``req``'s namespace."""
        namespace = self._namespace.for_request(
            cache_salt=getattr(req, "cache_salt", None),
            lora_id=getattr(req, "lora_id", None),
            extra_key=getattr(req, "extra_key", None),
        )
        return self._keys.key(req, tokens, namespace)

    def _page_extras(self, req: Any) -> Mapping[int, bytes] | BypassReason:
        mm_inputs = getattr(req, "multimodal_inputs", None)
        return prompt_page_extras(
            len(req.origin_input_ids),
            None if mm_inputs is None else sglang_items(mm_inputs),
            processor=self._processor,
            page_size=self.cache.page_size,
            spatial_merge_size=self._merge,
            input_embeds=getattr(req, "input_embeds", None) is not None,
            embed_overrides=getattr(req, "positional_embed_overrides", None) is not None,
            holder=req.rid,
        )

    # ---- SGLang's calls --------------------------------------------------------------------------

    def lookup(self, req: Any, tokens: Any) -> int:
        """Tokens of the longest checkpoint that is a prefix of ``tokens`` (0 on a miss).

        ``tokens``: the ids SGLang matches (at most the prompt less its last token).
        """
        if self._keys.bypass(req) is not None:
            return self._pools.lookup(len(tokens), None)
        hit = self._pools.lookup(len(tokens), lambda: self.key(req, tokens))
        self._sync_metrics()
        return hit

    @property
    def hit_is_shared(self) -> bool:
        """The last :meth:`lookup`'s hit came from the shared tier (not the arena)."""
        return (
            self.shared is not None and self._pools.checkpoints.last_tier == self.shared.tier.name
        )

    def load_back(self, req: Any, tokens: int) -> bool:
        """Load ``req``'s checkpoint of ``tokens`` tokens into new KV slots (``PromptPools.load``).

        False when any rank could not (nothing is held: the request computes its prompt).
        """
        key = self.key(req, req.full_untruncated_fill_ids[:tokens])
        loaded = self._pools.load(req.rid, key, self._slots) is not None
        self._sync_metrics()
        return loaded

    def prefix_slots(self, req: Any) -> torch.Tensor | None:
        """The KV slots of ``req``'s loaded prefix, while it waits for its row."""
        return self._pools.checkpoints.claimed(req.rid)

    def restore_row(self, req: Any, row: int) -> None:
        """The loaded prefix into ``req``'s new row and state slot (``PromptPools.restore``).

        The state goes straight from the pinned arena to the device (``load_cpu_copy``'s ``.to``
        is a no-op).
        """

        def put_state(state: Any) -> None:
            assert self._mamba is not None
            self._mamba.load_cpu_copy(state, self._state_slot(req))
            req.kv.mamba_needs_clear = False  # SGLang would zero the restored state

        tokens = self._pools.restore(
            req.rid,
            lambda n: self._offload.stage_prefix(row, n),
            self._offload.fill_staging_until,
            put_state=put_state,
            state_device=self._offload.kv.device,
        )
        if tokens is None:
            return
        self._sync_metrics()
        logger.debug("prefix cache: %r resumes after %d cached tokens", req.rid, tokens)

    def publishes(self, req: Any, up_to: int) -> bool:
        """Whether ``req``'s first ``up_to`` written tokens are checkpointed (``PromptPools``)."""
        return self._pools.publishes(
            up_to, prompt_tokens=len(req.origin_input_ids), finished=req.finished()
        )

    def publish(self, req: Any, row: int, up_to: int) -> bool:
        """Checkpoint ``req``'s first ``up_to`` tokens (:meth:`publishes`); True if all did."""
        if self._keys.bypass(req) is not None:
            return False

        def gather() -> dict[str, torch.Tensor]:
            kv = self._offload.staged_layers(row, up_to)
            slots = self._req_to_token.req_to_token[int(req.kv.req_pool_idx), :up_to]
            mamba = self._mamba
            state = None if mamba is None else lambda: mamba.get_cpu_copy(self._state_slot(req))
            return self._pools.gather(kv, slots, state)

        key = self.key(req, req.full_untruncated_fill_ids[:up_to])
        fence = self._pools.checkpoints.publish(key, gather, holder=req.rid)
        if fence is not None:  # the next prompt waits for the copies reading the staging area
            self._offload.keep_staging_until(fence)
        self._sync_metrics()
        return fence is not None

    def forget(self, req: Any) -> None:
        """``req`` gave its row back: drop a load that never reached it."""
        self._pools.checkpoints.forget(req.rid)

    def settle(self) -> None:
        """No request holds a row: land every checkpoint still being copied, refresh the gauges."""
        self.cache.drain()
        self._sync_metrics()

    def invalidate(self) -> int:
        """Drop every checkpoint (a flush); returns how many were matchable."""
        dropped = self._pools.checkpoints.invalidate()
        self._sync_metrics()
        return dropped

    # ---- internals -------------------------------------------------------------------------------

    def _state_slot(self, req: Any) -> torch.Tensor:
        """``[1]`` physical index of ``req``'s recurrent state slot (refused once freed)."""
        index = req.kv.mamba_pool_idx
        if index is None:
            msg = f"request {req.rid!r} holds no recurrent state slot"
            raise OffloadRuntimeError(msg)
        slot: torch.Tensor = self._req_to_token.translate_mamba_indices(index.reshape(1))
        return slot

    def _sync_metrics(self) -> None:
        shared = None if self.shared is None else self.shared.stats()
        self._metrics.update(self.cache.stats(), self._pools.checkpoints.counts, shared)


def build_prefix_cache(
    ctx: Any,
    tree_cache: Any,
    offload: OffloadRuntime,
    *,
    budget_bytes: int,
    max_entries: int,
    store: StoreAddress | None = None,
) -> PrefixCacheRuntime:
    """The prefix cache of one scheduler (SGLang's ``TreeCacheBuildContext``, its tree cache).

    ``store``: the shared tier's store, or None.

    Raises:
        qsa_hostcache.ArenaAllocationError: the host cannot allocate (or pin) ``budget_bytes``.
        SwitchError: ``store`` is set and Mooncake is not installed.
    """
    from sglang.srt.runtime_context import get_parallel, get_serving

    runner = ctx.tp_worker.model_runner
    tp_rank = int(get_parallel().tp_rank)
    page_size = int(tree_cache.page_size)
    device = torch.device(runner.device)
    cache = HostPrefixCache(
        budget_bytes,
        max_entries=max_entries,
        page_size=page_size,
        device=device if device.type == "cuda" else None,
    )
    namespace = cache_namespace_from_sglang(runner.server_args, runner.model_config, tp_rank)
    fingerprint = engine_processor_fingerprint(runner.server_args, runner.model_config)
    runtime = PrefixCacheRuntime(
        cache,
        offload,
        kv_pool=runner.token_to_kv_pool,
        req_to_token_pool=tree_cache.req_to_token_pool,
        allocator=tree_cache.token_to_kv_pool_allocator,
        namespace=namespace,
        tp_group=getattr(ctx, "tp_group", None),
        tp_rank=tp_rank,
        weight_version=lambda: get_serving().weight_version,
        processor=fingerprint,
        spatial_merge_size=spatial_merge_size(runner.model_config.hf_config),
        shared=None if store is None else _shared_tier(store),
    )
    logger.info(
        "prefix cache: %s of %s host memory, %d checkpoints at most, pages of %d tokens; %s",
        format_bytes(cache.capacity_bytes),
        "pinned" if cache.pinned else "pageable",
        max_entries,
        page_size,
        "images keyed by their content" if fingerprint else "image prompts not reused",
    )
    if store is not None:
        logger.info("prefix cache: shared tier %s, written through", store)
    return runtime


def _shared_tier(store: StoreAddress) -> SharedCheckpoints:
    """The shared tier at ``store`` (a Mooncake client joins its store on a thread of its own)."""
    from qsa_hostcache import open_tier

    try:
        tier = open_tier(store)
    except ImportError as exc:
        msg = (
            f"{ENV_PREFIX_CACHE_STORE}={str(store)!r} needs Mooncake Store: install "
            f"'qsa-hostcache[mooncake]' ({exc})"
        )
        raise SwitchError(msg) from None
    return SharedCheckpoints(tier)
