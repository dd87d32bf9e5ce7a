"""Zigzag CP layout: block ownership, rank-major permutation, inverse, reduce-scatter invariant."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_core import LayoutError, ZigzagLayout

_layouts = st.builds(
    ZigzagLayout,
    cp_size=st.integers(1, 6),
    seq_lens=st.lists(st.integers(0, 70), min_size=0, max_size=4).map(tuple),
)


def test_two_ranks_own_blocks_r_and_mirror() -> None:
    """C=2, 8 rows: blocks of 2; rank 0 gets blocks 0 and 3, rank 1 blocks 1 and 2."""
    layout = ZigzagLayout(2, (8,))
    assert layout.rank_rows(0) == (0, 1, 6, 7)
    assert layout.rank_rows(1) == (2, 3, 4, 5)
    assert layout.rank_major_index() == (0, 1, 6, 7, 2, 3, 4, 5)
    assert layout.blocks_of_rank(1) == (1, 2)


def test_odd_lengths_are_padded_to_equal_rows() -> None:
    """C=2, 7 rows: blocks of 2 (last has 1); rank 0 pads one row."""
    layout = ZigzagLayout(2, (7,))
    assert layout.rank_rows(0) == (0, 1, 6)
    assert layout.rows_per_rank == 4
    assert layout.rank_major_index() == (0, 1, 6, -1, 2, 3, 4, 5)
    assert layout.owner_of_row(6) == (0, 2)


def test_packed_requests_keep_request_order_per_rank() -> None:
    """With two requests each rank lists request 0's blocks then request 1's."""
    layout = ZigzagLayout(2, (4, 8))
    assert layout.rank_rows(0) == (0, 3, 4, 5, 10, 11)
    assert layout.rank_rows(1) == (1, 2, 6, 7, 8, 9)
    assert layout.block_bounds(1, 3) == (10, 12)


@settings(max_examples=300, deadline=None)
@given(layout=_layouts)
def test_every_row_is_owned_exactly_once_and_inverse_round_trips(layout: ZigzagLayout) -> None:
    """Rank rows partition the global rows; to/from rank-major is the identity."""
    owned = sorted(r for rank in range(layout.cp_size) for r in layout.rank_rows(rank))
    assert owned == list(range(layout.total_rows))
    rows = list(range(100, 100 + layout.total_rows))
    major = layout.to_rank_major(rows, pad=-7)
    assert len(major) == layout.cp_size * layout.rows_per_rank
    assert layout.from_rank_major(major) == rows
    index = layout.rank_major_index()
    for row, position in enumerate(layout.inverse_index()):
        assert index[position] == row


@settings(max_examples=300, deadline=None)
@given(layout=_layouts)
def test_rank_owns_blocks_r_and_2c_minus_1_minus_r(layout: ZigzagLayout) -> None:
    """Each rank's rows are exactly the rows of its two blocks in every request."""
    for rank in range(layout.cp_size):
        expected: list[int] = []
        for request in range(len(layout.seq_lens)):
            for block in layout.blocks_of_rank(rank):
                start, stop = layout.block_bounds(request, block)
                expected.extend(range(start, stop))
        assert list(layout.rank_rows(rank)) == expected


@settings(max_examples=200, deadline=None)
@given(layout=_layouts, width=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_reduce_scatter_of_rank_major_rows_gives_the_zigzag_shard(
    layout: ZigzagLayout, width: int, seed: int
) -> None:
    """RS over ranks of rank-major partial sums equals each rank's zigzag shard (padding zero)."""
    rng = np.random.default_rng(seed)
    c = layout.cp_size
    partials = rng.integers(-1000, 1000, size=(c, layout.total_rows, width))
    full = partials.sum(axis=0)
    index = np.array(layout.rank_major_index(), dtype=np.int64)
    padded = np.concatenate([partials, np.zeros((c, 1, width), dtype=partials.dtype)], axis=1)
    # each rank permutes its partial rows into rank-major order (padding reads the zero row)
    major = padded[:, np.where(index < 0, layout.total_rows, index), :]
    # reduce-scatter: sum over ranks, chunk r goes to rank r
    scattered = major.sum(axis=0).reshape(c, layout.rows_per_rank, width)
    zero = np.zeros(width, dtype=full.dtype)
    for rank in range(c):
        shard = np.array(layout.shard(list(full), rank, pad=zero)).reshape(-1, width)
        np.testing.assert_array_equal(scattered[rank], shard)


def test_bad_inputs_are_rejected() -> None:
    """Zero ranks, negative lengths, out-of-range ranks and wrong row counts raise."""
    with pytest.raises(LayoutError, match="cp_size=0"):
        ZigzagLayout(0, (4,))
    with pytest.raises(LayoutError, match=r"seq_lens\[1\]=-1"):
        ZigzagLayout(2, (4, -1))
    layout = ZigzagLayout(2, (8,))
    with pytest.raises(LayoutError, match=r"rank=2 .*allowed: 0..1"):
        layout.rank_rows(2)
    with pytest.raises(LayoutError, match="rows has 3 rows; the layout expects 8"):
        layout.to_rank_major([1, 2, 3], pad=0)
    with pytest.raises(LayoutError, match=r"block=4 .*allowed: 0..3"):
        layout.block_bounds(0, 4)
