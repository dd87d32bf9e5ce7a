"""The offload's planner alone, on the host: rows, their lengths, padding rows, the step plan's
buffers, and refusals that name the value and change nothing. No K/V byte is involved.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_kernels._errors import KernelInputError
from qsa_kernels.offload import RowState
from qsa_kernels.offload._plan import RowPlanner
from qsa_pytest.refusals import any_value, refusal, shows

_ROWS, _MAX_TOKENS = 5, 12


def _planner(lengths: dict[int, int]) -> RowPlanner:
    """A planner of ``_ROWS`` rows with ``lengths`` (row -> prompt tokens) admitted."""
    planner = RowPlanner(_ROWS, _MAX_TOKENS, torch.device("cpu"))
    for row, tokens in lengths.items():
        planner.admit(row, tokens)
    return planner


def _rows_view(planner: RowPlanner) -> tuple[list[int], list[RowState], int]:
    return (
        [planner.length(r) for r in range(_ROWS)],
        [planner.state(r) for r in range(_ROWS)],
        planner.step,
    )


def test_admit_and_release_track_each_rows_state_and_length() -> None:
    planner = _planner({3: 7, 1: 4})
    assert [planner.state(r) for r in range(_ROWS)] == [
        RowState.FREE,
        RowState.ACTIVE,
        RowState.FREE,
        RowState.ACTIVE,
        RowState.FREE,
    ]
    assert [planner.length(r) for r in range(_ROWS)] == [0, 4, 0, 7, 0]
    planner.release(3)
    assert (planner.state(3), planner.length(3)) == (RowState.FREE, 0)
    planner.admit(3, 2)  # a released row takes the next prompt
    assert (planner.state(3), planner.length(3)) == (RowState.ACTIVE, 2)


def test_a_step_counts_one_token_per_row_and_plans_its_buffers_with_the_lowest_free_rows() -> None:
    """Rows 3 (7 tokens: its 8th closes block 1) and 1 (4 tokens: its 5th opens block 1), padded
    to 4 with free rows 0 and 2, which plan one ignored tail token each."""
    planner = _planner({3: 7, 1: 4})
    step = planner.check_advance([3, 1], pad_to=4)
    assert (step.real, step.positions, step.padding) == ((3, 1), (7, 4), (0, 2))
    assert step.opening == [1]
    assert [planner.length(r) for r in (3, 1)] == [7, 4]  # checking changed nothing
    assert planner.advance(step) == (3, 1, 0, 2)
    assert [planner.length(r) for r in range(_ROWS)] == [0, 5, 0, 8, 0]
    plan = planner.plan
    assert (plan.rows, plan.batch) == ((3, 1, 0, 2), 4)
    assert plan.row_ids.tolist() == [3, 1, 0, 2]
    assert plan.offsets.tolist() == [3, 0, 0, 0]
    assert plan.closed_blocks.tolist() == [2, 1, 0, 0]
    assert plan.closing.tolist() == [1, -1, -1, -1]
    assert plan.positions.tolist() == [7, 4, 0, 0]
    assert plan.tail_tokens.tolist() == [
        [-1, -1, -1],  # row 3's block closed: no open token
        [4, -1, -1],  # row 1's open block holds its new token: tail token 4 * 1 + 0
        [0, -1, -1],  # padding rows: one token of their own tail
        [8, -1, -1],
    ]


def test_a_planned_step_is_dropped_when_one_of_its_rows_is_released() -> None:
    planner = _planner({0: 3, 1: 3})
    with pytest.raises(KernelInputError, match="before begin_step"):
        planner.check_step("attend", [0])
    assert planner.begin_step() == 0
    planner.advance(planner.check_advance([0, 1]))
    planner.check_step("attend", [0, 1])
    with pytest.raises(
        KernelInputError, match=r"rows \[1, 0\]; the last advance\(\) counted rows \[0, 1\]"
    ):
        planner.check_planned("attend", [1, 0])
    planner.release(1)
    assert (planner.plan.rows, planner.plan.batch) == ((), 0)
    with pytest.raises(
        KernelInputError, match=r"rows \[0, 1\]; the last advance\(\) counted rows None"
    ):
        planner.check_planned("write_token", [0, 1])


@pytest.mark.parametrize(
    ("rows", "pad_to", "match"),
    [
        ([4], None, "row 4 is 'free'; it must be active"),
        ([0, 0], None, r"rows \[0, 0\] repeat a row"),
        ([5], None, r"row=5 is not allowed; allowed: \[0, 5\)"),
        ([1], None, "row 1 is full \\(12 tokens\\)"),
        ([0], 0, "pad_to=0 is not allowed; allowed: an int >= the 1 rows"),
        ([0], 5, "pad_to=5 needs 4 free rows to pad 1 rows; 3 of 5 are free"),
    ],
)
def test_a_refused_step_names_the_value_and_changes_nothing(
    rows: list[int], pad_to: int | None, match: str
) -> None:
    planner = _planner({0: 3, 1: _MAX_TOKENS})
    before = _rows_view(planner)
    with pytest.raises(KernelInputError, match=match):
        planner.check_advance(rows, pad_to)
    assert _rows_view(planner) == before
    assert planner.plan.rows == ()


@pytest.mark.parametrize(
    ("row", "tokens", "match"),
    [
        (0, 2, "row 0 is 'active'; admit needs a free row"),
        (2, 0, r"a prompt of 0 tokens is not allowed; allowed: 1\.\.12"),
        (2, _MAX_TOKENS + 1, r"a prompt of 13 tokens is not allowed; allowed: 1\.\.12"),
    ],
)
def test_a_refused_admission_names_the_value_and_changes_nothing(
    row: int, tokens: int, match: str
) -> None:
    planner = _planner({0: 3})
    before = _rows_view(planner)
    with pytest.raises(KernelInputError, match=match):
        planner.admit(row, tokens)
    assert _rows_view(planner) == before


@pytest.mark.parametrize("call", ["length", "state", "release", "check_free", "pad_to"])
@settings(deadline=None, max_examples=60)
@given(value=any_value(max_int=2**12))
def test_any_row_or_pad_to_is_taken_or_refused_naming_it(call: str, value: object) -> None:
    planner = _planner({0: 3})
    before = _rows_view(planner)
    calls = {
        "length": planner.length,
        "state": planner.state,
        "release": planner.release,
        "check_free": planner.check_free,
        "pad_to": lambda pad_to: planner.check_advance([0], pad_to),
    }
    refused = refusal(
        calls[call], {"row": value} if call != "pad_to" else {"pad_to": value}, KernelInputError
    )
    if refused is None:
        return
    assert _rows_view(planner) == before, str(refused)
    assert shows(str(refused), value), str(refused)


def _plan_reference(
    rows: list[int], lengths: list[int], real: int, max_rows: int, shard: object
) -> list[int]:
    """The step plan's vector by torch operations on the whole batch (the planner's first form)."""
    from qsa_kernels.sharded import localize_blocks

    r, n = max_rows, len(rows)
    fields = torch.zeros((5, r), dtype=torch.int32)
    fields[3] = -1
    tails = torch.full((r, 3), -1, dtype=torch.int32)
    row_t, length_t = torch.tensor(rows), torch.tensor(lengths)
    position = length_t - 1
    offset = position % 4
    is_real = torch.arange(n) < real
    fields[0, :n] = row_t
    fields[1, :n] = torch.where(is_real, offset, 0)
    fields[2, :n] = torch.where(is_real, length_t // 4, 0)
    closing = torch.where(is_real & (offset == 3), position // 4, -1)
    if shard is not None:
        closing = localize_blocks(closing, shard.placement, shard.rank)  # type: ignore[attr-defined]
    fields[3, :n] = closing
    fields[4, :n] = torch.where(is_real, position, 0)
    count = torch.where(is_real, length_t % 4, 1)
    slots = torch.arange(3)
    tails[:n] = torch.where(slots < count.unsqueeze(1), row_t.unsqueeze(1) * 4 + slots, -1)
    return [*fields.reshape(-1).tolist(), *tails.reshape(-1).tolist()]


@settings(deadline=None, max_examples=200)
@given(
    st.integers(1, 9).flatmap(
        lambda r: st.tuples(
            st.just(r),
            st.lists(st.integers(0, r - 1), unique=True, max_size=r),
            st.lists(st.integers(1, 5000), min_size=r, max_size=r),
            st.integers(0, r),
            st.sampled_from([None, (2, 0), (2, 1), (4, 3)]),
        )
    )
)
def test_the_plan_of_any_step_is_the_batch_formula_row_by_row(case: tuple[Any, ...]) -> None:
    """Rows, tail offsets, complete blocks, the closing block (a shard's local id, or -1 where
    another rank stores it), positions and open-block tokens, for real and padding rows."""
    from qsa_core import ShardPlacement
    from qsa_kernels.offload._plan import _plan_words

    max_rows, rows, all_lengths, real, group = case
    lengths = all_lengths[: len(rows)]
    real = min(real, len(rows))
    shard = None
    if group is not None:
        shard = SimpleNamespace(placement=ShardPlacement(group[0], 16, 4), rank=group[1])
    want = _plan_reference(rows, lengths, real, max_rows, shard)
    assert _plan_words(rows, lengths, real, max_rows, shard) == want  # type: ignore[arg-type]
