"""Content digests, image keys, and the per-page identity of a prompt."""

from __future__ import annotations

import itertools
import logging
import math
import reprlib
from collections.abc import Iterable

from qsa_core import MAX_SEQ_LEN
from qsa_mm_prefix._encoding import Packer, digest_bytes
from qsa_mm_prefix._errors import (
    ContentError,
    ContentTypeError,
    InvalidGridError,
    InvalidPromptError,
    OverlappingSpansError,
    SpanOutOfRangeError,
    UnsupportedItemError,
)
from qsa_mm_prefix._types import (
    DEFAULT_PAGE_SIZE,
    BufferLike,
    Bypass,
    BypassReason,
    FeatureSource,
    ImageKey,
    Modality,
    MultimodalItem,
    ProcessorFingerprint,
    PromptIdentity,
    is_int_at_least,
)

logger = logging.getLogger(__name__)

# Which side gave an image key's dtype or shape: the caller or the buffer itself.
_FROM_CALLER = "caller"
_FROM_BUFFER = "buffer"


def _view(content: BufferLike) -> memoryview:
    """A memoryview of ``content``, checked to be C-contiguous (no copy is made)."""
    try:
        view = memoryview(content)  # type: ignore[arg-type]  # checked here, at runtime
    except TypeError as exc:
        raise ContentTypeError(
            f"content {reprlib.repr(content)} of type {type(content).__name__!r} does not "
            "support the buffer protocol; "
            "pass bytes, a memoryview, a numpy array or a contiguous tensor's numpy view"
        ) from exc
    if not view.c_contiguous:
        raise ContentError(
            f"content must be C-contiguous to be hashed in place; got shape {view.shape!r} with "
            f"strides {view.strides!r}: pass a contiguous copy"
        )
    return view


def _digest_view(view: memoryview) -> bytes:
    if view.nbytes == 0:
        return digest_bytes(memoryview(b""))
    flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    return digest_bytes(flat)


def content_digest(content: BufferLike) -> bytes:
    """XXH3-128 of the raw bytes of ``content``, in place and without copying.

    Args:
        content: Any C-contiguous object with the buffer protocol; only its bytes count (not its
            shape or element type).

    Returns:
        16 bytes, the same in every process (explicit seed, independent of ``PYTHONHASHSEED``).

    Raises:
        ContentTypeError: ``content`` has no buffer protocol.
        ContentError: ``content`` is not C-contiguous.
    """
    return _digest_view(_view(content))


def _bypass_reason(item: MultimodalItem) -> BypassReason | None:
    if item.modality is Modality.VIDEO:
        return BypassReason.VIDEO
    if item.modality is Modality.AUDIO:
        return BypassReason.AUDIO
    if item.source is FeatureSource.PRECOMPUTED_EMBEDDING:
        return BypassReason.PRECOMPUTED_EMBEDDING
    if item.source is FeatureSource.CALLER_FEATURES:
        return BypassReason.CALLER_FEATURES
    if item.content is None:
        return BypassReason.MISSING_CONTENT
    return None


def image_key(item: MultimodalItem, *, order: int, processor: ProcessorFingerprint) -> ImageKey:
    """The fixed-size key of one image at its place in a prompt.

    The key digests, in one length-prefixed record: the content kind, the content digest, the
    dtype and shape (the caller's, else the buffer's own format and shape, tagged by which), the
    processor fingerprint, ``order``, the span ``(start, length)`` and the grid.

    Args:
        item: An image with content, produced by the engine's processor.
        order: 0-based index of the image among the prompt's images.
        processor: Fingerprint of the preprocessing that produced the image's tokens.

    Returns:
        The key; ``digest`` is 16 bytes.

    Raises:
        UnsupportedItemError: ``item`` is not an image, has no content, or its features were not
            produced by the processor (those prompts bypass; see :func:`build_prompt_identity`).
        ContentError: The content is not C-contiguous, or the caller's shape cannot describe its
            size.
        InvalidPromptError: ``order`` is not an int >= 0.
    """
    reason = _bypass_reason(item)
    if reason is not None:
        raise UnsupportedItemError(
            f"item {item!r} gets no image key ({reason.value!r}); only processed images with "
            "content do"
        )
    _check_int(order, "order", 0)
    assert item.content is not None  # excluded by _bypass_reason
    view = _view(item.content)
    nbytes = view.nbytes
    if item.shape is not None:
        count = math.prod(item.shape)
        if (count == 0 and nbytes != 0) or (count != 0 and nbytes % count != 0):
            raise ContentError(
                f"shape {item.shape!r} ({count} elements) cannot describe {nbytes} content bytes"
            )
    dtype_source = _FROM_BUFFER if item.dtype is None else _FROM_CALLER
    dtype = view.format if item.dtype is None else item.dtype
    shape_source = _FROM_BUFFER if item.shape is None else _FROM_CALLER
    shape = item.shape if item.shape is not None else tuple(view.shape or ())
    digest_of_content = _digest_view(view)
    digest = (
        Packer("image-key")
        .text(item.content_kind.value)
        .blob(digest_of_content)
        .text(dtype_source)
        .text(dtype)
        .text(shape_source)
        .integers(shape)
        .blob(processor.digest)
        .integer(order)
        .integer(item.start)
        .integer(item.length)
        .optional_integers(item.grid)
        .digest()
    )
    return ImageKey(
        digest=digest,
        content_digest=digest_of_content,
        order=order,
        start=item.start,
        length=item.length,
        grid=item.grid,
    )


