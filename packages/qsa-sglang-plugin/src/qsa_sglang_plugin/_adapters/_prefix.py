"""The host prefix cache inside SGLang: SGLang's requests and pools -> ``qsa_hostcache`` calls.

One :class:`PrefixCacheRuntime` per scheduler (``SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB > 0``, with
``p2-offload``) turns the ``qsa_hisparse`` tree cache's calls (:mod:`._tree_cache`) into
:class:`qsa_hostcache.PromptCache` calls (page extras from ``qsa_mm_prefix.prompt_page_extras``),
which decide and compose the checkpoint. It keeps what is SGLang's: a ``Req``'s fields, SGLang's
pools and token-slot allocator, and the series. The calls and the checkpoint: ``docs/plugin.md``
("The host prefix cache").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch

from qsa_hostcache import (
    Admission,
    IndexAccess,
    PromptCache,
    PromptCacheNumbers,
    SharedCheckpoints,
    StoreUnavailableError,
    TokenSlots,
)
from qsa_kernels.sharded import ShardedIndexAccess
from qsa_mm_prefix import BypassReason, ProcessorFingerprint, prompt_page_extras, spatial_merge_size
from qsa_sglang_plugin._adapters._metrics import CountsMirror, RankMetrics
from qsa_sglang_plugin._adapters._multimodal import engine_processor_fingerprint, sglang_items
from qsa_sglang_plugin._adapters._namespace import cache_namespace_from_sglang
from qsa_sglang_plugin._adapters._sharded_index import sharded_index
from qsa_sglang_plugin._errors import OffloadRuntimeError, SwitchError
from qsa_sglang_plugin._switches import ENV_PREFIX_CACHE_STORE

if TYPE_CHECKING:
    from qsa_hostcache import StoreAddress
    from qsa_kernels.offload import OffloadRuntime

__all__ = ("METRIC_PREFIX", "PrefixCacheRuntime", "build_prefix_cache", "checkpoint_index")

logger = logging.getLogger(__name__)

#: Prefix of the prefix cache's Prometheus series (the library's counters and occupancy).
METRIC_PREFIX: Final = "qsa_hisparse_prefix_cache"


class _Metrics:
    """The cache's numbers (``PromptCacheNumbers``), mirrored into SGLang's Prometheus registry."""

    def __init__(self, tp_rank: int, tier: str | None) -> None:
        make = RankMetrics(tp_rank)
        series = PromptCacheNumbers.series(tier)
        self._mirrors = [CountsMirror(make, METRIC_PREFIX, part) for part in series]
        self.bypassed = make.counters_by(
            f"{METRIC_PREFIX}_bypassed",
            "Requests the prefix cache does not key (not matched, not published), by reason.",
            "reason",
            BypassReason,
        )

    def update(self, numbers: PromptCacheNumbers) -> None:
        """The cache's, the prompt calls' and the shared tier's counts, as increments."""
        for mirror, counts in zip(self._mirrors, numbers.parts(), strict=True):
            if counts is not None:
                mirror.update(counts)


