"""Image keys: what changes a key, what does not, and which content is accepted."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from qsa_mm_prefix import (
    KEY_BYTES,
    ContentError,
    ContentKind,
    ContentTypeError,
    ImageKey,
    InvalidPromptError,
    Modality,
    MultimodalItem,
    PreprocessArg,
    ProcessorFingerprint,
    build_prompt_identity,
    content_digest,
    image_key,
)

MakeImage = Callable[[int, tuple[int, int, int], int], MultimodalItem]
GRID = (1, 8, 10)  # 80 patches -> 20 tokens


def _key(item: MultimodalItem, processor: ProcessorFingerprint, order: int = 0) -> bytes:
    """The key's 16-byte digest: what a cache compares (the dataclass also holds the span)."""
    return image_key(item, order=order, processor=processor).digest


def test_key_is_fixed_size_and_repeatable(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """Two keys of equal inputs (content in distinct buffers) are equal and KEY_BYTES long."""
    a = image_key(make_image(5, GRID, 1), order=0, processor=processor)
    b = image_key(make_image(5, GRID, 1), order=0, processor=processor)
    assert isinstance(a, ImageKey)
    assert a == b
    assert len(a.digest) == KEY_BYTES == 16
    assert bytes(a) == a.digest
    assert len(a.content_digest) == KEY_BYTES


def test_same_placeholders_different_images_differ(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """Same span, grid and processor, different pixels: different keys and page identities."""
    a = make_image(64, GRID, 1)
    b = make_image(64, GRID, 2)
    assert _key(a, processor) != _key(b, processor)
    ia = build_prompt_identity(128, [a], processor=processor)
    ib = build_prompt_identity(128, [b], processor=processor)
    assert ia.page_identities[1] != ib.page_identities[1]
    assert ia.page_identities[0] == ib.page_identities[0] == b""


def test_one_flipped_bit_changes_the_key(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """A single-bit change anywhere in the content changes the key."""
    item = make_image(0, GRID, 3)
    assert isinstance(item.content, np.ndarray)
    raw = bytearray(item.content.tobytes())
    base = _key(dataclasses.replace(item, content=bytes(raw), shape=item.content.shape), processor)
    for position in (0, len(raw) // 2 + 1, len(raw) - 1):
        flipped = bytearray(raw)
        flipped[position] ^= 0x01
        other = dataclasses.replace(item, content=bytes(flipped), shape=item.content.shape)
        assert _key(other, processor) != base


def test_same_image_at_another_position_differs(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """Moving the same image by one token changes its key."""
    assert _key(make_image(10, GRID, 1), processor) != _key(make_image(11, GRID, 1), processor)


def test_same_image_in_another_order_differs(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """The same image at the same place as image 0 or image 1 of a prompt gets different keys."""
    item = make_image(10, GRID, 1)
    assert _key(item, processor, order=0) != _key(item, processor, order=1)


def test_same_bytes_with_another_grid_differ(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """Identical bytes and span described by another grid give another key."""
    item = make_image(10, (1, 8, 10), 1)
    other = dataclasses.replace(item, grid=(1, 10, 8))
    assert _key(item, processor) != _key(other, processor)
    no_grid = dataclasses.replace(item, grid=None)
    assert _key(no_grid, processor) not in (_key(item, processor), _key(other, processor))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_pixels", 12845057),
        ("image_mean", [0.48145466, 0.4578275, 0.40821074]),
        ("resample", 2),
        ("do_convert_rgb", False),
        ("rescale_factor", 1 / 256),
        ("merge_size", 3),
    ],
)
def test_another_preprocessing_argument_differs(
    make_image: MakeImage, qwen_args: dict[str, PreprocessArg], name: str, value: PreprocessArg
) -> None:
    """Changing any one preprocessing argument changes the key."""
    item = make_image(10, GRID, 1)
    base = ProcessorFingerprint.create(
        "Qwen2VLImageProcessorFast", "transformers==4.57.1", qwen_args
    )
    changed = ProcessorFingerprint.create(
        "Qwen2VLImageProcessorFast", "transformers==4.57.1", {**qwen_args, name: value}
    )
    assert _key(item, base) != _key(item, changed)


def test_processor_name_and_version_count(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """Another processor name or version gives another key."""
    item = make_image(10, GRID, 1)
    renamed = dataclasses.replace(processor, name="Qwen2VLImageProcessor")
    upgraded = dataclasses.replace(processor, version="transformers==4.58.0")
    keys = {_key(item, p) for p in (processor, renamed, upgraded)}
    assert len(keys) == 3


def test_same_bytes_as_another_shape_or_dtype_differ(
    processor: ProcessorFingerprint, make_image: MakeImage
) -> None:
    """The same bytes viewed with another shape or dtype do not collide."""
    item = make_image(10, GRID, 1)
    assert isinstance(item.content, np.ndarray)
    flat = item.content.reshape(-1)
    as_int = item.content.view(np.int32)
    keys = {
        _key(item, processor),
        _key(dataclasses.replace(item, content=flat), processor),
        _key(dataclasses.replace(item, content=as_int), processor),
        _key(dataclasses.replace(item, dtype="float32", shape=(80, 1176)), processor),
        _key(dataclasses.replace(item, dtype="float32", shape=(40, 2352)), processor),
        _key(dataclasses.replace(item, dtype="int32", shape=(80, 1176)), processor),
    }
    assert len(keys) == 6
    assert content_digest(flat) == content_digest(as_int) == content_digest(item.content)


def test_content_kind_is_part_of_the_key(processor: ProcessorFingerprint) -> None:
    """The same bytes as pixels or as an encoded file give different keys."""
    raw = bytes(range(256)) * 3
    pixels_item = MultimodalItem(Modality.IMAGE, 0, 4, content=raw)
    encoded_item = dataclasses.replace(pixels_item, content_kind=ContentKind.ENCODED)
    assert _key(pixels_item, processor) != _key(encoded_item, processor)


def test_buffer_types_with_equal_bytes_and_layout_agree(processor: ProcessorFingerprint) -> None:
    """bytes, bytearray, memoryview and a 1-D uint8 array of the same bytes give one key."""
    raw = np.random.default_rng(7).integers(0, 256, 4099, dtype=np.uint8)
    sources: list[object] = [
        raw.tobytes(),
        bytearray(raw.tobytes()),
        memoryview(raw.tobytes()),
        raw,
    ]
    keys = {_key(MultimodalItem(Modality.IMAGE, 3, 9, content=s), processor) for s in sources}
    assert len(keys) == 1
    assert content_digest(raw) == content_digest(raw.tobytes())


def test_content_is_hashed_in_place_not_snapshotted(processor: ProcessorFingerprint) -> None:
    """The key reflects the buffer's bytes at hashing time (no hidden copy taken earlier)."""
    buf = bytearray(b"\x01" * 1000)
    item = MultimodalItem(Modality.IMAGE, 0, 2, content=buf)
    before = _key(item, processor)
    buf[500] = 2
    assert _key(item, processor) != before


def test_non_contiguous_content_is_rejected(processor: ProcessorFingerprint) -> None:
    """A strided view is refused with its shape and strides, not silently copied."""
    strided = np.zeros((8, 16), dtype=np.float32)[:, ::2]
    with pytest.raises(ContentError, match=r"C-contiguous.*\(8, 8\)"):
        _key(MultimodalItem(Modality.IMAGE, 0, 2, content=strided), processor)
    with pytest.raises(ContentError):
        content_digest(np.asfortranarray(np.zeros((3, 5), dtype=np.float32)))


def test_content_without_buffer_protocol_is_rejected(processor: ProcessorFingerprint) -> None:
    """A list or str is not content; the error is a TypeError naming the type."""
    with pytest.raises(ContentTypeError, match="'list'"):
        _key(MultimodalItem(Modality.IMAGE, 0, 2, content=[1, 2, 3]), processor)
    with pytest.raises(TypeError):
        content_digest("pixels")


def test_shape_that_cannot_hold_the_bytes_is_rejected(processor: ProcessorFingerprint) -> None:
    """A caller shape whose element count does not divide the byte count is refused."""
    item = MultimodalItem(Modality.IMAGE, 0, 2, content=b"x" * 10, shape=(3,))
    with pytest.raises(ContentError, match=r"\(3,\).*10 content bytes"):
        _key(item, processor)
    empty_shape = MultimodalItem(Modality.IMAGE, 0, 2, content=b"x" * 10, shape=(0, 4))
    with pytest.raises(ContentError):
        _key(empty_shape, processor)


def test_zero_size_content_is_keyed(processor: ProcessorFingerprint) -> None:
    """An empty tensor (zeros in its shape) hashes; its shape keeps it apart from empty bytes."""
    empty = np.zeros((0, 5), dtype=np.float16)
    a = image_key(MultimodalItem(Modality.IMAGE, 0, 1, content=empty), order=0, processor=processor)
    b = image_key(MultimodalItem(Modality.IMAGE, 0, 1, content=b""), order=0, processor=processor)
    assert a.digest != b.digest
    assert a.content_digest == b.content_digest == content_digest(b"")


def test_negative_order_is_rejected(processor: ProcessorFingerprint, make_image: MakeImage) -> None:
    """order is an index among the prompt's images; negatives and bools are refused."""
    with pytest.raises(InvalidPromptError, match="-1"):
        _key(make_image(0, GRID, 1), processor, order=-1)
    with pytest.raises(InvalidPromptError):
        _key(make_image(0, GRID, 1), processor, order=True)


def test_same_image_with_another_span_length_differs(processor: ProcessorFingerprint) -> None:
    """The same bytes at the same start over a longer placeholder run give another key."""
    item = MultimodalItem(Modality.IMAGE, 4, 10, content=b"pixels" * 50)
    assert _key(item, processor) != _key(dataclasses.replace(item, length=11), processor)


def test_caller_dtype_or_shape_never_equals_the_buffer_own(processor: ProcessorFingerprint) -> None:
    """A caller dtype spelled like the buffer's format code, or a caller shape equal to the
    buffer's shape, is still a separate identity (the two sources never alias)."""
    array = np.arange(12, dtype=np.float32)
    from_buffer = MultimodalItem(Modality.IMAGE, 0, 3, content=array)
    assert memoryview(array.tobytes()).cast("f").format == array.dtype.char == "f"
    named_dtype = dataclasses.replace(from_buffer, dtype=array.dtype.char)
    named_shape = dataclasses.replace(from_buffer, shape=(12,))
    keys = {_key(item, processor) for item in (from_buffer, named_dtype, named_shape)}
    assert len(keys) == 3
