"""Segment layout, extent planning and the block allocator."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qsa_hostcache import CheckpointLayout, SegmentError, SegmentSpec
from qsa_hostcache._layout import BlockAllocator, plan_extents


def test_segments_sit_at_aligned_offsets_in_order() -> None:
    """Odd sizes are padded so every segment starts at a multiple of the alignment."""
    specs = (SegmentSpec("a", 3), SegmentSpec("b", 0), SegmentSpec("c", 300), SegmentSpec("d", 1))
    layout = CheckpointLayout.plan(specs, 256)
    assert layout.offsets == (0, 256, 256, 768)
    assert (layout.total_bytes, layout.payload_bytes) == (769, 304)
    assert layout.index("c") == 2


def test_layout_rejects_duplicates_empty_and_unknown_names() -> None:
    """A repeated name, no segments, or an unknown lookup raise SegmentError naming the values."""
    with pytest.raises(SegmentError, match=r"\['a'\]"):
        CheckpointLayout.plan((SegmentSpec("a", 1), SegmentSpec("a", 2)), 8)
    with pytest.raises(SegmentError, match="at least one"):
        CheckpointLayout.plan((), 8)
    with pytest.raises(SegmentError, match=r"'zz'.*\['a'\]"):
        CheckpointLayout.plan((SegmentSpec("a", 1),), 8).index("zz")
    with pytest.raises(SegmentError, match="nbytes"):
        SegmentSpec("a", -1)


def test_extents_merge_adjacent_blocks_and_split_at_gaps() -> None:
    """Blocks (4, 5, 9) hold one 3-block stream: two copies, the first spanning blocks 4-5."""
    ext = plan_extents(10, 250, (4, 5, 9), 100)
    assert ext == [(410, 0, 190), (900, 190, 60)]


@given(
    blocks=st.permutations(list(range(8))),
    offset=st.integers(0, 799),
    data=st.data(),
)
def test_extents_cover_the_segment_exactly(
    blocks: list[int], offset: int, data: st.DataObject
) -> None:
    """Extents tile [0, nbytes) of the segment in order and map each byte to its block."""
    nbytes = data.draw(st.integers(0, 800 - offset))
    ext = plan_extents(offset, nbytes, tuple(blocks), 100)
    pos = 0
    for arena_off, seg_off, n in ext:
        assert seg_off == pos
        assert n > 0
        for k in (0, n - 1):
            logical = offset + seg_off + k
            assert arena_off + k == blocks[logical // 100] * 100 + logical % 100
        pos += n
    assert pos == nbytes


def test_allocator_takes_lowest_ids_and_refuses_beyond_free() -> None:
    """Lowest free ids first; asking for more than is free returns None and takes nothing."""
    alloc = BlockAllocator(6)
    a = alloc.allocate(2)
    b = alloc.allocate(3)
    assert (a, b) == ((0, 1), (2, 3, 4))
    assert a is not None
    alloc.free(a)
    assert alloc.allocate(4) is None
    assert alloc.free_blocks == 3
    assert alloc.allocate(3) == (0, 1, 5)
    assert alloc.free_blocks == 0