class PrefixCacheRuntime:
    """The tree cache's prefix-cache calls on one scheduler's :class:`qsa_hostcache.PromptCache`.

    The calls that need no ``Req`` field go to :attr:`prompts` directly (lookup, its tier, the
    loaded slots, forget, settle, invalidate).
    ``req_to_token_pool``: SGLang's ``HybridReqToTokenPool`` (rows; ``mamba_pool``, the
    recurrent state, if any); ``allocator``: its token-slot allocator (slots of a loaded prefix).
    """

    def __init__(
        self,
        prompts: PromptCache[Any],
        offload: OffloadRuntime,
        req_to_token_pool: Any,
        allocator: Any,
    ) -> None:
        self.prompts, self._offload, self._req_to_token = prompts, offload, req_to_token_pool
        self._slots = TokenSlots(allocator.alloc, allocator.free)
        self._mamba = getattr(req_to_token_pool, "mamba_pool", None)

    def load_back(self, req: Any, tokens: int) -> bool:
        """Load ``req``'s checkpoint of ``tokens`` tokens into new KV slots; False if not."""
        ids = req.full_untruncated_fill_ids[:tokens]
        return self.prompts.load(req, ids, self._slots) is not None

    def restore_row(self, req: Any, row: int) -> None:
        """The loaded prefix into ``req``'s new row and state slot (``PromptCache.restore``).

        The state goes straight from the pinned arena to the device (``load_cpu_copy``'s ``.to``
        is a no-op).
        """

        def put_state(state: Any) -> None:
            assert self._mamba is not None
            self._mamba.load_cpu_copy(state, self._state_slot(req))
            req.kv.mamba_needs_clear = False  # SGLang would zero the restored state

        offload = self._offload
        self.prompts.restore(
            req,
            lambda n: offload.stage_prefix(row, n),
            offload.fill_staging_until,
            put_state=put_state,
            state_device=offload.kv.device,
        )

    def publish(self, req: Any, row: int, up_to: int) -> bool:
        """Checkpoint ``req``'s first ``up_to`` written tokens, if allowed; True if all did.

        The prompt's end comes twice under overlap scheduling: when the offload hands the prompt
        off (:meth:`OffloadRuntime.read_before_hand_off`) and with the prefill's result; the
        cache takes each length once.
        """
        mamba = self._mamba
        fence = self.prompts.publish(
            req,
            req.full_untruncated_fill_ids[:up_to],
            lambda: self._offload.staged_layers(row, up_to),
            lambda: self._req_to_token.req_to_token[int(req.kv.req_pool_idx), :up_to],
            None if mamba is None else lambda: mamba.get_cpu_copy(self._state_slot(req)),
            prompt_tokens=len(req.origin_input_ids),
            finished=req.finished(),
        )
        if fence is not None:  # the next prompt waits for the copies reading the staging area
            self._offload.keep_staging_until(fence)
        return fence is not None

    def _state_slot(self, req: Any) -> torch.Tensor:
        """``[1]`` physical index of ``req``'s recurrent state slot (refused once freed)."""
        index = req.kv.mamba_pool_idx
        if index is None:
            msg = f"request {req.rid!r} holds no recurrent state slot"
            raise OffloadRuntimeError(msg)
        slot: torch.Tensor = self._req_to_token.translate_mamba_indices(index.reshape(1))
        return slot


