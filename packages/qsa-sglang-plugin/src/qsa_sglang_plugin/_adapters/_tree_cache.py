"""The ``qsa_hisparse`` radix-cache backend: SGLang's unified radix cache plus one lease a request.

Imported only when SGLang builds its tree cache (:func:`._lifecycle.radix_cache_factory`).
SGLang's row calls (``maybe_hand_to_session``, ``checkpoint``, ``on_release``) become the calls
of the scheduler's request rows: :class:`qsa_core.ResidentRows`, or with an offload its
:class:`~qsa_kernels.offload.OffloadRuntime` (the same calls); its prefix-cache calls go to
:class:`._prefix.PrefixCacheRuntime`. The lease's path: ``docs/architecture.md`` ("A request from
admission to release"). Series: ``qsa_hisparse_live_leases``,
``qsa_hisparse_leases_released_total{outcome}``.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_parallel

from qsa_core import (
    LeaseHandle,
    LeaseOutcome,
    LeaseTable,
    ResidentRows,
    admit_request,
    release_request,
)
from qsa_hostcache import admits_host_hit, host_hit
from qsa_kernels.offload import OffloadRuntime
from qsa_sglang_plugin._adapters._metrics import RankMetrics
from qsa_sglang_plugin._adapters._prefix import PrefixCacheRuntime
from qsa_sglang_plugin._errors import OffloadRuntimeError
from qsa_sglang_plugin._switches import RADIX_CACHE_BACKEND

__all__ = ("HiSparseRadixCache", "around_add_one_req")

logger = logging.getLogger(__name__)


class HiSparseRadixCache(UnifiedRadixCache):
    """SGLang's unified radix cache, plus one lease per request that holds a KV row."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        slots = int(self.req_to_token_pool.size)
        self.qsa_rows: ResidentRows | OffloadRuntime = ResidentRows(slots)
        self.qsa_offload: OffloadRuntime | None = None  # set by use_offload
        self.qsa_prefix: PrefixCacheRuntime | None = None  # set by use_prefix_cache
        # rid -> SGLang's Req while it holds a lease, for the prefix cache's hand-off checkpoint
        self._qsa_requests: dict[str, Any] = {}
        make = RankMetrics(int(get_parallel().tp_rank))
        doc = "Requests holding a QSA HiSparse lease (a KV row) on this TP rank."
        self._qsa_live = make.gauge("qsa_hisparse_live_leases", doc)
        doc = "QSA HiSparse leases given back, by why the request released its row."
        self._qsa_released = make.counters_by(
            "qsa_hisparse_leases_released", doc, "outcome", LeaseOutcome
        )
        logger.info("%s lifecycle: %d lease slots", RADIX_CACHE_BACKEND, slots)

    def use_offload(self, runtime: OffloadRuntime) -> None:
        """Leases are the offload runtime's from now on (before any request arrives)."""
        if not self.qsa_leases.idle:
            msg = f"{RADIX_CACHE_BACKEND}: an offload attached while leases are live"
            raise OffloadRuntimeError(msg)
        self.qsa_rows = self.qsa_offload = runtime

    def use_prefix_cache(self, prefix: PrefixCacheRuntime) -> None:
        """Checkpoint prompts from now on, at each chunk end and at the prompt's end.

        The prompt's end is taken when the offload hands the prompt off (before the step that
        decodes it first, which would advance its recurrent state) or when SGLang processes its
        result, whichever comes first.
        """
        if self.qsa_offload is None:
            msg = f"{RADIX_CACHE_BACKEND}: the prefix cache needs the offload's staging area"
            raise OffloadRuntimeError(msg)
        self.qsa_prefix = prefix
        self.qsa_offload.read_before_hand_off(self._publish_hand_off)

    def _publish_hand_off(self, handle: LeaseHandle, tokens: int) -> None:
        # What SGLang's checkpoint_kv_cache would publish: a live request the tree may hold.
        req = self._qsa_requests.get(handle.request_id)
        if req is None or self.qsa_prefix is None or req.finished():
            return
        if not req.skip_radix_cache_insert:
            self.qsa_prefix.publish(req, handle.slot, tokens)

    @property
    def qsa_leases(self) -> LeaseTable:
        """The requests' leases (the offload runtime's, with an offload)."""
        return self.qsa_rows.leases

    # ---- SGLang's prefix-cache calls (the host prefix cache, when it is on) -----------------

    def match_prefix(self, params: Any) -> Any:
        result = super().match_prefix(params)
        prefix = self.qsa_prefix
        if prefix is None or params.req is None:
            return result
        key = params.key
        hit = prefix.prompts.lookup(params.req, key.token_ids[: len(key)])
        beyond = host_hit(hit, int(result.device_prefix_len))
        if not beyond:
            return result
        # SGLang reports a "storage" hit in cached_tokens_details for a shared-tier checkpoint
        # (sticky: a later match of the same request finds it copied into the arena).
        req = params.req
        req.host_hit_is_storage = bool(req.host_hit_is_storage) or prefix.prompts.hit_is_shared
        return result._replace(
            host_hit_length=beyond, full_kv_hit_length=max(int(result.full_kv_hit_length), hit)
        )

    def init_load_back(self, params: Any) -> Any:
        prefix = self.qsa_prefix
        if prefix is None or params.req is None or params.host_hit_length <= 0:
            return super().init_load_back(params)
        req = params.req
        loaded = (
            params.host_hit_length
            if prefix.load_back(req, req.prefix_len + params.host_hit_length)
            else 0
        )
        return loaded, params.best_match_node

    def prefix_device_indices(self, req: Any) -> Any:
        slots = None if self.qsa_prefix is None else self.qsa_prefix.prompts.claimed(req)
        if slots is None:
            return super().prefix_device_indices(req)
        return slots[: req.prefix_len]

    def load_back_is_cache_owned(self) -> bool:
        # Loaded slots belong to the request and are freed with it.
        return self.qsa_prefix is None and bool(super().load_back_is_cache_owned())

    # ---- SGLang's lifecycle calls ------------------------------------------------------------

    def maybe_hand_to_session(self, req: Any) -> None:
        super().maybe_hand_to_session(req)
        handle = admit_request(
            self.qsa_rows,
            req.rid,
            int(req.kv.req_pool_idx),
            len(req.full_untruncated_fill_ids),  # the prompt, a retracted request's output too
        )
        if handle is None:  # a later chunk of a leased prompt
            return
        if self.qsa_prefix is not None:  # its hand-off checkpoints the prompt's end
            self._qsa_requests[req.rid] = req
        self._qsa_live.inc()
        if self.qsa_prefix is not None:
            self.qsa_prefix.restore_row(req, handle.slot)

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        super().checkpoint(req, up_to=up_to, **kwargs)
        handle = self.qsa_leases.find(req.rid)
        if handle is None:
            return
        if self.qsa_prefix is not None:
            self.qsa_prefix.publish(req, handle.slot, up_to)
        self.qsa_rows.prompt_written(handle, up_to, len(req.origin_input_ids))

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._qsa_requests.pop(req.rid, None)
        if self.qsa_prefix is not None:
            self.qsa_prefix.prompts.forget(req)
        aborted = isinstance(req.finished_reason, FINISH_ABORT)
        # An offload waits for the request's copy to the host.
        outcome = release_request(self.qsa_rows, req.rid, finished=req.finished(), aborted=aborted)
        # The outcome first: a reader that sees no live lease sees every outcome counted.
        self._qsa_released[outcome].inc()
        self._qsa_live.dec()
        if self.qsa_prefix is not None and self.qsa_leases.idle:
            self.qsa_prefix.prompts.settle()
        logger.debug("%s lease of %r released: %s", RADIX_CACHE_BACKEND, req.rid, outcome)

    def admits_host_hit(self, req: Any) -> bool:
        """:func:`qsa_hostcache.admits_host_hit` of ``req``'s pending host hit."""
        if self.qsa_prefix is None:
            return False
        return admits_host_hit(int(req.host_hit_length), device_cache_disabled=self.disable)

    def reset(self) -> None:
        rows = getattr(self, "qsa_rows", None)
        live = [] if rows is None else [h.request_id for h in rows.leases.live_handles()]
        if live:
            # SGLang flushes only when idle: keep rows still leased rather than free them.
            logger.error(
                "%s: cache flush refused, %d leases are live (requests %r)",
                RADIX_CACHE_BACKEND,
                len(live),
                sorted(live),
            )
            return
        super().reset()
        prefix = getattr(self, "qsa_prefix", None)
        if prefix is not None:
            prefix.prompts.invalidate()


def around_add_one_req(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """``PrefillAdder.add_one_req`` that loads an ``ignore_eos`` request's host hit.

    SGLang 0.5.23 sends an ``ignore_eos`` request to ``add_one_req_ignore_eos`` whenever the
    tree cache is disabled, and that path never calls ``init_load_back``. For a request with a
    pending host hit the tree cache reads as enabled for this one call: ``add_one_req`` reads
    ``disable`` only at that gate, and its own path budgets an ``ignore_eos`` request at its full
    output as the other one does.
    """
    cache = adder.tree_cache
    if not (
        req.sampling_params.ignore_eos
        and isinstance(cache, HiSparseRadixCache)
        and cache.admits_host_hit(req)
    ):
        return original(adder, req, *args, **kwargs)
    cache.disable = False
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        cache.disable = True
