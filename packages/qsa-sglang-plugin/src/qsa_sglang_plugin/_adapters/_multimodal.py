"""SGLang multimodal items -> ``qsa_mm_prefix`` items, processor fingerprints and page identities.

Pure functions over SGLang 0.5.23's ``MultimodalInputs`` / ``MultimodalDataItem``; nothing here
registers a hook. SGLang and torch are imported lazily (the objects arrive already built), so
importing this module stays cheap.
"""

from __future__ import annotations

import enum
import importlib.metadata
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from qsa_mm_prefix import (
    DEFAULT_PAGE_SIZE,
    FeatureSource,
    Modality,
    MultimodalItem,
    ProcessorFingerprint,
    PromptIdentity,
    SpanError,
    build_prompt_identity,
)
from qsa_sglang_plugin._errors import AdapterError

__all__ = (
    "SGLangBypass",
    "SGLangBypassReason",
    "engine_processor_fingerprint",
    "mm_items_from_sglang",
    "processor_fingerprint_from_sglang",
    "prompt_identity_from_sglang",
)

logger = logging.getLogger(__name__)

#: The SGLang modality names the adapter knows, mapped onto ``qsa_mm_prefix.Modality``.
_MODALITIES: Final = {"IMAGE": Modality.IMAGE, "VIDEO": Modality.VIDEO, "AUDIO": Modality.AUDIO}


class SGLangBypassReason(enum.Enum):
    """Why an SGLang prompt gets no identity (never matched, never captured).

    The first five mirror ``qsa_mm_prefix.BypassReason``; the rest are shapes of SGLang items the
    adapter cannot describe exactly as one ``qsa_mm_prefix.MultimodalItem``.
    """

    VIDEO = "video"
    AUDIO = "audio"
    PRECOMPUTED_EMBEDDING = "precomputed-embedding"
    CALLER_FEATURES = "caller-features"
    MISSING_CONTENT = "missing-content"
    UNKNOWN_MODALITY = "unknown-modality"
    NO_SPAN = "no-span"
    MULTI_SPAN = "multi-span"
    BAD_SPAN = "bad-span"
    BAD_GRID = "bad-grid"
    CONTENT_ON_DEVICE = "content-on-device"
    UNSUPPORTED_CONTENT = "unsupported-content"


@dataclass(frozen=True, slots=True)
class SGLangBypass:
    """An SGLang prompt that must not be reused, the first offending item and why.

    Has the same ``reusable`` / ``bypass_reason`` surface as ``qsa_mm_prefix.PromptIdentity``, so
    wiring code can test either with ``if not identity.reusable``.

    Attributes:
        reason: The bypass class.
        item_index: Index of the offending item in ``MultimodalInputs.mm_items``.
        detail: The offending value, for logs (e.g. ``"offsets=[(3, 9), (20, 40)]"``).
    """

    reason: SGLangBypassReason
    item_index: int
    detail: str

    @property
    def reusable(self) -> bool:
        """Always ``False``."""
        return False

    @property
    def bypass_reason(self) -> SGLangBypassReason:
        """The bypass class."""
        return self.reason


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def processor_fingerprint_from_sglang(
    processor: object,
    *,
    hf_config: object | None = None,
    extra: Mapping[str, object] | None = None,
) -> ProcessorFingerprint:
    """Fingerprint the processor that turned a request's media into pixels and placeholder tokens.

    ``name`` is the processor's ``module.qualname``; ``version`` pins ``transformers`` and
    ``sglang`` (their processing code is part of the output). The arguments are the processor's
    own account of its output-changing settings: SGLang's ``preprocess_fingerprint_payload()``
    (the payload SGLang hashes into its artifact keys) when the object has it, else an HF image
    processor's ``to_dict()``; plus the checkpoint's ``model_type`` and ``architectures`` from
    ``hf_config`` and any ``extra`` settings (e.g. the model revision).

    Args:
        processor: An SGLang ``BaseMultimodalProcessor`` or an HF image processor.
        hf_config: The checkpoint's HF config (``to_dict()`` is read), or ``None``.
        extra: More output-changing settings, canonicalised like the payload.

    Raises:
        AdapterError: The processor exposes neither ``preprocess_fingerprint_payload()`` nor
            ``to_dict()``.
        qsa_mm_prefix.InvalidFingerprintError: Its payload has a non-``str`` mapping key.
        qsa_mm_prefix.UnsupportedArgumentError: A payload value has no canonical encoding.
    """
    if hasattr(processor, "preprocess_fingerprint_payload"):
        payload = processor.preprocess_fingerprint_payload()
    elif hasattr(processor, "to_dict"):
        payload = processor.to_dict()
    else:
        msg = (
            f"processor {type(processor).__qualname__!r} exposes neither "
            "preprocess_fingerprint_payload() nor to_dict(); its settings cannot be fingerprinted"
        )
        raise AdapterError(msg)
    settings: dict[str, object] = {"processor": payload}
    if hf_config is not None:
        cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)  # type: ignore[call-overload]
        settings["model_type"] = cfg.get("model_type")
        settings["architectures"] = cfg.get("architectures")
    if extra:
        settings["extra"] = dict(extra)
    kind = type(processor)
    version = f"transformers=={_dist_version('transformers')};sglang=={_dist_version('sglang')}"
    name = f"{kind.__module__}.{kind.__qualname__}"
    return ProcessorFingerprint.from_settings(name, version, settings)


