"""Per-page identity: which pages carry which images, and what two prompts can share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_mm_prefix import (
    DEFAULT_PAGE_SIZE,
    KEY_BYTES,
    Modality,
    MultimodalItem,
    ProcessorFingerprint,
    build_prompt_identity,
)

MakeImage = Callable[[int, tuple[int, int, int], int], MultimodalItem]


def _blob_image(start: int, length: int, seed: int) -> MultimodalItem:
    return MultimodalItem(
        Modality.IMAGE, start=start, length=length, content=seed.to_bytes(4, "little") * 16
    )


def test_text_only_prompt_has_empty_identity_on_every_page(processor: ProcessorFingerprint) -> None:
    """No images: one empty identity per page, the last page partial."""
    identity = build_prompt_identity(130, [], processor=processor)
    assert identity.reusable
    assert identity.page_identities == (b"", b"", b"")
    assert identity.num_pages == 3
    assert build_prompt_identity(0, [], processor=processor).page_identities == ()
    assert build_prompt_identity(64, [], processor=processor).page_identities == (b"", b"")[:1]


def test_page_fully_inside_an_image(processor: ProcessorFingerprint, make_image: MakeImage) -> None:
    """A page covered by one image carries it; each such page differs by its offset in the image."""
    item = make_image(10, (1, 20, 40), 1)  # 200 tokens: [10, 210)
    identity = build_prompt_identity(300, [item], processor=processor)
    pages = identity.page_identities
    assert len(pages) == 5
    assert all(len(p) == KEY_BYTES for p in pages[:4])
    assert pages[4] == b""  # [256, 300) after the image
    assert len(set(pages[:4])) == 4  # pages 1 and 2 lie fully inside, at different offsets
    assert identity.images_overlapping(64, 128) == identity.image_keys


def test_prefix_ending_inside_an_image_is_shared_only_with_the_same_image(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """Pages up to a cut inside an image agree iff the same image stood there."""
    same = build_prompt_identity(300, [make_image(10, (1, 20, 40), 1)], processor=processor)
    again = build_prompt_identity(
        400, [make_image(10, (1, 20, 40), 1), make_image(330, (1, 4, 4), 9)], processor=processor
    )
    other = build_prompt_identity(300, [make_image(10, (1, 20, 40), 2)], processor=processor)
    moved = build_prompt_identity(300, [make_image(11, (1, 20, 40), 1)], processor=processor)
    regrid = build_prompt_identity(300, [make_image(10, (1, 40, 20), 1)], processor=processor)
    # A prefix of 128 tokens ends inside the image [10, 210).
    assert same.page_identities[:2] == again.page_identities[:2]
    for different in (other, moved, regrid):
        assert all(
            a != b
            for a, b in zip(same.page_identities[:2], different.page_identities[:2], strict=True)
        )


def test_page_straddling_two_images(processor: ProcessorFingerprint, make_image: MakeImage) -> None:
    """A page holding the tail of one image and the head of the next depends on both."""
    a1, a2 = make_image(40, (1, 8, 20), 1), make_image(40, (1, 8, 20), 2)  # [40, 80)
    b1, b2 = make_image(100, (1, 10, 20), 3), make_image(100, (1, 10, 20), 4)  # [100, 150)
    base = build_prompt_identity(200, [a1, b1], processor=processor)
    new_a = build_prompt_identity(200, [a2, b1], processor=processor)
    new_b = build_prompt_identity(200, [a1, b2], processor=processor)
    assert len(base.images_overlapping(64, 128)) == 2
    p = base.page_identities
    assert len(p) == 4
    assert all(len(x) == KEY_BYTES for x in p[:3])
    assert p[3] == b""
    # page 0 [0,64): a only; page 1 [64,128): a tail + b head; page 2 [128,192): b tail.
    assert (new_a.page_identities[0] != p[0], new_a.page_identities[1] != p[1]) == (True, True)
    assert new_a.page_identities[2] == p[2]
    assert new_b.page_identities[0] == p[0]
    assert new_b.page_identities[1] != p[1]
    assert new_b.page_identities[2] != p[2]


def test_page_after_the_last_image_is_plain_text(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """Pages past the last image get empty identity, even in the final partial page."""
    identity = build_prompt_identity(64 * 5 + 3, [make_image(0, (1, 8, 8), 1)], processor=processor)
    assert len(identity.page_identities[0]) == KEY_BYTES
    assert identity.page_identities[1:] == (b"",) * 5


def test_adjacent_images_and_image_ending_the_prompt(processor: ProcessorFingerprint) -> None:
    """Images may touch (end == next start) and may end at the last token of a partial page."""
    items = [_blob_image(0, 64, 1), _blob_image(64, 66, 2)]
    identity = build_prompt_identity(130, items, processor=processor)
    assert [len(p) for p in identity.page_identities] == [KEY_BYTES] * 3
    assert len(set(identity.page_identities)) == 3


def test_page_size_is_a_parameter(processor: ProcessorFingerprint) -> None:
    """An odd page size splits the prompt into ceil(n / page_size) pages with the same rule."""
    identity = build_prompt_identity(20, [_blob_image(5, 4, 1)], processor=processor, page_size=7)
    assert identity.page_size == 7
    assert [len(p) for p in identity.page_identities] == [KEY_BYTES, KEY_BYTES, 0]
    default = build_prompt_identity(20, [_blob_image(5, 4, 1)], processor=processor)
    assert default.page_size == DEFAULT_PAGE_SIZE == 64


def test_page_identity_depends_on_page_size(processor: ProcessorFingerprint) -> None:
    """The same image in the same page span under another page size is a different identity."""
    a = build_prompt_identity(16, [_blob_image(0, 8, 1)], processor=processor, page_size=8)
    b = build_prompt_identity(16, [_blob_image(0, 8, 1)], processor=processor, page_size=16)
    assert a.page_identities[0] != b.page_identities[0]


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[int, int, list[MultimodalItem]]:
    page_size = draw(st.integers(1, 70))
    gaps = draw(st.lists(st.tuples(st.integers(0, 90), st.integers(1, 150)), max_size=5))
    items, cursor = [], 0
    for seed, (gap, length) in enumerate(gaps):
        items.append(_blob_image(cursor + gap, length, seed))
        cursor += gap + length
    num_tokens = cursor + draw(st.integers(0, 100))
    return page_size, num_tokens, items


@settings(max_examples=150, deadline=None)
@given(_layouts(), st.data())
def test_pages_carry_exactly_the_images_that_overlap_them(
    layout: tuple[int, int, list[MultimodalItem]], data: st.DataObject
) -> None:
    """Identity is empty iff no image overlaps the page; changing one image's content changes
    exactly the pages it overlaps."""
    page_size, num_tokens, items = layout
    processor = ProcessorFingerprint.create("p", "1", {})
    base = build_prompt_identity(num_tokens, items, processor=processor, page_size=page_size)
    assert len(base.page_identities) == -(-num_tokens // page_size)
    for page, ident in enumerate(base.page_identities):
        lo, hi = page * page_size, (page + 1) * page_size
        overlapping = [it for it in items if it.start < hi and it.end > lo]
        assert (ident == b"") == (not overlapping)
        assert len(base.images_overlapping(lo, hi)) == len(overlapping)
    if not items:
        return
    j = data.draw(st.integers(0, len(items) - 1))
    changed_items = list(items)
    changed_items[j] = dataclasses.replace(items[j], content=b"another image")
    changed = build_prompt_identity(
        num_tokens, changed_items, processor=processor, page_size=page_size
    )
    for page, (old, new) in enumerate(
        zip(base.page_identities, changed.page_identities, strict=True)
    ):
        lo, hi = page * page_size, (page + 1) * page_size
        touches_j = items[j].start < hi and items[j].end > lo
        assert (old != new) == touches_j
