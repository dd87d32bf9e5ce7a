"""SGLang's multimodal items -> ``qsa_mm_prefix`` items; the engine's processor fingerprint.

What the values mean and each bypass: :func:`qsa_mm_prefix.describe_item`,
:meth:`qsa_mm_prefix.ProcessorFingerprint.from_processor` (``docs/mm-prefix.md``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Final

from qsa_mm_prefix import (
    DEFAULT_PAGE_SIZE,
    Bypass,
    FeatureSource,
    MultimodalItem,
    ProcessorFingerprint,
    PromptIdentity,
    collect_items,
    describe_item,
    prompt_identity,
)

__all__ = (
    "PROCESSING_PACKAGES",
    "engine_processor_fingerprint",
    "mm_items_from_sglang",
    "prompt_identity_from_sglang",
    "sglang_items",
)

logger = logging.getLogger(__name__)

#: The distributions whose processing code is part of a processor's output (their versions are
#: pinned in its fingerprint).
PROCESSING_PACKAGES: Final = ("transformers", "sglang")


def engine_processor_fingerprint(
    server_args: Any, model_config: Any
) -> ProcessorFingerprint | None:
    """The fingerprint of the image processor the scheduler loads as SGLang does, if any.

    ``None`` (image prompts bypass) for a model without images, an engine that skips its
    tokenizer, or a processor that does not load (logged).
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
    return ProcessorFingerprint.from_processor(
        getattr(processor, "image_processor", processor),
        hf_config=model_config.hf_config,
        extra={
            "image_processor_backend": str(backend),
            "mm_feature_transport": str(getattr(server_args, "mm_feature_transport", None)),
        },
        packages=PROCESSING_PACKAGES,
    )


def sglang_items(mm_inputs: Any) -> Iterator[MultimodalItem | Bypass]:
    """Each ``MultimodalDataItem`` of ``mm_inputs`` (in order) through :func:`describe_item`.

    The source: :meth:`FeatureSource.of_item` of its format; the grid: ``image_grid_thw``.
    """
    for index, item in enumerate(mm_inputs.mm_items):
        yield describe_item(
            index,
            modality=getattr(item.modality, "name", repr(item.modality)),
            source=FeatureSource.of_item(
                getattr(item.format, "name", repr(item.format)), item.precomputed_embeddings
            ),
            offsets=item.offsets,
            grid=item.model_specific_data.get("image_grid_thw"),
            feature=item.feature,
        )


def mm_items_from_sglang(mm_inputs: Any) -> tuple[MultimodalItem, ...] | Bypass:
    """SGLang's items (``req.multimodal_inputs`` or ``None``) as items, or the first's bypass."""
    return () if mm_inputs is None else collect_items(sglang_items(mm_inputs))


def prompt_identity_from_sglang(
    req: Any,
    *,
    processor: ProcessorFingerprint,
    page_size: int = DEFAULT_PAGE_SIZE,
    spatial_merge_size: int | None = None,
) -> PromptIdentity | Bypass:
    """:func:`qsa_mm_prefix.prompt_identity` of an SGLang ``Req`` (both results: ``reusable``).

    Raises:
        qsa_mm_prefix.SpanError: spans past the prompt or overlapping (an engine bug).
        qsa_mm_prefix.InvalidGridError: a grid that disagrees with its span.
    """
    mm_inputs = req.multimodal_inputs
    return prompt_identity(
        len(req.origin_input_ids),
        () if mm_inputs is None else sglang_items(mm_inputs),
        processor=processor,
        page_size=page_size,
        spatial_merge_size=spatial_merge_size,
    )