def engine_processor_fingerprint(
    server_args: Any, model_config: Any
) -> ProcessorFingerprint | None:
    """The fingerprint of the image processor this engine's requests go through, if any.

    Call it in a scheduler process (SGLang's runtime context is published): it loads the Hugging
    Face processor with the arguments SGLang's scheduler loads it with, and fingerprints its image
    processor with the checkpoint config and the settings SGLang applies around it (the
    image-processor backend, the feature transport).

    Args:
        server_args: the engine's ``ServerArgs``.
        model_config: the engine's ``ModelConfig``.

    Returns:
        ``None`` for a model without images, an engine that skips its tokenizer (no processor
        runs there) or a processor that does not load (logged): image prompts then bypass.
    """
    if not getattr(model_config, "is_multimodal", False) or server_args.skip_tokenizer_init:
        return None
    from sglang.srt.runtime_context import get_mm, get_model, get_serving
    from sglang.srt.utils.hf_transformers_utils import (
        get_processor,
        resolve_image_processor_backend,
    )

    serving, model = get_serving(), get_model()
    backend = resolve_image_processor_backend(get_mm())
    try:
        processor = get_processor(
            serving.tokenizer_path,
            tokenizer_mode=serving.tokenizer_mode,
            trust_remote_code=model.trust_remote_code,
            revision=model.revision,
            image_processor_backend=backend,
            tokenizer_backend=serving.tokenizer_backend,
            model_name=model.model_path,
        )
    except Exception:  # whatever the loader raises: images bypass, text prompts are unaffected
        logger.exception("image prompts will not be reused: their processor does not load")
        return None
    return processor_fingerprint_from_sglang(
        getattr(processor, "image_processor", processor),
        hf_config=model_config.hf_config,
        extra={
            "image_processor_backend": str(backend),
            "mm_feature_transport": str(getattr(server_args, "mm_feature_transport", None)),
        },
    )


def _grid(item: Any) -> tuple[int, int, int] | str | None:
    """The item's ``image_grid_thw`` as ``(t, h, w)``, ``None`` when absent, or a bypass detail."""
    raw = item.model_specific_data.get("image_grid_thw")
    if raw is None:
        return None
    import torch

    try:
        grid = torch.as_tensor(raw)
    except (TypeError, ValueError, RuntimeError):
        return f"image_grid_thw={raw!r}"
    if grid.numel() != 3 or grid.dim() not in (1, 2) or grid.is_floating_point():
        return f"image_grid_thw of shape {tuple(grid.shape)!r} and dtype {grid.dtype}"
    t, h, w = (int(v) for v in grid.reshape(-1).tolist())
    if min(t, h, w) < 1:
        return f"image_grid_thw={(t, h, w)!r}"
    return (t, h, w)


def _content(feature: object) -> tuple[object, str, tuple[int, ...]] | SGLangBypassReason:
    """The feature as a C-contiguous uint8 buffer with its dtype name and shape, or a bypass."""
    import numpy as np
    import torch

    if isinstance(feature, torch.Tensor):
        if feature.device.type != "cpu":
            return SGLangBypassReason.CONTENT_ON_DEVICE
        tensor = feature.detach().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        return raw, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
    if isinstance(feature, np.ndarray) and feature.dtype != np.object_:
        array = np.ascontiguousarray(feature)
        return array.reshape(-1).view(np.uint8), str(array.dtype), tuple(array.shape)
    return SGLangBypassReason.UNSUPPORTED_CONTENT


def _is_set(value: object) -> bool:
    return value is not None and not (isinstance(value, list | tuple) and len(value) == 0)


def _item(index: int, item: Any) -> MultimodalItem | SGLangBypass:
    def bypass(reason: SGLangBypassReason, detail: str) -> SGLangBypass:
        return SGLangBypass(reason=reason, item_index=index, detail=detail)

    modality = _MODALITIES.get(getattr(item.modality, "name", ""))
    if modality is None:
        return bypass(SGLangBypassReason.UNKNOWN_MODALITY, f"modality={item.modality!r}")
    if modality is Modality.VIDEO:
        return bypass(SGLangBypassReason.VIDEO, f"modality={item.modality!r}")
    if modality is Modality.AUDIO:
        return bypass(SGLangBypassReason.AUDIO, f"modality={item.modality!r}")
    fmt = getattr(item.format, "name", repr(item.format))
    if fmt == "PRECOMPUTED_EMBEDDING" or _is_set(item.precomputed_embeddings):
        return bypass(SGLangBypassReason.PRECOMPUTED_EMBEDDING, f"format={fmt}")
    if fmt != "NORMAL":
        return bypass(SGLangBypassReason.CALLER_FEATURES, f"format={fmt}")
    offsets = item.offsets
    if not offsets:
        return bypass(SGLangBypassReason.NO_SPAN, f"offsets={offsets!r}")
    if len(offsets) != 1:
        return bypass(SGLangBypassReason.MULTI_SPAN, f"offsets={list(offsets)!r}")
    try:
        first, last = (int(v) for v in offsets[0])
    except (TypeError, ValueError):
        return bypass(SGLangBypassReason.BAD_SPAN, f"offsets={list(offsets)!r}")
    grid = _grid(item)
    if isinstance(grid, str):
        return bypass(SGLangBypassReason.BAD_GRID, grid)
    if item.feature is None:
        return bypass(SGLangBypassReason.MISSING_CONTENT, "feature=None")
    content = _content(item.feature)
    if isinstance(content, SGLangBypassReason):
        return bypass(content, f"feature of type {type(item.feature).__qualname__}")
    raw, dtype, shape = content
    try:
        return MultimodalItem(
            modality=modality,
            start=first,
            length=last - first + 1,
            content=raw,
            grid=grid,
            dtype=dtype,
            shape=shape,
            source=FeatureSource.PROCESSOR,
        )
    except SpanError:
        return bypass(SGLangBypassReason.BAD_SPAN, f"offsets={list(offsets)!r}")


