"""One engine rank's host prefix cache over its requests: keys, agreed calls, pools and numbers.

:class:`PromptCache` is what an engine's prefix-cache hooks call, with its own request objects
(any type ``R``) and plain values (token ids, token counts, tensors, callables over its pools).
It composes :class:`PromptKeys` (a request's page extras or bypass, decided once), the
request's namespace, :class:`PromptCheckpoints` (every decision agreed by the ranks, the
weights-version check, the shared tier) and :class:`PromptPools` (what a checkpoint holds and
where it goes back), and reports what they counted as one :class:`PromptCacheNumbers` after
every call that may have changed it. A request that is not keyed is never published and is
looked up as a miss that the ranks still agree on.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch

from qsa_core import CountSeries, format_bytes
from qsa_hostcache._arena import CopyFence
from qsa_hostcache._cache import HostPrefixCache
from qsa_hostcache._keys import CacheNamespace, PrefixKey
from qsa_hostcache._prompt_pools import IndexAccess, KVLayers, PromptPools, TokenSlots
from qsa_hostcache._prompts import Admission, Agree, PromptCheckpoints, PromptCounts, agree_min
from qsa_hostcache._requests import PromptKeys
from qsa_hostcache._segments import StateSegments
from qsa_hostcache._shared import SharedCheckpoints, TierStats
from qsa_hostcache._stats import CacheStats

__all__ = ("PromptCache", "PromptCacheNumbers")

logger = logging.getLogger(__name__)

R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class PromptCacheNumbers:
    """What one prompt cache has counted, one snapshot.

    Attributes:
        cache: the arena's own counters and occupancy (:class:`CacheStats`).
        prompts: what the engine's calls did (:class:`PromptCounts`).
        shared: the shared tier's counters (:class:`TierStats`); None without a shared tier.
    """

    cache: CacheStats
    prompts: PromptCounts
    shared: TierStats | None = None

    def parts(self) -> tuple[CacheStats, PromptCounts, TierStats | None]:
        """:attr:`cache`, :attr:`prompts` and :attr:`shared`, in :meth:`series` order."""
        return self.cache, self.prompts, self.shared

    @staticmethod
    def series(tier: str | None) -> tuple[tuple[CountSeries, ...], ...]:
        """The series of each of :meth:`parts` (the shared tier's named ``tier``; none without)."""
        shared = () if tier is None else TierStats.series(tier)
        return CacheStats.series(), PromptCounts.series(), shared


class PromptCache(Generic[R]):
    """The host prefix cache of one engine rank, called with the engine's requests (``R``).

    Args:
        cache: this rank's arena of checkpoints.
        index: every layer's compressed index keys, ``[S / ratio, Hi, Di]`` a layer, or an
            :class:`IndexAccess` to them (:class:`PromptPools`).
        ratio: tokens a compressed index row covers.
        extras: a request's page extras (``page -> identity``) or why it cannot be keyed (an
            enum member, e.g. a ``qsa_mm_prefix.BypassReason``), asked once per request.
        namespace: a request's namespace (its salt, adapter and extra key applied:
            :meth:`CacheNamespace.for_request`).
        request_id: a request's name: the holder of its load, and in logs.
        state: the engine's recurrent state as segments (None: the model keeps none).
        agree: the minimum over the ranks that serve the same requests (:func:`agree_min`);
            None: this rank alone.
        weights: the served weights' version now, read before every lookup and publish.
        shared: the shared tier below the arena, or None.
        admission: which prefixes are checkpointed (:class:`Admission`).
        on_bypass: called once per request that cannot be keyed, with its reason.
        on_numbers: called with :meth:`numbers` after every call that may have changed them
            (and once here).
    """

    def __init__(
        self,
        cache: HostPrefixCache,
        index: Sequence[torch.Tensor] | IndexAccess,
        ratio: int,
        *,
        extras: Callable[[R], Mapping[int, bytes] | enum.Enum],
        namespace: Callable[[R], CacheNamespace],
        request_id: Callable[[R], Hashable] = id,
        state: StateSegments | None = None,
        agree: Agree | None = None,
        weights: Callable[[], object] = lambda: None,
        shared: SharedCheckpoints | None = None,
        admission: Admission = Admission.ALWAYS,
        on_bypass: Callable[[R, enum.Enum], None] | None = None,
        on_numbers: Callable[[PromptCacheNumbers], None] | None = None,
    ) -> None:
        self.cache = cache
        self.shared = shared
        checkpoints: PromptCheckpoints[torch.Tensor] = PromptCheckpoints(
            cache,
            agree=agree or agree_min(None),
            weights=weights,
            shared=shared,
            admission=admission,
        )
        self.pools = PromptPools(checkpoints, index, ratio, state=state)
        self._keys: PromptKeys[R] = PromptKeys(
            cache.page_size, extras, request_id=request_id, on_bypass=on_bypass
        )
        self._namespace = namespace
        self._request_id = request_id
        self._on_numbers = on_numbers
        # Each live request's longest length offered to publish, by request id.
        self._offered: dict[Hashable, int] = {}
        self._report()

    @classmethod
    def in_host_memory(
        cls,
        budget_bytes: int,
        index: Sequence[torch.Tensor] | IndexAccess,
        ratio: int,
        *,
        max_entries: int,
        page_size: int,
        device: torch.device | str,
        state_sample: Any = None,
        group: Any = None,
        **keywords: Any,
    ) -> PromptCache[R]:
        """A prompt cache over a new arena of ``budget_bytes`` (:class:`HostPrefixCache`).

        Args:
            budget_bytes: the arena's host memory, allocated once (pinned for a CUDA
                ``device``).
            index: as :class:`PromptCache`.
            ratio: as :class:`PromptCache`.
            max_entries: the most checkpoints the arena holds.
            page_size: tokens per page (the engine's page size).
            device: where the engine's pools live; only a CUDA device's tensors are copied on a
                side stream.
            state_sample: one recurrent state as the engine's pool copies it out (the structure
                of :class:`StateSegments`); None: the model keeps none.
            group: the torch.distributed CPU group of the ranks that serve the same requests
                (:func:`agree_min`); None: this rank alone.
            **keywords: :class:`PromptCache`'s other keywords (``extras``, ``namespace``...).

        Raises:
            ArenaAllocationError: the host cannot allocate (or pin) ``budget_bytes``.
        """
        on = torch.device(device)
        cache = HostPrefixCache(
            budget_bytes,
            max_entries=max_entries,
            page_size=page_size,
            device=on if on.type == "cuda" else None,
        )
        state = None if state_sample is None else StateSegments(state_sample)
        prompts: PromptCache[R] = cls(
            cache, index, ratio, state=state, agree=agree_min(group), **keywords
        )
        logger.info(
            "prefix cache: %s of %s host memory, %d checkpoints at most, pages of %d tokens; "
            "admission %s",
            format_bytes(cache.capacity_bytes),
            "pinned" if cache.pinned else "pageable",
            max_entries,
            page_size,
            prompts.checkpoints.admission.value,
        )
        return prompts

    @property
    def checkpoints(self) -> PromptCheckpoints[torch.Tensor]:
        """This rank's agreed calls on the arena."""
        return self.pools.checkpoints

    def numbers(self) -> PromptCacheNumbers:
        """The arena's, the calls' and the shared tier's counts now."""
        shared = None if self.shared is None else self.shared.stats()
        return PromptCacheNumbers(self.cache.stats(), self.checkpoints.counts, shared)

    def key(self, request: R, tokens: Sequence[int]) -> PrefixKey:
        """The key of ``tokens`` (``request``'s first token ids) in ``request``'s namespace.

        Raises:
            InvalidKeyError: ``request`` cannot be keyed (its extras gave a bypass reason).
        """
        return self._keys.key(request, tokens, self._namespace(request))

    def lookup(self, request: R, tokens: Sequence[int]) -> int:
        """Tokens of the longest checkpoint that is a prefix of ``tokens``, agreed (0: a miss).

        ``tokens``: the ids the engine matches (at most the prompt less its last token). A
        request that is not keyed misses, the ranks agreeing all the same.
        """
        if self._keys.bypass(request) is not None:
            hit = self.pools.lookup(len(tokens), None)
        else:
            hit = self.pools.lookup(len(tokens), lambda: self.key(request, tokens))
        self._report()
        return hit

    @property
    def hit_is_shared(self) -> bool:
        """The last :meth:`lookup`'s hit came from the shared tier (not the arena)."""
        return self.shared is not None and self.checkpoints.last_tier == self.shared.tier.name

    def load(self, request: R, tokens: Sequence[int], slots: TokenSlots) -> torch.Tensor | None:
        """Load ``request``'s checkpoint of exactly ``tokens`` into token slots it takes.

        ``tokens``: the request's first token ids, a length :meth:`lookup` agreed on.

        Returns:
            ``[T]`` the slots (:meth:`PromptPools.load`), the request's until its restore; None
            when any rank could not (nothing is held: the request computes its prompt).
        """
        taken = self.pools.load(self._request_id(request), self.key(request, tokens), slots)
        self._report()
        return taken

    def claimed(self, request: R) -> torch.Tensor | None:
        """``[T]`` the token slots of ``request``'s loaded checkpoint, while it waits."""
        return self.checkpoints.claimed(self._request_id(request))

    def restore(
        self,
        request: R,
        stage: Callable[[int], KVLayers],
        filled: Callable[[int, CopyFence], None],
        *,
        put_state: Callable[[Any], None] | None = None,
        state_device: torch.device | str = "cpu",
    ) -> int | None:
        """Restore ``request``'s loaded checkpoint (:meth:`PromptPools.restore`).

        Returns:
            The tokens it held; None when none was loaded for ``request``.
        """
        holder = self._request_id(request)
        tokens = self.pools.restore(
            holder, stage, filled, put_state=put_state, state_device=state_device
        )
        if tokens is not None:
            self._report()
            logger.debug("prefix cache: %r resumes after %d cached tokens", holder, tokens)
        return tokens

    def publishes(self, up_to: int, *, prompt_tokens: int, finished: bool) -> bool:
        """Whether a request's first ``up_to`` written tokens are checkpointed.

        :meth:`PromptPools.publishes`: a live request's prompt, at whole pages.
        """
        return self.pools.publishes(up_to, prompt_tokens=prompt_tokens, finished=finished)

    def publish(
        self,
        request: R,
        tokens: Sequence[int],
        kv: Callable[[], KVLayers],
        token_slots: Callable[[], torch.Tensor],
        state: Callable[[], Any] | None = None,
        *,
        prompt_tokens: int | None = None,
        finished: bool = False,
    ) -> CopyFence | None:
        """Checkpoint ``request``'s first ``len(tokens)`` tokens, if every rank can.

        Every rank that serves ``request`` makes this call alike and takes the same decisions up
        to the gather (length, key, weights, admission), which reads the index first: an index
        read that is collective (:class:`IndexAccess`) is made by every rank or by none.

        Args:
            request: the request whose prompt it is.
            tokens: its first token ids (a length :meth:`publishes` allows, or any written
                length when ``prompt_tokens`` is given).
            kv: each layer's K/V of those tokens, ``[T, Hkv, D]`` a layer (views must stay
                unchanged until the returned fence); read only when the checkpoint is taken.
            token_slots: ``[T]`` the tokens' slots, whose index rows are read.
            state: reads the request's recurrent state (only when the model keeps one).
            prompt_tokens: the request's prompt length: ``tokens`` are what it has written so
                far, checkpointed only where :meth:`publishes` allows (None: already decided).
            finished: the request has ended (with ``prompt_tokens``: nothing is checkpointed).

        A request's length is offered once: an engine may offer a prompt's end twice (an
        overlapped scheduler's offload takes it as the prompt leaves its staging area, and the
        scheduler offers it again with the prefill's result), and the second call, whose K/V
        may be gone, does nothing.

        Returns:
            The copies' fence when every rank committed the checkpoint; None when it was not
            published (offered before, not a length :meth:`publishes` allows, the request is
            not keyed, already cached, no room, or it failed).
        """
        holder = self._request_id(request)
        if self._offered.get(holder, 0) >= len(tokens):
            return None
        self._offered[holder] = len(tokens)
        if prompt_tokens is not None and not self.publishes(
            len(tokens), prompt_tokens=prompt_tokens, finished=finished
        ):
            return None
        if self._keys.bypass(request) is not None:
            return None
        fence = self.checkpoints.publish(
            self.key(request, tokens),
            lambda: self.pools.gather(kv, token_slots(), state),
            holder=holder,
        )
        self._report()
        return fence

    def forget(self, request: R) -> None:
        """``request`` ended: drop its load (its slots go with it) and what it offered."""
        holder = self._request_id(request)
        self._offered.pop(holder, None)
        self.checkpoints.forget(holder)

    def settle(self) -> None:
        """No request is being served: land every checkpoint still being copied."""
        self.cache.drain()
        self._report()

    def invalidate(self) -> int:
        """Drop every checkpoint (a flush); how many were matchable."""
        dropped = self.checkpoints.invalidate()
        self._report()
        return dropped

    def _report(self) -> None:
        if self._on_numbers is not None:
            self._on_numbers(self.numbers())
