"""The host prefix cache inside SGLang: prompt checkpoints published, matched and loaded back.

With ``SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB > 0`` (and ``p2-offload``), one
:class:`PrefixCacheRuntime` per scheduler (TP rank) keeps checkpoints of prompt prefixes in a
:class:`qsa_hostcache.HostPrefixCache` (pinned host memory where CUDA is), and the ``qsa_hisparse``
tree cache (:mod:`._tree_cache`) calls it where SGLang's own prefix caches attach. The lookups,
loads, restores and publishes themselves, each agreed by the TP ranks, and the weights-version
check are :class:`qsa_hostcache.PromptCheckpoints`; this module says what an SGLang request's
checkpoint holds, where each segment comes from in SGLang's pools, and how SGLang's calls map:

- ``checkpoint(req, up_to)`` (every prefill chunk's end, and the prompt's): when ``up_to`` is a
  whole number of pages (64 tokens for QSA), :meth:`PrefixCacheRuntime.publish` writes a
  checkpoint of the first ``up_to`` tokens; the device copies run on the cache's side stream and
  the checkpoint becomes matchable when they finish.
- ``match_prefix``: :meth:`PrefixCacheRuntime.lookup` finds the longest published checkpoint of the
  request's key and reports it as a host hit; SGLang then budgets for it.
- ``init_load_back``: :meth:`PrefixCacheRuntime.load_back` pins the checkpoint, takes KV slots for
  its tokens and restores their compressed index rows; SGLang counts them in ``prefix_len`` and so
  in ``meta_info.cached_tokens``. Anything that fails here (the checkpoint was evicted, no slots)
  returns 0 and the request computes its whole prompt: never a partial state.
- ``maybe_hand_to_session`` (the request's row and state slot now exist):
  :meth:`PrefixCacheRuntime.restore_row` copies the raw K/V into the staging area, the recurrent
  state into the request's slot, and keeps SGLang from clearing that slot.

A checkpoint of ``T`` tokens holds everything the model's state is at that boundary:

=================  ================================================  ==============================
segment            contents                                          source
=================  ================================================  ==============================
``k.<i>, v.<i>``   QSA layer ``i``'s raw K/V, ``[T, Hkv, D]``        the offload staging area
``index``          every QSA layer's compressed index keys,          ``QSATokenToKVPool``, slots
                   ``[L, T / 4, Hi, Di]``                            ``// 4``
``state.<j>``      the request's recurrent state: GDN conv and       ``MambaPool.get_cpu_copy`` of
                   temporal states and every state registered with   its slot
                   the pool (PLE)
=================  ================================================  ==============================

Not stored: the indexer's pending key ring and RoPE ring. ``T`` is a multiple of the compress ratio
(4), so no group is pending at the boundary, and the next group's four ring entries are written
before compression reads them.

Keys: :func:`cache_namespace_from_sglang` (model, weights, every flag that changes the bytes, TP
rank) with the request's ``cache_salt``, LoRA id and ``extra_key``, over every token id. A page an
image overlaps also carries that image's identity (:func:`prompt_identity_from_sglang`: content,
preprocessing, order, position, grid), so the same token ids with another picture never match; a
page without an image keys exactly as the same tokens of a text prompt. Requests with video,
audio, precomputed features, embeddings or other inputs the key cannot name are not matched or
published (``qsa_hisparse_prefix_cache_bypassed_total{reason}``, and a log line). With several TP
ranks, each hit length, load-back and publish is agreed by one MIN over the TP group's CPU group,
so a rank-local eviction never splits the ranks.

``flush_cache`` (SGLang's weight updates flush by default) drops every checkpoint, and so does a
new weights version (``weight_version`` of an update, also one that asks not to flush): a
checkpoint never outlives the weights that computed it, as far as SGLang names them.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch
from torch.utils import _pytree as pytree

from qsa_core import format_bytes
from qsa_hostcache import (
    CacheStats,
    Claim,
    HostPrefixCache,
    Lease,
    PrefixKey,
    PromptCheckpoints,
    PromptCounts,
    SegmentSpec,
    agree_min,
    kv_segments,
)
from qsa_mm_prefix import MultimodalPrefixError, ProcessorFingerprint, spatial_merge_size
from qsa_sglang_plugin._adapters._metrics import RankMetrics, advance_counters
from qsa_sglang_plugin._adapters._multimodal import (
    SGLangBypass,
    SGLangBypassReason,
    engine_processor_fingerprint,
    prompt_identity_from_sglang,
)
from qsa_sglang_plugin._adapters._namespace import cache_namespace_from_sglang, request_salt
from qsa_sglang_plugin._errors import OffloadRuntimeError

if TYPE_CHECKING:
    from qsa_hostcache import CacheNamespace
    from qsa_kernels.offload import OffloadRuntime

__all__ = (
    "METRIC_PREFIX",
    "BypassReason",
    "ImageKeying",
    "PrefixCacheRuntime",
    "build_prefix_cache",
)

logger = logging.getLogger(__name__)

#: Prefix of the prefix cache's Prometheus series (the library's counters and occupancy).
METRIC_PREFIX: Final = "qsa_hisparse_prefix_cache"


class BypassReason(enum.StrEnum):
    """Why a request is neither matched nor published, besides its media (:data:`Bypass`)."""

    INPUT_EMBEDS = "input-embeds"
    """Embeddings given instead of token ids."""
    EMBED_OVERRIDES = "embed-overrides"
    """Positional embedding overrides: the same ids carry other vectors."""
    NO_PROCESSOR = "no-processor"
    """Media, but no processor fingerprint on this engine (its tokenizer is skipped)."""
    INVALID_MULTIMODAL = "invalid-multimodal"
    """Media items whose spans or grids contradict the prompt (logged as an engine bug)."""


#: Why a request is not keyed: one of the cache's own reasons or a media item's.
Bypass = BypassReason | SGLangBypassReason


@dataclasses.dataclass(frozen=True, slots=True)
class ImageKeying:
    """What an image's identity needs from the engine, besides the request.

    Attributes:
        processor: the fingerprint of the processor that turned pictures into pixel values and
            placeholder tokens (:func:`engine_processor_fingerprint`).
        spatial_merge_size: the vision tower's patch merge, to check each span against its grid
            (``None``: not checked).
    """

    processor: ProcessorFingerprint
    spatial_merge_size: int | None = None


def _shape(spec: SegmentSpec) -> tuple[int, ...]:
    """The shape a segment was published with (this module publishes every segment with one)."""
    if spec.shape is None:
        msg = f"segment {spec.name!r} was published without a shape"
        raise OffloadRuntimeError(msg)
    return spec.shape


class _Metrics:
    """The cache's own counters and occupancy, mirrored into SGLang's Prometheus registry."""

    def __init__(self, tp_rank: int) -> None:
        make = RankMetrics(tp_rank)
        self._series: dict[str, Any] = {
            s.name: (make.counter if s.counter else make.gauge)(f"{METRIC_PREFIX}_{s.name}", s.help)
            for s in CacheStats.series()
        }
        self._last: CacheStats | None = None
        self._counts = PromptCounts()
        self._counters = {  # PromptCounts' fields
            "publish_errors": make.counter(
                f"{METRIC_PREFIX}_publish_errors",
                "Checkpoints that failed while being written (the request was served).",
            ),
            "loads": make.counter(
                f"{METRIC_PREFIX}_loads",
                "Requests that resumed from a checkpoint (SGLang counts its tokens as cached).",
            ),
            "loaded_tokens": make.counter(
                f"{METRIC_PREFIX}_loaded_tokens",
                "Prompt tokens served from checkpoints instead of computed.",
            ),
            "load_failures": make.counter(
                f"{METRIC_PREFIX}_load_back_failures",
                "Hits that could not be loaded back (the request recomputed its prompt).",
            ),
        }
        self.unloadable = make.counter(
            f"{METRIC_PREFIX}_unloadable_requests",
            "Requests not matched because SGLang admits them without loading a host hit "
            "(ignore_eos with the radix cache disabled); they are still checkpointed.",
        )
        self.bypassed = make.counters_by(
            f"{METRIC_PREFIX}_bypassed",
            "Requests the prefix cache does not key (not matched, not published), by reason.",
            "reason",
            [*BypassReason, *SGLangBypassReason],
        )

    def update(self, stats: CacheStats, counts: PromptCounts) -> None:
        """The cache's statistics and the prompt calls' counts, as increments since the last."""
        advance_counters(self._counters, counts, self._counts)
        self._counts = counts
        for series in CacheStats.series():
            value = int(getattr(stats, series.name))
            metric = self._series[series.name]
            if series.counter:
                before = 0 if self._last is None else int(getattr(self._last, series.name))
                if value > before:
                    metric.inc(value - before)
            else:
                metric.set(value)
        self._last = stats


class PrefixCacheRuntime:
    """The host prefix cache of one scheduler and the SGLang state it checkpoints.

    Args:
        cache: the checkpoints (one host arena).
        offload: the offload runtime, whose staging area holds the prompt being prefilled.
        kv_pool: SGLang's ``QSATokenToKVPool`` (the compressed index keys).
        req_to_token_pool: SGLang's ``HybridReqToTokenPool`` (request rows; the recurrent state
            pool ``mamba_pool``, if the model has one).
        allocator: SGLang's token-slot allocator (KV slots for a loaded prefix).
        namespace: this rank's namespace without a request's salt.
        tp_group: SGLang's TP ``GroupCoordinator`` (``None`` or one rank: no agreement needed).
        tp_rank: this rank, for the metrics' labels.
        weight_version: the served weights' version now (SGLang's ``weight_version``); read
            before every lookup and publish.
        images: what image identities need (``None``: image prompts bypass, ``no-processor``).
        ignore_eos_loads: whether SGLang loads a host hit for an ``ignore_eos`` request (only
            with its radix cache enabled); when not, such requests are not matched.
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
        images: ImageKeying | None = None,
        ignore_eos_loads: bool = False,
    ) -> None:
        self.cache = cache
        group = getattr(tp_group, "cpu_group", None)
        self._checkpoints: PromptCheckpoints[torch.Tensor] = PromptCheckpoints(
            cache,
            agree=agree_min(group if int(getattr(tp_group, "world_size", 1)) > 1 else None),
            weights=weight_version,
        )
        self._images = images
        # Each request's page identities, computed once at its first lookup (its media features
        # are released when it finishes); an entry lives as long as SGLang's Req.
        self._keyings: weakref.WeakKeyDictionary[Any, Mapping[int, bytes] | Bypass] = (
            weakref.WeakKeyDictionary()
        )
        self._ignore_eos_loads = ignore_eos_loads
        self._unloadables: weakref.WeakSet[Any] = weakref.WeakSet()
        self._offload = offload
        self._kv_pool = kv_pool
        self._req_to_token = req_to_token_pool
        self._allocator = allocator
        self._namespace = namespace
        self._ratio = int(kv_pool.qsa_compress_ratio)
        self._mamba = getattr(req_to_token_pool, "mamba_pool", None)
        self._state_spec: pytree.TreeSpec | None = None
        self._state_present: tuple[bool, ...] = ()
        if self._mamba is not None:  # the pool's own round-trip structure, read from slot 0
            sample = self._mamba.get_cpu_copy(torch.zeros(1, dtype=torch.int64, device="cpu"))
            leaves, self._state_spec = pytree.tree_flatten(sample)
            self._state_present = tuple(isinstance(x, torch.Tensor) for x in leaves)
        self._metrics = _Metrics(tp_rank)
        self._sync_metrics()

    # ---- keys ------------------------------------------------------------------------------------

    def bypass_reason(self, req: Any) -> Bypass | None:
        """Why ``req`` cannot be keyed, or ``None`` when it can."""
        keying = self._keying(req)
        return None if isinstance(keying, Mapping) else keying

    def key(self, req: Any, tokens: Any) -> PrefixKey:
        """The key of ``tokens`` (``req``'s first token ids) in ``req``'s namespace.

        The pages ``tokens`` covers carry the identities of the images they overlap.

        Raises:
            OffloadRuntimeError: ``req`` bypasses (:meth:`bypass_reason`).
        """
        keying = self._keying(req)
        if not isinstance(keying, Mapping):
            msg = f"request {req.rid!r} is not keyed ({keying.value}); it has no prefix key"
            raise OffloadRuntimeError(msg)
        pages = -(-len(tokens) // self.cache.page_size)
        extras = {page: extra for page, extra in keying.items() if page < pages}
        salt = request_salt(
            cache_salt=getattr(req, "cache_salt", None),
            lora_id=getattr(req, "lora_id", None),
            extra_key=getattr(req, "extra_key", None),
        )
        namespace = (
            self._namespace if salt is None else dataclasses.replace(self._namespace, salt=salt)
        )
        return PrefixKey(namespace, tokens, page_size=self.cache.page_size, page_extras=extras)

    # ---- SGLang's calls --------------------------------------------------------------------------

    def lookup(self, req: Any, tokens: Any) -> int:
        """Tokens of the longest checkpoint that is a prefix of ``tokens`` (0 on a miss).

        Args:
            req: SGLang's ``Req``.
            tokens: the ids SGLang matches (at most the prompt less its last token).
        """
        if self.bypass_reason(req) is not None:
            return self._checkpoints.lookup(None)
        if self._unloadable(req):
            return 0  # the same answer on every rank: the request's own sampling parameters
        keyed = len(tokens) >= self.cache.page_size
        hit = self._checkpoints.lookup(self.key(req, tokens) if keyed else None)
        self._sync_metrics()
        return hit

    def load_back(self, req: Any, tokens: int) -> bool:
        """Pin ``req``'s checkpoint of ``tokens`` tokens, take KV slots, restore the index.

        Returns:
            True when every rank did (the slots are :meth:`prefix_slots`); False when any could
            not (nothing is held: the request computes its prompt).
        """

        def claim(lease: Lease) -> Claim[torch.Tensor] | None:
            slots: torch.Tensor | None = self._allocator.alloc(tokens)
            if slots is None:
                return None
            try:
                self._restore_index(lease, slots)
            except BaseException:
                self._allocator.free(slots)
                raise
            return Claim(slots, lambda: self._allocator.free(slots))

        key = self.key(req, req.full_untruncated_fill_ids[:tokens])
        loaded = self._checkpoints.load(req.rid, key, claim) is not None
        self._sync_metrics()
        return loaded

    def prefix_slots(self, req: Any) -> torch.Tensor | None:
        """The KV slots of ``req``'s loaded prefix, while it waits for its row."""
        return self._checkpoints.claimed(req.rid)

    def restore_row(self, req: Any, row: int) -> None:
        """Fill the loaded prefix's K/V and recurrent state into ``req``'s new row and slot.

        The recurrent state first: SGLang's ``load_cpu_copy`` synchronizes the device, which must
        not wait for the K/V. Then each QSA layer's K/V is restored by copies of its own, which
        that layer's prefill waits for (:meth:`OffloadRuntime.fill_staging_until`): the copies
        run while the layers before it compute.
        """
        lease = self._checkpoints.take(req.rid)
        if lease is None:
            return
        with lease:  # released at once: the arena orders a later write after these reads
            tokens = lease.match.num_tokens
            if self._mamba is not None:
                self._mamba.load_cpu_copy(self._restore_state(lease), self._state_slot(req))
                req.kv.mamba_needs_clear = False  # SGLang would zero the restored state
            k_layers, v_layers = self._offload.stage_prefix(row, tokens)
            self._checkpoints.restore_kv(
                lease, k_layers, v_layers, self._offload.fill_staging_until
            )
        self._sync_metrics()
        logger.debug("prefix cache: %r resumes after %d cached tokens", req.rid, tokens)

    def publish(self, req: Any, row: int, up_to: int) -> bool:
        """Checkpoint ``req``'s first ``up_to`` tokens, if that is a whole number of pages.

        Returns:
            True when the checkpoint was committed on every rank (matchable once its copies
            finish); False when it was skipped (not page-aligned, bypassed, already cached, no
            room on some rank) or failed (logged; the request is served either way).
        """
        if up_to < self.cache.page_size or up_to % self.cache.page_size:
            return False
        if self.bypass_reason(req) is not None:
            return False

        def gather() -> dict[str, torch.Tensor]:
            sources = kv_segments(*self._offload.staged_layers(row, up_to))
            sources["index"] = self._index_rows(req, up_to)
            sources.update(self._state_of(req))
            return sources

        key = self.key(req, req.full_untruncated_fill_ids[:up_to])
        fence = self._checkpoints.publish(key, gather, holder=req.rid)
        if fence is not None:  # the next prompt waits for the copies reading the staging area
            self._offload.keep_staging_until(fence)
        self._sync_metrics()
        return fence is not None

    def forget(self, req: Any) -> None:
        """``req`` gave its row back: drop a load that never reached it."""
        self._checkpoints.forget(req.rid)

    def settle(self) -> None:
        """No request holds a row: land every checkpoint still being copied, refresh the gauges."""
        self.cache.drain()
        self._sync_metrics()

    def invalidate(self) -> int:
        """Drop every checkpoint (a flush); returns how many were matchable."""
        dropped = self._checkpoints.invalidate()
        self._sync_metrics()
        return dropped

    # ---- internals -------------------------------------------------------------------------------

    def _unloadable(self, req: Any) -> bool:
        """Whether SGLang would admit ``req`` without loading a hit, so a lookup is wasted.

        SGLang 0.5.23 admits an ``ignore_eos`` request through
        ``PrefillAdder.add_one_req_ignore_eos`` whenever the radix cache is disabled (as the
        offload requires): that path never calls ``init_load_back``. Counted once per request.
        """
        if self._ignore_eos_loads:
            return False
        if not getattr(getattr(req, "sampling_params", None), "ignore_eos", False):
            return False
        if req not in self._unloadables:
            self._unloadables.add(req)
            self._metrics.unloadable.inc()
            logger.debug("prefix cache: %r is not matched (ignore_eos)", req.rid)
        return True

    def _keying(self, req: Any) -> Mapping[int, bytes] | Bypass:
        """``req``'s page extras (``page -> image identity``), or why it bypasses; memoised."""
        keying = self._keyings.get(req)
        if keying is None:
            keying = self._keying_of(req)
            self._keyings[req] = keying
            if not isinstance(keying, Mapping):
                self._metrics.bypassed[keying].inc()
                logger.info("prefix cache: %r is not reused (%s)", req.rid, keying.value)
        return keying

    def _keying_of(self, req: Any) -> Mapping[int, bytes] | Bypass:
        if getattr(req, "input_embeds", None) is not None:
            return BypassReason.INPUT_EMBEDS
        if getattr(req, "positional_embed_overrides", None) is not None:
            return BypassReason.EMBED_OVERRIDES
        if getattr(req, "multimodal_inputs", None) is None:
            return {}
        if self._images is None:
            return BypassReason.NO_PROCESSOR
        try:
            identity = prompt_identity_from_sglang(
                req,
                processor=self._images.processor,
                page_size=self.cache.page_size,
                spatial_merge_size=self._images.spatial_merge_size,
            )
        except MultimodalPrefixError:
            logger.exception("prefix cache: the media items of %r contradict its prompt", req.rid)
            return BypassReason.INVALID_MULTIMODAL
        if isinstance(identity, SGLangBypass):
            return identity.reason
        if identity.bypass_reason is not None:  # the library's reasons are the adapter's first
            return SGLangBypassReason(identity.bypass_reason.value)
        return identity.page_extras

    def _group_slots(self, token_slots: torch.Tensor) -> torch.Tensor:
        """``[T / 4]`` compressed slots of a page-aligned run of ``[T]`` token slots."""
        return token_slots[:: self._ratio].long() // self._ratio

    def _index_rows(self, req: Any, tokens: int) -> torch.Tensor:
        """``[L, T / 4, Hi, Di]`` compressed index keys of ``req``'s first ``tokens`` tokens."""
        row_slots = self._req_to_token.req_to_token[int(req.kv.req_pool_idx), :tokens]
        groups = self._group_slots(row_slots)
        return torch.stack([buf[groups] for buf in self._kv_pool.qsa_compressed_k_buffer_pool])

    def _restore_index(self, lease: Lease, slots: torch.Tensor) -> None:
        spec = lease.match.segment("index")
        buffers: Sequence[torch.Tensor] = self._kv_pool.qsa_compressed_k_buffer_pool
        rows = torch.empty(_shape(spec), dtype=buffers[0].dtype, device=buffers[0].device)
        self._checkpoints.restore(lease, {"index": rows})
        groups = self._group_slots(slots.to(buffers[0].device))
        for layer, buf in enumerate(buffers):
            buf[groups] = rows[layer]

    def _state_of(self, req: Any) -> dict[str, torch.Tensor]:
        """``state.<j>`` CPU tensors of ``req``'s recurrent state slot (none without a pool)."""
        if self._mamba is None:
            return {}
        leaves = pytree.tree_leaves(self._mamba.get_cpu_copy(self._state_slot(req)))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        return {f"state.{j}": t.contiguous() for j, t in enumerate(tensors)}

    def _state_slot(self, req: Any) -> torch.Tensor:
        """``[1]`` physical index of ``req``'s recurrent state slot.

        Raises:
            OffloadRuntimeError: ``req`` holds no state slot (SGLang freed it).
        """
        index = req.kv.mamba_pool_idx
        if index is None:
            msg = f"request {req.rid!r} holds no recurrent state slot"
            raise OffloadRuntimeError(msg)
        slot: torch.Tensor = self._req_to_token.translate_mamba_indices(index.reshape(1))
        return slot

    def _restore_state(self, lease: Lease) -> Any:
        """The leased checkpoint's recurrent state, in the structure ``load_cpu_copy`` takes.

        Its tensors are on the offload's device: straight from the pinned arena, where a CPU
        copy would cost a host memcpy and a pageable upload (``load_cpu_copy`` moves each tensor
        with ``.to(device)``, a no-op there).
        """
        assert self._state_spec is not None
        targets: dict[str, torch.Tensor] = {}
        for j in range(sum(self._state_present)):
            spec = lease.match.segment(f"state.{j}")
            dtype = getattr(torch, str(spec.dtype).removeprefix("torch."))
            targets[f"state.{j}"] = torch.empty(
                _shape(spec), dtype=dtype, device=self._offload.kv.device
            )
        self._checkpoints.restore(lease, targets)
        tensors = iter(targets.values())
        leaves = [next(tensors) if present else None for present in self._state_present]
        return pytree.tree_unflatten(leaves, self._state_spec)

    def _sync_metrics(self) -> None:
        self._metrics.update(self.cache.stats(), self._checkpoints.counts)


def build_prefix_cache(
    ctx: Any, tree_cache: Any, offload: OffloadRuntime, *, budget_bytes: int, max_entries: int
) -> PrefixCacheRuntime:
    """The prefix cache of one scheduler.

    Args:
        ctx: SGLang's ``TreeCacheBuildContext``.
        tree_cache: the ``qsa_hisparse`` tree cache built from it (its page size, pools and
            allocator are the scheduler's).
        offload: the model runner's offload runtime.
        budget_bytes: host bytes for checkpoints on this rank.
        max_entries: checkpoints kept at most.

    Raises:
        qsa_hostcache.ArenaAllocationError: the host cannot allocate (or pin) the budget.
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
    images = (
        None
        if fingerprint is None
        else ImageKeying(fingerprint, spatial_merge_size(runner.model_config.hf_config))
    )
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
        images=images,
        ignore_eos_loads=not getattr(tree_cache, "disable", True),
    )
    logger.info(
        "prefix cache: %s of %s host memory, %d checkpoints at most, pages of %d tokens; %s",
        format_bytes(cache.capacity_bytes),
        "pinned" if cache.pinned else "pageable",
        max_entries,
        page_size,
        "images keyed by their content" if images else "image prompts not reused",
    )
    return runtime