def build_prefix_cache(
    ctx: Any,
    tree_cache: Any,
    offload: OffloadRuntime,
    *,
    budget_bytes: int,
    max_entries: int,
    store: StoreAddress | None = None,
    admission: Admission | None = None,
    index_sharded: bool = False,
) -> PrefixCacheRuntime:
    """The prefix cache of one scheduler (SGLang's ``TreeCacheBuildContext``, its tree cache).

    ``store``: the shared tier's store, or None; ``admission``: which prefixes it checkpoints
    (None: every one); ``index_sharded``: the compressed index is sharded by page
    (:func:`checkpoint_index`).

    Raises:
        qsa_hostcache.ArenaAllocationError: the host cannot allocate (or pin) ``budget_bytes``.
        SwitchError: ``store`` is set and Mooncake is not installed.
    """
    from sglang.srt.runtime_context import get_parallel, get_serving

    runner, rows = ctx.tp_worker.model_runner, tree_cache.req_to_token_pool
    tp_rank, tp_group = int(get_parallel().tp_rank), getattr(ctx, "tp_group", None)
    page_size = int(tree_cache.page_size)
    namespace = cache_namespace_from_sglang(runner.server_args, runner.model_config, tp_rank)
    fingerprint = engine_processor_fingerprint(runner.server_args, runner.model_config)
    merge = spatial_merge_size(runner.model_config.hf_config)
    mamba = getattr(rows, "mamba_pool", None)  # its round-trip structure: slot 0's copy
    state = None if mamba is None else mamba.get_cpu_copy(torch.zeros(1, dtype=torch.int64))
    shared = None if store is None else _shared_tier(store)
    metrics = _Metrics(tp_rank, None if shared is None else shared.tier.name)
    group = getattr(tp_group, "cpu_group", None)
    kv_pool = runner.token_to_kv_pool
    prompts: PromptCache[Any] = PromptCache.in_host_memory(
        budget_bytes,
        checkpoint_index(kv_pool, index_sharded=index_sharded),
        int(kv_pool.qsa_compress_ratio),
        max_entries=max_entries,
        page_size=page_size,
        device=runner.device,
        state_sample=state,
        group=group if int(getattr(tp_group, "world_size", 1)) > 1 else None,
        extras=functools.partial(_page_extras, fingerprint, merge, page_size),
        namespace=lambda req: namespace.for_request(
            cache_salt=getattr(req, "cache_salt", None),
            lora_id=getattr(req, "lora_id", None),
            extra_key=getattr(req, "extra_key", None),
        ),
        request_id=lambda req: req.rid,
        weights=lambda: get_serving().weight_version,
        shared=shared,
        admission=admission or Admission.ALWAYS,
        on_bypass=lambda req, reason: metrics.bypassed[BypassReason(reason)].inc(),
        on_numbers=metrics.update,
    )
    logger.info(
        "prefix cache: %s",
        "images keyed by their content" if fingerprint else "image prompts not reused",
    )
    if store is not None:
        logger.info("prefix cache: shared tier %s, written through", store)
    return PrefixCacheRuntime(prompts, offload, rows, tree_cache.token_to_kv_pool_allocator)


def checkpoint_index(pool: Any, *, index_sharded: bool) -> Sequence[torch.Tensor] | IndexAccess:
    """What a checkpoint reads ``pool``'s compressed index through, and a restore writes.

    The pool's buffers (``qsa_compressed_k_buffer_pool``, ``[S / 4, Hi, Di]`` a layer), or, with
    index sharding (D2), this rank's shard of them (``[16 * P_local, Hi, Di]``) through the
    installed index: a :class:`qsa_kernels.sharded.ShardedIndexAccess`, whose read gathers the
    rows other ranks own (collective over the index's shard group, made by every rank alike at
    the gather of ``PromptCache.publish``) and whose write keeps this rank's rows. The checkpoint
    holds the whole index on every rank either way.

    Raises:
        OffloadRuntimeError: ``index_sharded`` and no index shard is installed.
    """
    buffers: Sequence[torch.Tensor] = pool.qsa_compressed_k_buffer_pool
    if not index_sharded:
        return buffers
    return ShardedIndexAccess(sharded_index(), buffers)


def _page_extras(
    processor: ProcessorFingerprint | None, merge: int | None, page_size: int, req: Any
) -> Mapping[int, bytes] | BypassReason:
    """``prompt_page_extras`` of a ``Req``'s prompt (``processor`` None: image prompts bypass)."""
    mm_inputs = getattr(req, "multimodal_inputs", None)
    return prompt_page_extras(
        len(req.origin_input_ids),
        None if mm_inputs is None else sglang_items(mm_inputs),
        processor=processor,
        page_size=page_size,
        spatial_merge_size=merge,
        input_embeds=getattr(req, "input_embeds", None) is not None,
        embed_overrides=getattr(req, "positional_embed_overrides", None) is not None,
        holder=req.rid,
    )


def _shared_tier(store: StoreAddress) -> SharedCheckpoints:
    """``SharedCheckpoints.over_store``, refused naming the switch."""
    try:
        return SharedCheckpoints.over_store(store)
    except StoreUnavailableError as exc:
        raise SwitchError(f"{ENV_PREFIX_CACHE_STORE}: {exc}") from None