def _check_int(value: object, name: str, minimum: int) -> int:
    if not is_int_at_least(value, minimum):
        raise InvalidPromptError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_spans(
    items: tuple[MultimodalItem, ...], num_tokens: int, spatial_merge_size: int | None
) -> None:
    for index, item in enumerate(items):
        if item.end > num_tokens:
            raise SpanOutOfRangeError(
                f"item {index} spans tokens [{item.start}, {item.end}) (start {item.start}, "
                f"length {item.length}) but the prompt has "
                f"{num_tokens} tokens"
            )
        if spatial_merge_size is not None and item.grid is not None:
            t, h, w = item.grid
            patches = t * h * w
            expected, rest = divmod(patches, spatial_merge_size**2)
            if rest or expected != item.length:
                raise InvalidGridError(
                    f"item {index} has grid {item.grid!r} ({patches} patches) and span length "
                    f"{item.length}; with spatial_merge_size {spatial_merge_size} the span must "
                    f"be t·h·w / {spatial_merge_size**2} tokens"
                )
    ordered = sorted(range(len(items)), key=lambda i: items[i].start)
    for before, after in itertools.pairwise(ordered):
        a, b = items[before], items[after]
        if a.end > b.start:
            raise OverlappingSpansError(
                f"item {before} spans [{a.start}, {a.end}) and item {after} spans "
                f"[{b.start}, {b.end}); placeholder spans must not overlap"
            )


def _page_identities(
    keys: tuple[ImageKey, ...], num_tokens: int, page_size: int
) -> tuple[bytes, ...]:
    # Each overlap is (image key, offset of the overlap's first token inside the image). With the
    # key's span this fixes the overlap exactly: a nonzero offset puts the page at
    # start + offset, a zero offset at the page holding the image's first token.
    overlaps: dict[int, list[tuple[ImageKey, int]]] = {}
    for key in sorted(keys, key=lambda k: k.start):
        for page in range(key.start // page_size, (key.end - 1) // page_size + 1):
            overlaps.setdefault(page, []).append(
                (key, max(key.start, page * page_size) - key.start)
            )
    identities = [b""] * (-(-num_tokens // page_size))
    for page, parts in overlaps.items():
        packer = Packer("page").integer(page_size).sequence_header(len(parts))
        for key, offset_in_image in parts:
            packer.blob(key.digest).integer(offset_in_image)
        identities[page] = packer.digest()
    return tuple(identities)


def build_prompt_identity(
    num_tokens: int,
    items: Iterable[MultimodalItem],
    *,
    processor: ProcessorFingerprint,
    page_size: int = DEFAULT_PAGE_SIZE,
    spatial_merge_size: int | None = None,
) -> PromptIdentity:
    """Image keys and per-page extra identity for one prompt.

    The bypass check runs first, over the items in the engine's order: the first video, audio,
    precomputed-embedding, caller-features or content-less item makes the whole prompt not reusable
    and nothing else is checked or hashed. Otherwise every span is validated and every image is
    keyed with ``order`` = its index in ``items``.

    Args:
        num_tokens: Prompt length (tokens, >= 0), placeholders included.
        items: The prompt's multimodal items in the engine's order (may be empty: a text prompt,
            whose pages all get empty identity).
        processor: Fingerprint of the image preprocessing.
        page_size: Tokens per prefix-cache page (>= 1).
        spatial_merge_size: When given (>= 1), each image's span length must equal
            ``t·h·w / spatial_merge_size²`` of its grid (the Qwen-VL rule).

    Returns:
        The prompt's identity: reusable with one entry per page, or bypassed with the reason.

    Raises:
        InvalidPromptError: ``num_tokens``, ``page_size`` or ``spatial_merge_size`` out of range.
        SpanOutOfRangeError: A span ends past ``num_tokens``.
        OverlappingSpansError: Two spans share a token.
        InvalidGridError: A grid disagrees with its span under ``spatial_merge_size``.
        ContentError: Content not C-contiguous, or a shape that cannot describe it.
    """
    num_tokens = _check_int(num_tokens, "num_tokens", 0)
    if num_tokens > MAX_SEQ_LEN:
        msg = f"num_tokens={num_tokens!r} is not allowed; allowed: 0..{MAX_SEQ_LEN}"
        raise InvalidPromptError(msg)
    page_size = _check_int(page_size, "page_size", 1)
    if spatial_merge_size is not None:
        _check_int(spatial_merge_size, "spatial_merge_size", 1)
    items = tuple(items)
    for index, item in enumerate(items):
        reason = _bypass_reason(item)
        if reason is not None:
            logger.debug(
                "prompt of %d tokens not reusable: item %d is %s", num_tokens, index, reason.value
            )
            return PromptIdentity(
                num_tokens=num_tokens,
                page_size=page_size,
                image_keys=(),
                page_identities=(),
                bypass=Bypass(reason=reason, item_index=index),
            )
    _check_spans(items, num_tokens, spatial_merge_size)
    keys = tuple(
        image_key(item, order=order, processor=processor) for order, item in enumerate(items)
    )
    return PromptIdentity(
        num_tokens=num_tokens,
        page_size=page_size,
        image_keys=keys,
        page_identities=_page_identities(keys, num_tokens, page_size),
    )