def mm_items_from_sglang(mm_inputs: Any) -> tuple[MultimodalItem, ...] | SGLangBypass:
    """Describe SGLang's multimodal items as ``qsa_mm_prefix`` items, or say why not.

    Per ``MultimodalDataItem``, in ``mm_items`` order (the order SGLang gives ``order``):

    * ``modality``: ``IMAGE`` maps; ``VIDEO`` / ``AUDIO`` (or an unknown value) bypass.
    * features: ``format`` must be ``NORMAL`` and ``precomputed_embeddings`` unset, else
      ``PRECOMPUTED_EMBEDDING`` / ``CALLER_FEATURES``.
    * span: exactly one inclusive ``offsets`` pair ``(s, e)`` -> ``start=s``, ``length=e-s+1``;
      none is ``NO_SPAN``, several ``MULTI_SPAN`` (an item holding several images), ``e < s`` or a
      negative start ``BAD_SPAN``.
    * grid: ``model_specific_data["image_grid_thw"]`` of one row ``[1, 3]`` or ``[3]`` of positive
      ints -> ``(t, h, w)``; absent -> ``None``; anything else ``BAD_GRID``.
    * content: ``feature`` (``pixel_values``, e.g. ``[N, C·P·P]`` bfloat16) as a C-contiguous CPU
      tensor or numpy array, hashed through a flat ``uint8`` view with its dtype name
      (``"bfloat16"``) and shape; a non-contiguous tensor is copied contiguous first. ``None`` is
      ``MISSING_CONTENT``, a CUDA tensor ``CONTENT_ON_DEVICE``, any other object (a list of
      tensors, a transport proxy) ``UNSUPPORTED_CONTENT``.

    Args:
        mm_inputs: SGLang's ``MultimodalInputs`` (``req.multimodal_inputs``), or ``None`` for a
            text prompt.

    Returns:
        One item per ``mm_items`` entry, or the first item's bypass. Never a partial list.
    """
    if mm_inputs is None:
        return ()
    items: list[MultimodalItem] = []
    for index, raw in enumerate(mm_inputs.mm_items):
        mapped = _item(index, raw)
        if isinstance(mapped, SGLangBypass):
            logger.debug(
                "multimodal prompt not reusable: item %d is %s (%s)",
                index,
                mapped.reason.value,
                mapped.detail,
            )
            return mapped
        items.append(mapped)
    return tuple(items)


def prompt_identity_from_sglang(
    req: Any,
    *,
    processor: ProcessorFingerprint,
    page_size: int = DEFAULT_PAGE_SIZE,
    spatial_merge_size: int | None = None,
) -> PromptIdentity | SGLangBypass:
    """Page identities of one SGLang request, or why it is not reusable.

    Args:
        req: An SGLang ``Req`` or any object with ``origin_input_ids`` (the prompt's token ids,
            placeholders included; ``len`` is the prompt length in tokens) and
            ``multimodal_inputs`` (``MultimodalInputs`` or ``None``).
        processor: The fingerprint of the processor that built the items
            (:func:`processor_fingerprint_from_sglang`).
        page_size: Tokens per prefix-cache page (64 for QSA models).
        spatial_merge_size: The vision config's ``spatial_merge_size``; when given each image's
            span must equal ``t·h·w / merge²`` of its grid.

    Returns:
        A reusable ``PromptIdentity`` (one entry per page, ``b""`` for pages without images), or
        an :class:`SGLangBypass`. Both expose ``reusable``.

    Raises:
        qsa_mm_prefix.SpanError: a span past the prompt or two spans that overlap (an engine
            bug, not a bypass).
        qsa_mm_prefix.InvalidGridError: a grid that disagrees with its span.
    """
    items = mm_items_from_sglang(req.multimodal_inputs)
    if isinstance(items, SGLangBypass):
        return items
    num_tokens = len(req.origin_input_ids)
    return build_prompt_identity(
        num_tokens,
        items,
        processor=processor,
        page_size=page_size,
        spatial_merge_size=spatial_merge_size,
    )
