"""Hot-cache residency: the reference contract every hot-cache implementation follows.

Per (request, layer) a hot cache has ``S`` device block slots. Its state is two sequences of
length ``S``:

* ``slot_block[s]``: the block id resident in slot ``s``, or ``-1`` for an empty slot;
* ``slot_stamp[s]``: the step at which slot ``s`` was last used, or ``-1`` for a never-used slot.

One decode step takes ``selected[K]`` (block ids; ``-1`` entries are padding and are ignored
wherever they appear; valid ids must be distinct and in ``[0, num_blocks)``) and a ``step`` stamp
strictly greater than every stamp in the state. Then:

1. Entry ``i`` (valid) is a HIT if some slot ``s`` has ``slot_block[s] == selected[i]``; its slot
   is ``s``.
2. MISSES are the valid non-hit entries, in increasing ``i``.
3. VICTIM candidates are the slots whose block is not among this step's selected ids (empty slots
   included), ordered ascending by the key ``(slot_block[s] != -1, slot_stamp[s], s)``: empty
   slots first by slot index, then occupied slots oldest stamp first, ties by slot index.
4. The ``j``-th miss takes the ``j``-th victim candidate. ``S >= K`` is required, which
   guarantees enough victims; it is checked anyway.
5. New state: each victim slot gets the missed block id; every slot that holds a selected block
   (hit or filled) gets ``slot_stamp = step``; every other slot is unchanged.
6. Outputs: ``selected_slots[K]`` (slot per entry, ``-1`` for padding), the hit entries, the fills
   ``(entry, block id, slot, evicted block id or -1)`` in miss order, and
   ``bytes_moved = misses × bytes_per_block`` when a bytes-per-block figure is given.

Violations raise :class:`~qsa_core.ResidencyError` (a ``ValueError``) naming the offending value
and its position. :func:`plan_residency_step` is pure: it returns a new state and never mutates
its input.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, SupportsIndex

from qsa_core._checks import is_int
from qsa_core._errors import ResidencyError

__all__ = (
    "MAX_HOT_SLOTS",
    "HotCacheState",
    "ResidencyFill",
    "ResidencyPlan",
    "plan_residency_batch",
    "plan_residency_step",
)


#: Most slots one hot cache is built with (the block top-k is 512; 1,048,576 is a mistake's size).
MAX_HOT_SLOTS: Final = 1 << 20


def _check_slot_int(name: str, slot: int, value: object) -> None:
    if not is_int(value):
        msg = f"{name}[{slot}]={value!r} is not an integer (bool and float are not)"
        raise ResidencyError(msg)


def _as_int_tuple(name: str, values: Iterable[object]) -> tuple[int, ...]:
    out: list[int] = []
    for position, value in enumerate(values):
        # Accept numpy integer scalars and 0-d arrays through __index__, reject floats and bools.
        if not isinstance(value, SupportsIndex) or isinstance(value, bool):
            msg = f"{name}[{position}]={value!r} is not an integer"
            raise ResidencyError(msg)
        out.append(operator.index(value))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class HotCacheState:
    """Residency state of one (request, layer) hot cache with ``S`` slots.

    Attributes:
        slot_block: ``[S]`` block id per slot, ``-1`` for empty. Occupied ids are distinct and
            non-negative.
        slot_stamp: ``[S]`` last-use step per slot, ``-1`` for never used; each is ``>= -1``.
    """

    slot_block: tuple[int, ...]
    slot_stamp: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.slot_block) != len(self.slot_stamp):
            msg = (
                f"slot_block has {len(self.slot_block)!r} slots but slot_stamp has "
                f"{len(self.slot_stamp)!r}; they must have the same length"
            )
            raise ResidencyError(msg)
        if not self.slot_block:
            msg = "a hot cache needs at least one slot; got 0"
            raise ResidencyError(msg)
        seen: dict[int, int] = {}
        for slot, block in enumerate(self.slot_block):
            _check_slot_int("slot_block", slot, block)
            if block < -1:
                msg = f"slot_block[{slot}]={block!r} is not allowed; allowed: -1 or a block id >= 0"
                raise ResidencyError(msg)
            if block >= 0:
                if block in seen:
                    msg = (
                        f"slot_block[{slot}]={block!r} is already resident in slot "
                        f"{seen[block]!r}; a block occupies at most one slot"
                    )
                    raise ResidencyError(msg)
                seen[block] = slot
        for slot, stamp in enumerate(self.slot_stamp):
            _check_slot_int("slot_stamp", slot, stamp)
            if stamp < -1:
                msg = f"slot_stamp[{slot}]={stamp!r} is not allowed; allowed: -1 or a step >= 0"
                raise ResidencyError(msg)

    @classmethod
    def empty(cls, num_slots: int) -> HotCacheState:
        """A cache of ``num_slots`` empty, never-used slots."""
        if not is_int(num_slots) or not 1 <= num_slots <= MAX_HOT_SLOTS:
            msg = (
                f"num_slots={num_slots!r} is not allowed; allowed: an integer in 1..{MAX_HOT_SLOTS}"
            )
            raise ResidencyError(msg)
        return cls((-1,) * num_slots, (-1,) * num_slots)

    @classmethod
    def from_sequences(
        cls, slot_block: Iterable[object], slot_stamp: Iterable[object]
    ) -> HotCacheState:
        """Build a state from integer sequences (lists, numpy int arrays, ``tensor.tolist()``)."""
        return cls(_as_int_tuple("slot_block", slot_block), _as_int_tuple("slot_stamp", slot_stamp))

    @property
    def num_slots(self) -> int:
        """``S``."""
        return len(self.slot_block)

    @property
    def resident_blocks(self) -> frozenset[int]:
        """Block ids currently resident."""
        return frozenset(block for block in self.slot_block if block >= 0)

    def slot_of(self, block: int) -> int:
        """Slot holding ``block``, or ``-1`` when it is not resident."""
        try:
            return self.slot_block.index(block) if block >= 0 else -1
        except ValueError:
            return -1

    def to_lists(self) -> tuple[list[int], list[int]]:
        """``(slot_block, slot_stamp)`` as fresh lists (for comparing with kernel state)."""
        return list(self.slot_block), list(self.slot_stamp)


@dataclass(frozen=True, slots=True)
class ResidencyFill:
    """One miss: ``block`` is copied into ``slot``, replacing ``evicted`` (``-1`` if empty).

    Attributes:
        entry: position ``i`` of the miss in ``selected``.
        block: the missed block id.
        slot: the victim slot that receives it.
        evicted: the block id the slot held before, or ``-1``.
    """

    entry: int
    block: int
    slot: int
    evicted: int


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    """Outcome of one decode step on one hot cache.

    Attributes:
        state: the new state (the input state is untouched).
        selected_slots: ``[K]`` slot per selected entry, ``-1`` for padding entries.
        hit_entries: entry positions that hit, ascending.
        fills: one :class:`ResidencyFill` per miss, in miss (entry) order.
        bytes_moved: ``len(fills) × bytes_per_block`` (bytes), or ``None`` when no figure was given.
    """

    state: HotCacheState
    selected_slots: tuple[int, ...]
    hit_entries: tuple[int, ...]
    fills: tuple[ResidencyFill, ...]
    bytes_moved: int | None

    @property
    def num_hits(self) -> int:
        """Valid entries already resident."""
        return len(self.hit_entries)

    @property
    def num_misses(self) -> int:
        """Valid entries that had to be filled."""
        return len(self.fills)


def plan_residency_step(
    state: HotCacheState,
    selected: Sequence[object],
    step: int,
    *,
    num_blocks: int,
    bytes_per_block: int | None = None,
) -> ResidencyPlan:
    """Resolve one decode step's selection against a hot cache (the contract in the module doc).

    Args:
        state: the cache before the step (``S`` slots).
        selected: ``[K]`` block ids, ``-1`` = padding anywhere; valid ids distinct, in
            ``[0, num_blocks)``. ``K <= S``.
        step: this step's stamp; strictly greater than every stamp in ``state``.
        num_blocks: blocks the request has (exclusive upper bound of valid ids).
        bytes_per_block: bytes one fill moves (e.g. ``QSAProfile.bytes_per_block``); optional.

    Returns:
        The new state, the slot of every entry, the hits, the fills and the bytes moved.

    Raises:
        ResidencyError: ``K > S``, a bad id (naming value and position), a duplicate id, a
            non-increasing ``step``, or not enough victims.
    """
    ids = _as_int_tuple("selected", selected)
    num_slots = state.num_slots
    if len(ids) > num_slots:
        msg = (
            f"selected has K={len(ids)!r} entries but the hot cache has S={num_slots!r} slots; "
            "S >= K is required"
        )
        raise ResidencyError(msg)
    if not is_int(num_blocks) or num_blocks < 0:
        msg = f"num_blocks={num_blocks!r} is not allowed; it must be a non-negative integer"
        raise ResidencyError(msg)
    if not is_int(step):
        msg = f"step={step!r} is not an integer"
        raise ResidencyError(msg)
    newest = max(state.slot_stamp)
    if step <= newest or step < 0:
        msg = (
            f"step={step!r} is not allowed; it must be >= 0 and greater than every stamp in "
            f"the state (newest: {newest!r})"
        )
        raise ResidencyError(msg)
    if bytes_per_block is not None and (not is_int(bytes_per_block) or bytes_per_block < 0):
        msg = f"bytes_per_block={bytes_per_block!r} is not allowed; it must be an integer >= 0"
        raise ResidencyError(msg)

    first_seen: dict[int, int] = {}
    for position, block in enumerate(ids):
        if block == -1:
            continue
        if not 0 <= block < num_blocks:
            msg = (
                f"selected[{position}]={block!r} is not allowed; allowed: -1 (padding) or a "
                f"block id in [0, {num_blocks})"
            )
            raise ResidencyError(msg)
        if block in first_seen:
            msg = (
                f"selected[{position}]={block!r} duplicates selected[{first_seen[block]}]; "
                "valid ids must be distinct"
            )
            raise ResidencyError(msg)
        first_seen[block] = position

    slot_of_block = {block: slot for slot, block in enumerate(state.slot_block) if block >= 0}
    selected_slots = [-1] * len(ids)
    hit_entries: list[int] = []
    miss_entries: list[int] = []
    for position, block in enumerate(ids):
        if block == -1:
            continue
        slot = slot_of_block.get(block, -1)
        if slot >= 0:
            selected_slots[position] = slot
            hit_entries.append(position)
        else:
            miss_entries.append(position)

    victims = sorted(
        (s for s in range(num_slots) if state.slot_block[s] not in first_seen),
        key=lambda s: (state.slot_block[s] != -1, state.slot_stamp[s], s),
    )
    if len(victims) < len(miss_entries):
        msg = (
            f"{len(miss_entries)!r} misses but only {len(victims)!r} victim slots; the hot cache "
            f"of S={num_slots!r} slots cannot hold this selection"
        )
        raise ResidencyError(msg)

    new_block = list(state.slot_block)
    new_stamp = list(state.slot_stamp)
    fills: list[ResidencyFill] = []
    for position, slot in zip(miss_entries, victims, strict=False):
        block = ids[position]
        fills.append(ResidencyFill(position, block, slot, state.slot_block[slot]))
        new_block[slot] = block
        selected_slots[position] = slot
    for slot in selected_slots:
        if slot >= 0:
            new_stamp[slot] = step

    return ResidencyPlan(
        state=HotCacheState(tuple(new_block), tuple(new_stamp)),
        selected_slots=tuple(selected_slots),
        hit_entries=tuple(hit_entries),
        fills=tuple(fills),
        bytes_moved=None if bytes_per_block is None else len(fills) * bytes_per_block,
    )


def plan_residency_batch(
    states: Sequence[HotCacheState],
    selected: Sequence[Sequence[object]],
    step: int,
    *,
    num_blocks: Sequence[int],
    bytes_per_block: int | None = None,
) -> tuple[ResidencyPlan, ...]:
    """Apply :func:`plan_residency_step` to many (request, layer) caches with one stamp.

    Args:
        states: ``[R]`` caches, one per (request, layer) row.
        selected: ``[R, K]`` block ids per row (``-1`` padding).
        step: the shared stamp.
        num_blocks: ``[R]`` block count per row.
        bytes_per_block: bytes one fill moves; optional.

    Raises:
        ResidencyError: the three sequences differ in length, or any row violates the contract.
    """
    if not len(states) == len(selected) == len(num_blocks):
        msg = (
            f"states, selected and num_blocks must have one entry per row; got "
            f"{len(states)!r}, {len(selected)!r} and {len(num_blocks)!r}"
        )
        raise ResidencyError(msg)
    return tuple(
        plan_residency_step(s, row, step, num_blocks=n, bytes_per_block=bytes_per_block)
        for s, row, n in zip(states, selected, num_blocks, strict=True)
    )
