"""What a serving engine does with the cache for its prompts, every decision agreed by its ranks.

A checkpoint of a prompt's first ``T`` tokens (a whole number of pages) holds the model's state
at that boundary as named segments: each attention layer's K/V (``k.<i>`` and ``v.<i>``,
:func:`kv_segments`) and whatever else the engine's model keeps (an index, a recurrent state).
:class:`PromptCheckpoints` runs the engine's four calls on a :class:`HostPrefixCache`:

- :meth:`~PromptCheckpoints.lookup`: the longest checkpoint of a prompt;
- :meth:`~PromptCheckpoints.load`: pin it for one request and let the engine claim what it
  needs for it (token slots, rows it fills at once), or give everything back; the pin is held
  until the request's restore (:meth:`~PromptCheckpoints.take`) or until it goes
  (:meth:`~PromptCheckpoints.forget`);
- :meth:`~PromptCheckpoints.restore_kv`: the K/V layer by layer, each layer's copies fenced on
  their own so the engine's layers before it run meanwhile;
- :meth:`~PromptCheckpoints.publish`: a checkpoint of the segments the engine gathers, when the
  admission policy lets it in (:class:`Admission`: every prefix, or only a prefix some request
  reached before).

Tensor-parallel ranks each hold their own cache, and a rank-local eviction or a full arena must
never split them: every hit length, load and publish goes through ``agree`` (the minimum over
the ranks, :func:`agree_min`), so all ranks take the same branch. A new weights version (read
through ``weights`` before every lookup and publish) drops every checkpoint: none outlives the
weights that computed it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Final, Generic, TypeVar

import torch
import xxhash

from qsa_core import CountSeries
from qsa_hostcache._arena import CopyFence
from qsa_hostcache._cache import HostPrefixCache, Lease, PublishTicket
from qsa_hostcache._errors import CheckpointTooLarge, HostCacheError
from qsa_hostcache._keys import PrefixKey
from qsa_hostcache._segments import kv_segments, prompt_segment_spec, segment_buffer
from qsa_hostcache._shared import SharedCheckpoints

__all__ = (
    "Admission",
    "Agree",
    "Claim",
    "PromptCheckpoints",
    "PromptCounts",
    "agree_min",
    "kv_segments",
)

logger = logging.getLogger(__name__)

#: The minimum of an int over the ranks that share a decision (each rank calls it with its own).
Agree = Callable[[int], int]

T = TypeVar("T")

#: Most write-throughs to the shared tier in flight at once; a checkpoint beyond stays in RAM.
_MAX_WRITES: Final = 4
#: Prefixes :attr:`Admission.SECOND` remembers having seen once (the least recent are forgotten).
SEEN_PREFIXES: Final = 65_536


class Admission(enum.Enum):
    """Which prefixes :meth:`PromptCheckpoints.publish` checkpoints.

    Attributes:
        ALWAYS: every prefix the engine offers (a conversation's next turn finds its last one).
        SECOND: a prefix the second time a request reaches it (SGLang HiCache's
            ``write_through_selective`` for prompts): a workload that never repeats a prefix
            copies nothing; the first request of a shared prefix does not checkpoint it, the
            second does, the third loads it.
    """

    ALWAYS = "always"
    SECOND = "second"


class _SeenOnce:
    """The prefixes offered once and not checkpointed, as ``(pages, chained hash)``; bounded LRU."""

    def __init__(self, capacity: int = SEEN_PREFIXES) -> None:
        self._capacity = capacity
        self._seen: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()

    def second_time(self, key: PrefixKey) -> bool:
        """True if ``key`` was offered before (it is forgotten); else remember it, False."""
        pages = key.num_pages
        mark = (pages, key.page_hashes()[pages - 1])
        if mark in self._seen:
            del self._seen[mark]
            return True
        self._seen[mark] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class Claim(Generic[T]):
    """What an engine took for a loaded checkpoint (e.g. token slots), and how to give it back."""

    value: T
    undo: Callable[[], None]


@dataclasses.dataclass(frozen=True, slots=True)
class _Load(Generic[T]):
    lease: Lease
    claim: Claim[T]


def _alone(value: int) -> int:
    return value


def agree_min(group: Any) -> Agree:
    """The :data:`Agree` of a torch.distributed CPU ``group`` (one all-reduce MIN a call).

    ``None`` (one rank) agrees with itself.
    """
    if group is None:
        return _alone

    def agree(value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
        return int(t.item())

    return agree


_COUNT_HELP: Final = {
    "loads": "Requests that resumed from a checkpoint (their tokens count as cached).",
    "loaded_tokens": "Prompt tokens served from checkpoints instead of computed.",
    "load_back_failures": "Hits that could not be loaded back (the request recomputed its prompt).",
    "publish_errors": "Checkpoints that failed while being written (the request was served).",
    "deferred": "Prefixes offered for the first time and not checkpointed (admission second).",
}


@dataclasses.dataclass(frozen=True, slots=True)
class PromptCounts:
    """What the engine's calls did, beyond the cache's own :class:`CacheStats` (all counters).

    Attributes:
        loads: prompts that resumed from a checkpoint.
        loaded_tokens: their tokens, served from checkpoints instead of computed.
        load_back_failures: hits that could not be loaded on every rank (the prompt was
            computed).
        publish_errors: checkpoints that failed while being gathered or written (logged; the
            request was served either way).
        deferred: prefixes offered for the first time and not checkpointed
            (:attr:`Admission.SECOND`).
    """

    loads: int = 0
    loaded_tokens: int = 0
    load_back_failures: int = 0
    publish_errors: int = 0
    deferred: int = 0

    @staticmethod
    def series() -> tuple[CountSeries, ...]:
        """Every field, in declaration order, as a counter with its help text (named as it)."""
        return tuple(
            CountSeries(f.name, f.name, True, _COUNT_HELP[f.name])
            for f in dataclasses.fields(PromptCounts)
        )


class PromptCheckpoints(Generic[T]):
    """A :class:`HostPrefixCache` as a serving engine's ranks use it for their prompts.

    ``T`` is what the engine claims for a loaded checkpoint (:class:`Claim`).

    Args:
        cache: this rank's checkpoints.
        agree: the minimum over the ranks that serve the same requests (:func:`agree_min`);
            by default this rank alone.
        weights: the served weights' version now, read before every lookup and publish.
        shared: a shared tier below the arena: a lookup the arena cannot answer in full asks
            it for a longer checkpoint (copied into the arena, then loaded as any other), and
            every checkpoint published is written through to it on a thread of its own. Its
            objects are scoped by the weights' version.
        admission: which prefixes :meth:`publish` checkpoints. The ranks take the same decision
            (they offer the same prefixes in the same order).
    """

    def __init__(
        self,
        cache: HostPrefixCache,
        *,
        agree: Agree = _alone,
        weights: Callable[[], object] = lambda: None,
        shared: SharedCheckpoints | None = None,
        admission: Admission = Admission.ALWAYS,
    ) -> None:
        self.cache = cache
        self.shared = shared
        self.admission = admission
        self._seen_once = _SeenOnce()
        self._agree = agree
        self._weights = weights
        self._version = weights()
        self._counts = PromptCounts()
        self._loads: dict[Hashable, _Load[T]] = {}
        self.last_tier: str | None = None
        self._writes: list[threading.Thread] = []
        if shared is not None:
            shared.scope = _scope(self._version)

    @property
    def counts(self) -> PromptCounts:
        """What the calls did so far."""
        return self._counts

    def lookup(self, key: PrefixKey | None) -> int:
        """Tokens of the longest checkpoint that is a prefix of ``key``, agreed (0 on a miss).

        ``None``: this prompt is not keyed (every rank says so); the ranks still agree.
        """
        self._check_weights()
        found = 0
        tier = None
        if key is not None and key.num_tokens >= self.cache.page_size:
            match = self.cache.match(key, max_tokens=key.num_tokens)
            found = 0 if match is None else match.num_tokens
            tier = None if match is None else "ram"
            if self.shared is not None and found < key.num_pages * key.page_size:
                promoted = self._promote(key, found // key.page_size + 1)
                if promoted:
                    found, tier = promoted, self.shared.tier.name
        agreed = self._agree(found)
        self.last_tier = tier if agreed else None
        return agreed

    def load(
        self, holder: Hashable, key: PrefixKey, claim: Callable[[Lease], Claim[T] | None]
    ) -> T | None:
        """Pin the checkpoint of exactly ``key``'s tokens for ``holder``; the engine claims for it.

        Args:
            holder: the request the checkpoint is loaded for (its id).
            key: the prompt's first tokens (a length :meth:`lookup` agreed on).
            claim: called with the lease when this rank holds the checkpoint; takes what the
                engine needs for it (slots, rows it restores at once) and returns it with how to
                give it back, or None when it cannot (it gives back what it took before raising).

        Returns:
            The claim's value when every rank claimed (the pin is held for :meth:`take`); None
            when any could not: nothing is held on any rank, and the prompt is computed.
        """
        lease: Lease | None = None
        claimed: Claim[T] | None = None
        try:
            lease = self.cache.acquire(key, max_tokens=key.num_tokens)
            if lease is not None and lease.match.num_tokens == key.num_tokens:
                claimed = claim(lease)
        except (HostCacheError, RuntimeError):
            logger.exception(
                "prefix cache: loading %d tokens for %r failed", key.num_tokens, holder
            )
        if self._agree(int(claimed is not None)) != 1:
            if claimed is not None:
                claimed.undo()
            if lease is not None:
                lease.release()
            self._count(load_back_failures=self._counts.load_back_failures + 1)
            logger.info("prefix cache: %r recomputes its %d cached tokens", holder, key.num_tokens)
            return None
        assert lease is not None
        assert claimed is not None
        self._loads[holder] = _Load(lease, claimed)
        self._count(
            loads=self._counts.loads + 1,
            loaded_tokens=self._counts.loaded_tokens + key.num_tokens,
        )
        return claimed.value

    def claimed(self, holder: Hashable) -> T | None:
        """What was claimed for ``holder``'s loaded checkpoint, while it waits for its restore."""
        load = self._loads.get(holder)
        return None if load is None else load.claim.value

    def take(self, holder: Hashable) -> Lease | None:
        """The pin of ``holder``'s loaded checkpoint, for its restore (release it once issued)."""
        load = self._loads.pop(holder, None)
        return None if load is None else load.lease

    def forget(self, holder: Hashable) -> None:
        """``holder`` went before its restore: unpin its checkpoint (its claim goes with it)."""
        load = self._loads.pop(holder, None)
        if load is not None:
            load.lease.release()

    def restore(self, lease: Lease, into: Mapping[str, torch.Tensor]) -> None:
        """Restore segments into ``into`` and order the current stream after the copies."""
        self.cache.restore(lease, into).wait()

    def restore_new(
        self, lease: Lease, names: Iterable[str], device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """The segments ``names`` in new tensors on ``device``, as they were published.

        Each tensor has its segment's published dtype and shape; the current stream is ordered
        after the copies (:meth:`restore`).

        Raises:
            SegmentError: a segment was published without a dtype or shape, or is not in the
                checkpoint.
        """
        into = {name: segment_buffer(lease.match.segment(name), device) for name in names}
        self.restore(lease, into)
        return into

    def restore_kv(
        self,
        lease: Lease,
        k_layers: Sequence[torch.Tensor],
        v_layers: Sequence[torch.Tensor],
        filled: Callable[[int, CopyFence], None],
    ) -> None:
        """Restore each layer's K/V by copies of its own; ``filled(layer, fence)`` for each.

        The engine waits on a layer's fence where that layer first reads its K/V, so the
        copies of later layers overlap the compute of earlier ones.
        """
        for layer, (k, v) in enumerate(zip(k_layers, v_layers, strict=True)):
            filled(layer, self.cache.restore(lease, kv_segments([k], [v], first=layer)))

    def publish(
        self,
        key: PrefixKey,
        gather: Callable[[], Mapping[str, torch.Tensor]],
        *,
        holder: Hashable = None,
    ) -> CopyFence | None:
        """Checkpoint ``key``'s tokens from the segments ``gather`` returns, if every rank can.

        Args:
            key: the prompt's first tokens, a whole number of pages.
            gather: the checkpoint's segments, called only on this path (views are fine: they
                must stay unchanged until the returned fence).
            holder: the request whose prompt it is, for the log.

        Returns:
            The copies' fence when the checkpoint was committed on every rank (matchable once
            its copies finish); None when it was skipped (not admitted yet, already cached, no
            room on some rank, too large) or failed (logged, counted; the request is served
            either way).
        """
        self._check_weights()
        if self.admission is Admission.SECOND and not self._seen_once.second_time(key):
            self._count(deferred=self._counts.deferred + 1)
            return None
        ticket = None
        sources: Mapping[str, torch.Tensor] = {}
        try:
            sources = gather()
            ticket = self.cache.reserve(
                key, [prompt_segment_spec(name, t) for name, t in sources.items()]
            )
        except CheckpointTooLarge as exc:
            logger.warning("prefix cache: %r: %s", holder, exc)
        except (HostCacheError, RuntimeError):
            logger.exception(
                "prefix cache: cannot checkpoint %r at %d tokens", holder, key.num_tokens
            )
            self._count(publish_errors=self._counts.publish_errors + 1)
        if self._agree(int(ticket is not None)) != 1:
            if ticket is not None:
                ticket.abort()
            return None
        assert ticket is not None
        try:
            fence = ticket.write(sources)
            ticket.commit()
        except (HostCacheError, RuntimeError):
            logger.exception(
                "prefix cache: checkpoint of %r at %d tokens failed", holder, key.num_tokens
            )
            ticket.abort()
            self._count(publish_errors=self._counts.publish_errors + 1)
            return None
        if self.shared is not None:
            self._write_through(key, ticket, holder)
        logger.debug(
            "prefix cache: %r checkpointed at %d tokens (%d bytes)",
            holder,
            key.num_tokens,
            sum(t.numel() * t.element_size() for t in sources.values()),
        )
        return fence

    def flush_shared(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` seconds per write-through in flight; True if none is left."""
        for thread in list(self._writes):
            thread.join(timeout_s)
        self._writes = [t for t in self._writes if t.is_alive()]
        return not self._writes

    def _promote(self, key: PrefixKey, min_pages: int) -> int:
        """Copy the shared tier's longest checkpoint of ``key`` into the arena; its tokens or 0."""
        assert self.shared is not None
        hit = self.shared.lookup(key, min_pages=min_pages)
        if hit is None:
            return 0
        try:
            ticket = self.cache.reserve(
                hit.key, [prompt_segment_spec(n, t) for n, t in hit.segments.items()]
            )
            if ticket is None:
                return 0
            try:
                ticket.write(hit.segments)
                ticket.commit()
            except BaseException:
                ticket.abort()
                raise
        except (HostCacheError, RuntimeError):
            logger.exception("prefix cache: cannot copy a shared checkpoint into the arena")
            return 0
        return hit.num_tokens if ticket.wait() else 0

    def _write_through(self, key: PrefixKey, ticket: PublishTicket, holder: Hashable) -> None:
        """Write the checkpoint of ``key`` to the shared tier once its copies are done."""
        shared = self.shared
        assert shared is not None

        def write() -> None:
            try:
                if not ticket.wait():
                    return
                lease = self.cache.acquire(key, max_tokens=key.num_tokens)
                if lease is None or lease.match.num_tokens != key.num_tokens:
                    if lease is not None:
                        lease.release()
                    return
                with lease:
                    names = [s.name for s in lease.match.segments]
                    segments = self.restore_new(lease, names, "cpu")
                shared.write(key, segments)
            except Exception:
                logger.exception(
                    "prefix cache: writing %r's checkpoint of %d tokens to the shared tier failed",
                    holder,
                    key.num_tokens,
                )

        self._writes = [t for t in self._writes if t.is_alive()]
        if len(self._writes) >= _MAX_WRITES:
            logger.info(
                "prefix cache: %d write-throughs in flight; %r's checkpoint of %d tokens stays in "
                "the arena only",
                len(self._writes),
                holder,
                key.num_tokens,
            )
            return
        thread = threading.Thread(target=write, name="qsa-hostcache-write-through", daemon=True)
        self._writes.append(thread)
        thread.start()

    def invalidate(self) -> int:
        """Drop every checkpoint and every pending load's pin; how many checkpoints matched."""
        for load in self._loads.values():
            load.lease.release()
        self._loads.clear()
        return self.cache.invalidate_all()

    def _check_weights(self) -> None:
        """Drop every checkpoint once the served weights' version changed."""
        now = self._weights()
        if now != self._version:
            dropped = self.invalidate()
            logger.info(
                "prefix cache: weights %r replaced %r; %d checkpoints dropped",
                now,
                self._version,
                dropped,
            )
            self._version = now
            if self.shared is not None:
                self.shared.scope = _scope(now)

    def _count(self, **changes: int) -> None:
        self._counts = dataclasses.replace(self._counts, **changes)


def _scope(version: object) -> str:
    """The shared tier's scope of checkpoints computed by weights of ``version``."""
    return "w" + xxhash.xxh3_64_hexdigest(repr(version).encode())
