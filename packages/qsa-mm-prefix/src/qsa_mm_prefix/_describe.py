"""An engine's media items described from plain values, and a prompt's page extras or bypass.

A serving engine reads its own item objects (modality name, where the features came from, the
token spans, the grid, the feature tensor) and hands the values to :func:`describe_item`; what
those values mean, and every reason one of them makes a prompt not reusable, is decided here,
once for every engine. torch and numpy are not dependencies: a feature is recognised as a
``torch.Tensor`` or a ``numpy.ndarray`` only when that module is already imported (an object of
its type cannot exist otherwise).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Hashable, Iterable
from typing import Any

from qsa_mm_prefix._errors import MultimodalPrefixError, SpanError
from qsa_mm_prefix._identity import build_prompt_identity
from qsa_mm_prefix._types import (
    DEFAULT_PAGE_SIZE,
    Bypass,
    BypassReason,
    FeatureSource,
    Modality,
    MultimodalItem,
    ProcessorFingerprint,
    PromptIdentity,
)

logger = logging.getLogger(__name__)

_SOURCE_BYPASS = {
    FeatureSource.PRECOMPUTED_EMBEDDING: BypassReason.PRECOMPUTED_EMBEDDING,
    FeatureSource.CALLER_FEATURES: BypassReason.CALLER_FEATURES,
}


def _grid(raw: object) -> tuple[int, int, int] | str | None:
    """``raw`` as ``(t, h, w)``, ``None`` when absent, or the bypass detail of a bad grid."""
    if raw is None:
        return None
    shape = getattr(raw, "shape", None)
    if shape is not None:  # a tensor or an array: one row [1, 3] or [3] of integers
        kind = str(getattr(raw, "dtype", ""))
        if len(shape) not in (1, 2) or _numel(shape) != 3 or "float" in kind or "complex" in kind:
            return (
                f"image_grid_thw of shape {tuple(shape)!r} and dtype {kind.removeprefix('torch.')}"
            )
        values = list(raw.reshape(-1).tolist())  # type: ignore[attr-defined]
    elif isinstance(raw, list | tuple):
        flat = raw[0] if len(raw) == 1 and isinstance(raw[0], list | tuple) else raw
        values = list(flat)
        if len(values) != 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values
        ):
            return f"image_grid_thw={raw!r}"
    else:
        return f"image_grid_thw={raw!r}"
    t, h, w = (int(v) for v in values)
    if min(t, h, w) < 1:
        return f"image_grid_thw={(t, h, w)!r}"
    return (t, h, w)


def _numel(shape: Iterable[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _content(feature: object) -> tuple[object, str, tuple[int, ...]] | BypassReason:
    """``feature`` as a flat C-contiguous ``uint8`` buffer, its dtype name and shape; or a bypass.

    A CPU ``torch.Tensor`` (``bfloat16`` included) or a numpy array of numbers; a
    non-contiguous one is copied contiguous first.
    """
    torch: Any = sys.modules.get("torch")
    if torch is not None and isinstance(feature, torch.Tensor):
        if feature.device.type != "cpu":
            return BypassReason.CONTENT_ON_DEVICE
        tensor = feature.detach().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        return raw, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
    np: Any = sys.modules.get("numpy")
    if np is not None and isinstance(feature, np.ndarray) and feature.dtype != np.object_:
        array = np.ascontiguousarray(feature)
        return array.reshape(-1).view(np.uint8), str(array.dtype), tuple(array.shape)
    return BypassReason.UNSUPPORTED_CONTENT


def describe_item(
    index: int,
    *,
    modality: str,
    source: FeatureSource,
    offsets: object,
    grid: object,
    feature: object,
) -> MultimodalItem | Bypass:
    """One engine item as a :class:`MultimodalItem`, or the :class:`Bypass` that it causes.

    Checked in this order, the first failure the bypass:

    * ``modality``: its name, any case (``"IMAGE"``); ``video`` / ``audio`` bypass as such, a
      name that is no :class:`Modality` as ``UNKNOWN_MODALITY``.
    * ``source``: anything but ``PROCESSOR`` bypasses (``PRECOMPUTED_EMBEDDING``,
      ``CALLER_FEATURES``).
    * ``offsets``: exactly one inclusive token span ``(s, e)`` -> ``start=s``, ``length=e-s+1``;
      none is ``NO_SPAN``, several ``MULTI_SPAN`` (an item holding several images), ``e < s``,
      a negative start or non-integers ``BAD_SPAN``.
    * ``grid``: ``(t, h, w)`` as one row ``[1, 3]`` or ``[3]`` of positive integers (a tensor,
      an array or a list); ``None`` -> no grid; anything else ``BAD_GRID``.
    * ``feature`` (e.g. ``pixel_values``, ``[N, C·P·P]`` bfloat16): a CPU ``torch.Tensor`` or a
      numpy array, hashed through a flat ``uint8`` view with its dtype name (``"bfloat16"``) and
      shape; ``None`` is ``MISSING_CONTENT``, a tensor on another device ``CONTENT_ON_DEVICE``,
      any other object (a list of tensors, a transport proxy) ``UNSUPPORTED_CONTENT``.

    Args:
        index: the item's index in the engine's item list (the bypass names it).
        modality: the engine's name of the item's modality.
        source: where the features come from.
        offsets: the engine's inclusive ``(first, last)`` token spans (a sequence of pairs).
        grid: the vision grid in patches before any spatial merge, or ``None``.
        feature: the processed content.
    """

    def bypass(reason: BypassReason, detail: str) -> Bypass:
        return Bypass(reason=reason, item_index=index, detail=detail)

    kind = next((m for m in Modality if m.value == str(modality).lower()), None)
    if kind is None:
        return bypass(BypassReason.UNKNOWN_MODALITY, f"modality={modality!r}")
    if kind is not Modality.IMAGE:
        return bypass(BypassReason(kind.value), f"modality={modality!r}")
    if source is not FeatureSource.PROCESSOR:
        return bypass(_SOURCE_BYPASS[source], f"source={source.value}")
    spans = list(offsets) if isinstance(offsets, Iterable) else []
    if not spans:
        return bypass(BypassReason.NO_SPAN, f"offsets={offsets!r}")
    if len(spans) != 1:
        return bypass(BypassReason.MULTI_SPAN, f"offsets={spans!r}")
    try:
        first, last = (int(v) for v in spans[0])
    except (TypeError, ValueError):
        return bypass(BypassReason.BAD_SPAN, f"offsets={spans!r}")
    thw = _grid(grid)
    if isinstance(thw, str):
        return bypass(BypassReason.BAD_GRID, thw)
    if feature is None:
        return bypass(BypassReason.MISSING_CONTENT, "feature=None")
    content = _content(feature)
    if isinstance(content, BypassReason):
        return bypass(content, f"feature of type {type(feature).__qualname__}")
    raw, dtype, shape = content
    try:
        return MultimodalItem(
            modality=kind,
            start=first,
            length=last - first + 1,
            content=raw,
            grid=thw,
            dtype=dtype,
            shape=shape,
            source=source,
        )
    except SpanError:
        return bypass(BypassReason.BAD_SPAN, f"offsets={spans!r}")


def collect_items(
    described: Iterable[MultimodalItem | Bypass],
) -> tuple[MultimodalItem, ...] | Bypass:
    """The described items of one prompt, or the first bypass among them (never a partial list).

    ``described`` is consumed only up to its first :class:`Bypass`.
    """
    items: list[MultimodalItem] = []
    for item in described:
        if isinstance(item, Bypass):
            logger.debug(
                "multimodal prompt not reusable: item %d is %s (%s)",
                item.item_index,
                item.reason.value,
                item.detail,
            )
            return item
        items.append(item)
    return tuple(items)


def prompt_identity(
    num_tokens: int,
    described: Iterable[MultimodalItem | Bypass],
    *,
    processor: ProcessorFingerprint,
    page_size: int = DEFAULT_PAGE_SIZE,
    spatial_merge_size: int | None = None,
) -> PromptIdentity | Bypass:
    """:func:`build_prompt_identity` of a prompt's described items, or the first one's bypass.

    ``described``: :func:`describe_item`'s results in the engine's order (consumed only up to
    the first :class:`Bypass`, as :func:`collect_items`); the other arguments as
    :func:`build_prompt_identity`'s, whose errors it raises.
    """
    items = collect_items(described)
    if isinstance(items, Bypass):
        return items
    return build_prompt_identity(
        num_tokens,
        items,
        processor=processor,
        page_size=page_size,
        spatial_merge_size=spatial_merge_size,
    )


def prompt_page_extras(
    num_tokens: int,
    items: Iterable[MultimodalItem | Bypass] | None,
    *,
    processor: ProcessorFingerprint | None,
    page_size: int,
    spatial_merge_size: int | None = None,
    input_embeds: bool = False,
    embed_overrides: bool = False,
    holder: Hashable = None,
) -> dict[int, bytes] | BypassReason:
    """A prompt's page extras for its prefix keys (``page -> identity``), or why it has none.

    In this order: embeddings given instead of token ids (``INPUT_EMBEDS``) or positional
    embedding overrides (``EMBED_OVERRIDES``) bypass; a prompt without media (``items`` is
    ``None``) has no extras; media without a processor fingerprint bypass (``NO_PROCESSOR``);
    then the first item's bypass (``items`` is consumed only here), and
    :func:`build_prompt_identity`'s. Items whose spans or grids contradict the prompt are an
    engine bug: logged with the traceback, and ``INVALID_MULTIMODAL``.

    Args:
        num_tokens: the prompt's length (tokens), placeholders included.
        items: the prompt's described items (:func:`describe_item`) in the engine's order, or
            ``None`` for a prompt without media.
        processor: the fingerprint of the processor that built the items, if the engine has one.
        page_size: tokens per prefix-cache page.
        spatial_merge_size: when given, each image's span must be ``t·h·w / merge²`` of its grid.
        input_embeds: the prompt came as embeddings.
        embed_overrides: the prompt carries positional embedding overrides.
        holder: the request, for the log.

    Returns:
        ``page -> identity`` of the pages an image overlaps (empty for a text prompt), or the
        bypass reason.
    """
    if input_embeds:
        return BypassReason.INPUT_EMBEDS
    if embed_overrides:
        return BypassReason.EMBED_OVERRIDES
    if items is None:
        return {}
    if processor is None:
        return BypassReason.NO_PROCESSOR
    collected = collect_items(items)
    if isinstance(collected, Bypass):
        return collected.reason
    try:
        identity = build_prompt_identity(
            num_tokens,
            collected,
            processor=processor,
            page_size=page_size,
            spatial_merge_size=spatial_merge_size,
        )
    except MultimodalPrefixError:
        logger.exception("prefix cache: the media items of %r contradict its prompt", holder)
        return BypassReason.INVALID_MULTIMODAL
    if identity.bypass_reason is not None:
        return identity.bypass_reason
    return identity.page_extras
