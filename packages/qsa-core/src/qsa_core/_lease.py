"""The request lease: the lifecycle of one offloaded request and the slot it owns.

A :class:`LeaseTable` owns ``num_slots`` request slots (host slab, hot cache, tail ring). Each
acquired lease gets the lowest free slot and a generation number that no earlier lease had, so a
handle that outlives its lease (a late callback after an abort, say) can never act on the slot's
next tenant: every operation checks the handle's ``(slot, generation)`` against the live lease.

The lease is a request's one identity on a rank: its slot is the request's row in every store
that keeps per-request state (the offload's arena row, hot caches and tail), its request id is the
engine's, and its *engine slot* (optional) is the engine's own index of the request (SGLang's
``req_pool_idx``), so a batch given by engine slots finds its leases
(:meth:`LeaseTable.at_engine_slot`).

State machine (every other transition raises :class:`~qsa_core.LeaseError`)::

    ALLOCATED -> PREFILLING -> COPYING_TO_HOST -> HOST_READY -> DECODING -> DRAINING -> RELEASED
                 PREFILLING -------------------------------------> DECODING      (stays on device)
    finish: PREFILLING, HOST_READY or DECODING -> DRAINING (never while a copy is in flight)
    abort: any state before DRAINING -> DRAINING (aborted); abort while DRAINING is a no-op

Each state is true when it is entered: a lease is COPYING_TO_HOST from the moment its prompt's
copy to the host is issued until the owner of the copy sees it complete (HOST_READY), and DECODING
once its first decode step is planned with its prompt where that step reads it. A request whose
K/V never leaves the device goes from PREFILLING to DECODING. Decode steps may be queued on the
device behind a copy still in flight (stream order keeps them after it): the lease stays
COPYING_TO_HOST until the copy has completed.

Guarantees: a slot is owned by at most one live (not released) lease, and so is an engine slot; a
lease is released only from DRAINING (its copies have been waited on); releasing returns the slot,
so after every lease is released all slots are free again (nothing leaks); request ids are unique
among live leases.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Final, Protocol

from qsa_core._checks import is_int
from qsa_core._errors import CapacityError, LeaseError

__all__ = (
    "LeaseHandle",
    "LeaseOutcome",
    "LeaseState",
    "LeaseTable",
    "RequestRows",
    "ResidentRows",
    "admit_request",
    "release_request",
)

logger = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    """Phase of one lease."""

    ALLOCATED = "allocated"
    PREFILLING = "prefilling"
    COPYING_TO_HOST = "copying_to_host"
    HOST_READY = "host_ready"
    DECODING = "decoding"
    DRAINING = "draining"
    RELEASED = "released"


class LeaseOutcome(enum.StrEnum):
    """Why a request gave its lease back."""

    FINISHED = "finished"
    ABORTED = "aborted"
    RETRACTED = "retracted"  # the engine took the request back to run it again later

    @property
    def aborted(self) -> bool:
        """The lease ends aborted: anything but a normal finish."""
        return self is not LeaseOutcome.FINISHED

    @classmethod
    def of(cls, *, finished: bool, aborted: bool) -> LeaseOutcome:
        """The outcome of a request that gives its row back.

        Not ``finished``: the engine took it back to run later (RETRACTED); finished by an
        abort: ABORTED; else FINISHED.
        """
        if not finished:
            return cls.RETRACTED
        return cls.ABORTED if aborted else cls.FINISHED


#: The forward transitions from each state; ``abort`` and ``release`` are handled separately.
_NEXT: Final[dict[LeaseState, tuple[LeaseState, ...]]] = {
    LeaseState.ALLOCATED: (LeaseState.PREFILLING,),
    LeaseState.PREFILLING: (
        LeaseState.COPYING_TO_HOST,
        LeaseState.DECODING,
        LeaseState.DRAINING,
    ),
    LeaseState.COPYING_TO_HOST: (LeaseState.HOST_READY,),
    LeaseState.HOST_READY: (LeaseState.DECODING, LeaseState.DRAINING),
    LeaseState.DECODING: (LeaseState.DRAINING,),
    LeaseState.DRAINING: (),
}


@dataclass(frozen=True, slots=True)
class LeaseHandle:
    """Identity of one lease; immutable, safe to pass to callbacks.

    Attributes:
        slot: the request slot in ``[0, num_slots)``: the request's row in every per-request store.
        generation: unique per lease, increasing in acquisition order.
        request_id: the caller's request id.
        engine_slot: the engine's own index of the request (SGLang's ``req_pool_idx``), if given.
    """

    slot: int
    generation: int
    request_id: str
    engine_slot: int | None = None


@dataclass(slots=True)
class _Live:
    handle: LeaseHandle
    state: LeaseState
    aborted: bool = False


class LeaseTable:
    """Slots, live leases and their states.

    Args:
        num_slots: request slots (the most concurrent leases).

    Raises:
        CapacityError: ``num_slots < 1``.
    """

    __slots__ = ("_by_engine_slot", "_by_rid", "_live", "_next_generation", "_num_slots")

    def __init__(self, num_slots: int) -> None:
        if not is_int(num_slots) or num_slots < 1:
            msg = f"num_slots={num_slots!r} is not allowed; it must be a positive integer"
            raise CapacityError(msg)
        self._num_slots = num_slots
        self._live: dict[int, _Live] = {}
        self._by_rid: dict[str, int] = {}
        self._by_engine_slot: dict[int, int] = {}
        self._next_generation = 1

    @property
    def num_slots(self) -> int:
        """Total slots."""
        return self._num_slots

    @property
    def num_free(self) -> int:
        """Slots not owned by a live lease."""
        return self._num_slots - len(self._live)

    @property
    def idle(self) -> bool:
        """No lease is live (every slot is free)."""
        return self.num_free == self._num_slots

    def live_handles(self) -> tuple[LeaseHandle, ...]:
        """Handles of every live lease, by slot."""
        return tuple(self._live[s].handle for s in sorted(self._live))

    def acquire(self, request_id: str, *, engine_slot: int | None = None) -> LeaseHandle:
        """Take the lowest free slot for ``request_id``; the lease starts ALLOCATED.

        Args:
            request_id: the engine's request id.
            engine_slot: the engine's own index of the request, found again by
                :meth:`at_engine_slot` (None: the engine names requests by id only).

        Raises:
            LeaseError: ``request_id`` is not a str, ``engine_slot`` is not a non-negative int,
                no free slot, or ``request_id`` or ``engine_slot`` already belongs to a live lease.
        """
        if not isinstance(request_id, str):  # callers without a type checker
            msg = f"request_id={request_id!r} is not allowed; it must be a str"  # type: ignore[unreachable]
            raise LeaseError(msg)
        if engine_slot is not None and (not is_int(engine_slot) or engine_slot < 0):
            msg = f"engine_slot={engine_slot!r} is not allowed; it must be an integer >= 0 or None"
            raise LeaseError(msg)
        if request_id in self._by_rid:
            msg = (
                f"request {request_id!r} already holds the live lease in slot "
                f"{self._by_rid[request_id]!r}"
            )
            raise LeaseError(msg)
        if engine_slot is not None and engine_slot in self._by_engine_slot:
            holder = self._live[self._by_engine_slot[engine_slot]].handle
            msg = (
                f"engine slot {engine_slot!r} of request {request_id!r} belongs to the live lease "
                f"of request {holder.request_id!r} (slot {holder.slot!r})"
            )
            raise LeaseError(msg)
        slot = next((s for s in range(self._num_slots) if s not in self._live), None)
        if slot is None:
            msg = f"no free slot for request {request_id!r}: all {self._num_slots} slots are leased"
            raise LeaseError(msg)
        handle = LeaseHandle(slot, self._next_generation, request_id, engine_slot)
        self._next_generation += 1
        self._live[slot] = _Live(handle, LeaseState.ALLOCATED)
        self._by_rid[request_id] = slot
        if engine_slot is not None:
            self._by_engine_slot[engine_slot] = slot
        logger.debug(
            "lease acquired: slot=%d generation=%d rid=%r", slot, handle.generation, request_id
        )
        return handle

    def admit(self, request_id: str, engine_slot: int | None = None) -> LeaseHandle:
        """A request starts its prefill: :meth:`acquire`, then PREFILLING.

        Raises:
            LeaseError: as :meth:`acquire`.
        """
        handle = self.acquire(request_id, engine_slot=engine_slot)
        self.begin_prefill(handle)
        return handle

    def find(self, request_id: str) -> LeaseHandle | None:
        """The live lease of ``request_id``, or None."""
        slot = self._by_rid.get(request_id)
        return None if slot is None else self._live[slot].handle

    def at_engine_slot(self, engine_slot: int) -> LeaseHandle | None:
        """The live lease acquired with ``engine_slot``, or None."""
        slot = self._by_engine_slot.get(engine_slot)
        return None if slot is None else self._live[slot].handle

    def state(self, handle: LeaseHandle) -> LeaseState:
        """State of the lease ``handle`` names; RELEASED once it is gone.

        Raises:
            LeaseError: the handle was never issued by this table.
        """
        live = self._live.get(handle.slot)
        if live is not None and live.handle == handle:
            return live.state
        if not 1 <= handle.generation < self._next_generation:
            msg = f"lease handle {handle!r} was never issued by this table"
            raise LeaseError(msg)
        return LeaseState.RELEASED

    def is_aborted(self, handle: LeaseHandle) -> bool:
        """True when the live lease was aborted (it drains, then is released)."""
        return self._get(handle, "is_aborted").aborted

    def advance(self, handle: LeaseHandle, target: LeaseState) -> None:
        """Move a live lease one step forward along the state machine to ``target``.

        Raises:
            LeaseError: stale handle, or ``target`` is not the next state (use :meth:`abort`
                to leave early and :meth:`release` to end a drained lease).
        """
        live = self._get(handle, f"advance to {target.value}")
        expected = _NEXT[live.state]
        if target not in expected:
            allowed = ", ".join(repr(s.value) for s in expected) or "none"
            msg = (
                f"illegal lease transition {live.state.value!r} -> {target.value!r} for "
                f"{handle!r}; allowed next state: {allowed}"
                + ("; call release()" if target is LeaseState.RELEASED else "")
            )
            raise LeaseError(msg)
        live.state = target

    def begin_prefill(self, handle: LeaseHandle) -> None:
        """ALLOCATED -> PREFILLING."""
        self.advance(handle, LeaseState.PREFILLING)

    def begin_copy(self, handle: LeaseHandle) -> None:
        """PREFILLING -> COPYING_TO_HOST."""
        self.advance(handle, LeaseState.COPYING_TO_HOST)

    def finish_copy(self, handle: LeaseHandle) -> None:
        """COPYING_TO_HOST -> HOST_READY."""
        self.advance(handle, LeaseState.HOST_READY)

    def begin_decode(self, handle: LeaseHandle) -> None:
        """HOST_READY -> DECODING, or PREFILLING -> DECODING where the K/V stays on the device."""
        self.advance(handle, LeaseState.DECODING)

    def finish(self, handle: LeaseHandle) -> None:
        """PREFILLING, HOST_READY or DECODING -> DRAINING: the request ended normally.

        A request may end at its first token (from PREFILLING) or before its first decode step
        read the host (HOST_READY), never while its copy to the host is in flight.
        """
        self.advance(handle, LeaseState.DRAINING)

    def abort(self, handle: LeaseHandle) -> None:
        """Any state before DRAINING -> DRAINING, marked aborted; a no-op while DRAINING.

        Raises:
            LeaseError: stale handle.
        """
        live = self._get(handle, "abort")
        if live.state is not LeaseState.DRAINING:
            logger.debug("lease aborted in %s: %r", live.state.value, handle)
            live.state = LeaseState.DRAINING
            live.aborted = True

    def release(self, handle: LeaseHandle) -> None:
        """DRAINING -> RELEASED: the slot becomes free and the handle stale.

        Raises:
            LeaseError: stale handle, or the lease is not DRAINING.
        """
        live = self._get(handle, "release")
        if live.state is not LeaseState.DRAINING:
            msg = (
                f"illegal lease transition {live.state.value!r} -> 'released' for {handle!r}; "
                "a lease is released only from 'draining'"
            )
            raise LeaseError(msg)
        del self._live[handle.slot]
        del self._by_rid[handle.request_id]
        if handle.engine_slot is not None:
            del self._by_engine_slot[handle.engine_slot]

    def end(self, handle: LeaseHandle, *, aborted: bool = False) -> None:
        """The request gave its slot back: DRAINING (finished, or aborted), then RELEASED.

        For an owner with no copy of the lease in flight (a request whose K/V stayed on the
        device); an owner of copies waits for them first.

        Raises:
            LeaseError: stale handle, or a normal end from a state :meth:`finish` refuses.
        """
        if aborted:
            self.abort(handle)
        else:
            self.finish(handle)
        self.release(handle)

    def check_invariants(self) -> None:
        """Verify the table's internal consistency.

        Raises:
            LeaseError: a slot or request id is owned twice, or the indexes disagree.
        """
        if len(self._live) > self._num_slots:
            msg = f"{len(self._live)} live leases exceed {self._num_slots} slots"
            raise LeaseError(msg)
        for slot, live in self._live.items():
            if live.handle.slot != slot or self._by_rid.get(live.handle.request_id) != slot:
                msg = f"slot {slot!r} index disagrees with its lease {live.handle!r}"
                raise LeaseError(msg)
            if (
                live.state is LeaseState.RELEASED
                or not live.handle.generation < self._next_generation
            ):
                msg = f"lease {live.handle!r} in slot {slot!r} is in an impossible state"
                raise LeaseError(msg)
        if len(self._by_rid) != len(self._live):
            msg = f"{len(self._by_rid)} request ids but {len(self._live)} live leases"
            raise LeaseError(msg)
        for engine_slot, slot in self._by_engine_slot.items():
            holder = self._live.get(slot)
            if holder is None or holder.handle.engine_slot != engine_slot:
                msg = f"engine slot {engine_slot!r} index disagrees with lease slot {slot!r}"
                raise LeaseError(msg)

    def _get(self, handle: LeaseHandle, action: str) -> _Live:
        live = self._live.get(handle.slot)
        if live is None or live.handle != handle:
            current = "free" if live is None else f"held by generation {live.handle.generation!r}"
            msg = (
                f"stale lease handle {handle!r} cannot {action}; slot {handle.slot!r} is {current}"
            )
            raise LeaseError(msg)
        return live


class ResidentRows:
    """The leases of requests whose K/V stays on the device (no offload).

    The calls an engine makes over a request's life, the same as
    ``qsa_kernels.offload.OffloadRuntime``'s, so its lifecycle code is one path with or without
    an offload: :meth:`admit` at the first prefill chunk, :meth:`prompt_written` after each
    chunk, :meth:`release` when the request gives its engine slot back.

    Args:
        num_slots: request slots (the engine's request rows).

    Raises:
        CapacityError: ``num_slots < 1``.
    """

    __slots__ = ("leases",)

    def __init__(self, num_slots: int) -> None:
        self.leases = LeaseTable(num_slots)

    def admit(
        self, request_id: str, engine_slot: int, prompt_tokens: int | None = None
    ) -> LeaseHandle:
        """The request's lease, PREFILLING (:meth:`LeaseTable.admit`).

        ``prompt_tokens`` is not needed here: nothing is staged, so :meth:`prompt_written` alone
        tells when the prompt is whole.
        """
        del prompt_tokens
        return self.leases.admit(request_id, engine_slot)

    def prompt_written(self, handle: LeaseHandle, tokens: int, prompt_tokens: int) -> None:
        """``tokens`` of the prompt's ``prompt_tokens`` are in the engine's pool.

        Once the whole prompt is, a PREFILLING lease decodes (nothing is copied); a lease past
        its prompt (a checkpoint while it decodes) is left as it is.

        Raises:
            LeaseError: ``handle`` is not a live lease of :attr:`leases`.
        """
        if tokens >= prompt_tokens and self.leases.state(handle) is LeaseState.PREFILLING:
            self.leases.begin_decode(handle)

    def release(self, handle: LeaseHandle, *, aborted: bool = False) -> None:
        """The request gave its engine slot back: its lease drains and is released.

        Raises:
            LeaseError: as :meth:`LeaseTable.end`.
        """
        self.leases.end(handle, aborted=aborted)


class RequestRows(Protocol):
    """The calls an engine makes over a request's life: :class:`ResidentRows`' (or an offload's)."""

    @property
    def leases(self) -> LeaseTable: ...

    def admit(
        self, request_id: str, engine_slot: int, prompt_tokens: int | None = None
    ) -> LeaseHandle: ...

    def prompt_written(self, handle: LeaseHandle, tokens: int, prompt_tokens: int) -> None: ...

    def release(self, handle: LeaseHandle, *, aborted: bool = False) -> None: ...


def admit_request(
    rows: RequestRows, request_id: str, engine_slot: int, prompt_tokens: int | None = None
) -> LeaseHandle | None:
    """``rows.admit`` of a request's first prefill chunk; None for a later chunk (already leased).

    ``prompt_tokens``: the tokens the request's prefill writes, if the engine knows them at its
    first chunk (an offload then knows, in the forward, when the prompt is staged whole).

    Raises:
        LeaseError: as :meth:`LeaseTable.admit` (no free slot, ``engine_slot`` held by another).
    """
    if rows.leases.find(request_id) is not None:
        return None
    return rows.admit(request_id, engine_slot, prompt_tokens)


def release_request(
    rows: RequestRows, request_id: str, *, finished: bool, aborted: bool
) -> LeaseOutcome:
    """The request gave its engine slot back: ``rows.release`` of its lease, and why.

    ``finished``: the request ended (not retracted to run again); ``aborted``: it ended by an
    abort (:meth:`LeaseOutcome.of`). Anything but a normal finish releases the lease aborted.

    Raises:
        LeaseError: ``request_id`` holds no live lease (it released a slot it never leased).
    """
    handle = rows.leases.find(request_id)
    if handle is None:
        msg = f"request {request_id!r} released a KV row without holding a lease"
        raise LeaseError(msg)
    outcome = LeaseOutcome.of(finished=finished, aborted=aborted)
    rows.release(handle, aborted=outcome.aborted)
    return outcome
