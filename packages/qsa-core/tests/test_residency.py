"""The hot-cache residency contract: scenarios, errors and properties under random steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_core import (
    HotCacheState,
    ResidencyError,
    ResidencyFill,
    plan_residency_batch,
    plan_residency_step,
)


@dataclass(frozen=True)
class Expected:
    slots: tuple[int, ...]
    hits: tuple[int, ...]
    fills: tuple[tuple[int, int, int], ...]  # (block, slot, evicted)
    blocks: tuple[int, ...]
    stamps: tuple[int, ...]


def _check(
    plan_blocks: list[int],
    plan_stamps: list[int],
    selected: list[int],
    step: int,
    expected: Expected,
) -> None:
    state = HotCacheState.from_sequences(plan_blocks, plan_stamps)
    plan = plan_residency_step(state, selected, step, num_blocks=100, bytes_per_block=2048)
    assert plan.selected_slots == expected.slots
    assert plan.hit_entries == expected.hits
    assert tuple((f.block, f.slot, f.evicted) for f in plan.fills) == expected.fills
    assert plan.state.slot_block == expected.blocks
    assert plan.state.slot_stamp == expected.stamps
    assert plan.bytes_moved == 2048 * len(expected.fills)


def test_cold_cache_fills_empty_slots_in_slot_order() -> None:
    """An empty cache takes misses into slots 0, 1, ... in entry order."""
    # select [7, 3] into 4 empty slots -> 7 to slot 0, 3 to slot 1
    _check(
        [-1] * 4,
        [-1] * 4,
        [7, 3],
        0,
        Expected((0, 1), (), ((7, 0, -1), (3, 1, -1)), (7, 3, -1, -1), (0, 0, -1, -1)),
    )


def test_hits_keep_their_slot_and_refresh_the_stamp() -> None:
    """A hit maps to its resident slot and only selected slots get the new stamp."""
    # slots hold [5, 6, 7] stamped [1, 2, 3]; select [7, 5] at step 4 -> both hit
    _check([5, 6, 7], [1, 2, 3], [7, 5], 4, Expected((2, 0), (0, 1), (), (5, 6, 7), (4, 2, 4)))


def test_empty_slots_are_victims_before_occupied_ones() -> None:
    """An empty slot is used before any occupied slot, even a very old one."""
    # slot 1 is empty; slot 0 holds an old block -> miss goes to slot 1
    _check(
        [9, -1, 8],
        [0, -1, 5],
        [8, 1],
        6,
        Expected((2, 1), (0,), ((1, 1, -1),), (9, 1, 8), (0, 6, 6)),
    )


def test_oldest_stamp_is_evicted_first_with_ties_by_slot() -> None:
    """Occupied victims go oldest stamp first; equal stamps by slot index."""
    # stamps [3, 1, 1, 2]; select [20, 21, 22] -> slots 1, 2 (stamp 1), then 3 (stamp 2)
    _check(
        [10, 11, 12, 13],
        [3, 1, 1, 2],
        [20, 21, 22],
        4,
        Expected(
            (1, 2, 3), (), ((20, 1, 11), (21, 2, 12), (22, 3, 13)), (10, 20, 21, 22), (3, 4, 4, 4)
        ),
    )


def test_selected_blocks_are_never_victims_even_if_oldest() -> None:
    """A block selected this step stays although it is the oldest resident."""
    # slot 0 holds 10 with the oldest stamp and is selected; miss 30 evicts slot 1
    _check(
        [10, 11, 12],
        [0, 1, 2],
        [30, 10],
        3,
        Expected((1, 0), (1,), ((30, 1, 11),), (10, 30, 12), (3, 3, 2)),
    )


def test_padding_is_ignored_wherever_it_appears() -> None:
    """-1 entries anywhere map to slot -1 and touch nothing."""
    _check(
        [4, -1, -1],
        [0, -1, -1],
        [-1, 4, -1],
        1,
        Expected((-1, 0, -1), (1,), (), (4, -1, -1), (1, -1, -1)),
    )


@pytest.mark.parametrize(
    ("selected", "pattern"),
    [
        ([1, 100], r"selected\[1\]=100 .*\[0, 100\)"),
        ([-2], r"selected\[0\]=-2"),
        ([3, 4, 3], r"selected\[2\]=3 duplicates selected\[0\]"),
        ([1.0], r"selected\[0\]=1.0 is not an integer"),
    ],
)
def test_bad_selection_names_value_and_position(selected: list[object], pattern: str) -> None:
    """Out-of-range, negative, duplicate and non-integer ids are rejected by position."""
    with pytest.raises(ResidencyError, match=pattern):
        plan_residency_step(HotCacheState.empty(4), selected, 0, num_blocks=100)


@pytest.mark.parametrize(
    ("blocks", "stamps", "pattern"),
    [
        ((True,), (0,), r"slot_block\[0\]=True is not an integer"),
        ((0, 0.5), (0, 1), r"slot_block\[1\]=0.5 is not an integer"),
        ((3,), (1.0,), r"slot_stamp\[0\]=1.0 is not an integer"),
    ],
)
def test_a_state_of_non_integer_ids_or_stamps_is_refused_by_position(
    blocks: tuple[object, ...], stamps: tuple[object, ...], pattern: str
) -> None:
    with pytest.raises(ResidencyError, match=pattern):
        HotCacheState(blocks, stamps)  # type: ignore[arg-type]


def test_step_must_exceed_every_stamp() -> None:
    """A step equal to the newest stamp is rejected."""
    state = HotCacheState((1, 2), (5, 7))
    with pytest.raises(ResidencyError, match=r"step=7 .*newest: 7"):
        plan_residency_step(state, [1], 7, num_blocks=10)


def test_more_entries_than_slots_is_rejected() -> None:
    """K > S is rejected even if most entries are padding."""
    with pytest.raises(ResidencyError, match=r"K=3 .*S=2"):
        plan_residency_step(HotCacheState.empty(2), [1, -1, -1], 0, num_blocks=10)


def test_state_rejects_duplicate_resident_blocks() -> None:
    """A block resident in two slots is an invalid state."""
    with pytest.raises(ResidencyError, match=r"slot_block\[2\]=4 is already resident in slot 0"):
        HotCacheState((4, 5, 4), (0, 0, 0))


def test_state_round_trips_through_numpy() -> None:
    """A state built from numpy int64 arrays converts back to equal lists."""
    blocks = np.array([3, -1, 9], dtype=np.int64)
    stamps = np.array([2, -1, 4], dtype=np.int64)
    state = HotCacheState.from_sequences(blocks, stamps)
    assert state.to_lists() == ([3, -1, 9], [2, -1, 4])
    assert state.slot_of(9) == 2
    assert state.slot_of(5) == -1


def test_plan_does_not_mutate_its_input() -> None:
    """The input state is unchanged after planning."""
    state = HotCacheState((1, 2, -1), (0, 1, -1))
    before = state.to_lists()
    plan_residency_step(state, [5, 6], 2, num_blocks=10)
    assert state.to_lists() == before


def test_batch_equals_row_by_row() -> None:
    """The batched helper is the per-row step applied to each row."""
    states = [HotCacheState.empty(3), HotCacheState((0, 1, 2), (0, 0, 0))]
    rows = [[1, 2], [2, 9]]
    plans = plan_residency_batch(states, rows, 5, num_blocks=[10, 10], bytes_per_block=8)
    assert plans == tuple(
        plan_residency_step(s, r, 5, num_blocks=10, bytes_per_block=8)
        for s, r in zip(states, rows, strict=True)
    )
    with pytest.raises(ResidencyError, match="one entry per row"):
        plan_residency_batch(states, rows[:1], 5, num_blocks=[10, 10])


def _brute_force(
    blocks: list[int], stamps: list[int], selected: list[int], step: int
) -> tuple[list[int], list[int], list[int], list[ResidencyFill]]:
    """A second, independent reading of the contract (simulated step by step)."""
    blocks, stamps = list(blocks), list(stamps)
    sel_set = {b for b in selected if b >= 0}
    slots = [-1] * len(selected)
    for i, b in enumerate(selected):
        if b >= 0 and b in blocks:
            slots[i] = blocks.index(b)
    free = [s for s in range(len(blocks)) if blocks[s] == -1 and blocks[s] not in sel_set]
    old = [s for s in range(len(blocks)) if blocks[s] != -1 and blocks[s] not in sel_set]
    old.sort(key=lambda s: (stamps[s], s))
    victims = free + old
    fills = []
    for i, b in enumerate(selected):
        if b >= 0 and slots[i] == -1:
            s = victims.pop(0)
            fills.append(ResidencyFill(i, b, s, blocks[s]))
            blocks[s] = b
            slots[i] = s
    for s in slots:
        if s >= 0:
            stamps[s] = step
    return blocks, stamps, slots, fills


@st.composite
def _steps(draw: st.DrawFn) -> tuple[int, int, list[list[int]]]:
    num_blocks = draw(st.integers(1, 40))
    k = draw(st.integers(1, min(num_blocks, 8)))
    num_slots = draw(st.integers(k, k + 6))
    rows = []
    for _ in range(draw(st.integers(1, 12))):
        ids = draw(st.lists(st.integers(0, num_blocks - 1), min_size=0, max_size=k, unique=True))
        pad = k - len(ids)
        row = ids + [-1] * pad
        row = draw(st.permutations(row))
        rows.append(list(row))
    return num_blocks, num_slots, rows


@settings(max_examples=300, deadline=None)
@given(_steps())
def test_random_steps_follow_the_contract(case: tuple[int, int, list[list[int]]]) -> None:
    """Under random selections the plan equals an independent simulation and keeps invariants."""
    num_blocks, num_slots, rows = case
    state = HotCacheState.empty(num_slots)
    for step, row in enumerate(rows, start=3):
        plan = plan_residency_step(state, row, step, num_blocks=num_blocks, bytes_per_block=2)
        blocks, stamps, slots, fills = _brute_force(
            list(state.slot_block), list(state.slot_stamp), row, step
        )
        assert plan.state.to_lists() == (blocks, stamps)
        assert list(plan.selected_slots) == slots
        assert list(plan.fills) == fills
        # every selected block is resident in the slot the plan names
        for block, slot in zip(row, plan.selected_slots, strict=True):
            assert (block == -1) == (slot == -1)
            if block >= 0:
                assert plan.state.slot_block[slot] == block
        # hits + misses = valid entries; slots of valid entries are distinct
        valid = [b for b in row if b >= 0]
        assert plan.num_hits + plan.num_misses == len(valid)
        used = [s for s in plan.selected_slots if s >= 0]
        assert len(set(used)) == len(used)
        assert plan.bytes_moved == 2 * plan.num_misses
        state = plan.state
