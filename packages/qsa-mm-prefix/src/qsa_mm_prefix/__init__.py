"""qsa-mm-prefix: identity of images in prompts, for exact multimodal prefix reuse.

Token ids alone do not identify a multimodal prompt: every image expands to the same placeholder
tokens. This package turns each image into a fixed-size key (content digest, processor fingerprint,
order among the prompt's images, token span and grid) and gives every page of the prompt the extra
identity a prefix cache mixes into that page's key: empty for pages without images, a digest of the
overlapping images' keys and overlap offsets otherwise. Video, audio, precomputed embeddings and
caller-supplied features make a prompt not reusable, with the reason.

Engine-agnostic: a serving engine reads its own items' fields and describes each with
:func:`describe_item` (or builds :class:`MultimodalItem` values itself);
:func:`prompt_page_extras` gives a prompt's page extras or its :class:`BypassReason`. Hashing is
XXH3-128 with explicit seeds, independent of the process and of ``PYTHONHASHSEED``.
"""

from qsa_mm_prefix._describe import (
    collect_items,
    describe_item,
    prompt_identity,
    prompt_page_extras,
)
from qsa_mm_prefix._encoding import ENCODING_VERSION, KEY_BYTES, PreprocessArg
from qsa_mm_prefix._errors import (
    ContentError,
    ContentTypeError,
    InvalidFingerprintError,
    InvalidGridError,
    InvalidPromptError,
    MultimodalPrefixError,
    OverlappingSpansError,
    SpanError,
    SpanOutOfRangeError,
    UnsupportedArgumentError,
    UnsupportedItemError,
)
from qsa_mm_prefix._identity import build_prompt_identity, content_digest, image_key
from qsa_mm_prefix._types import (
    DEFAULT_PAGE_SIZE,
    BufferLike,
    Bypass,
    BypassReason,
    ContentKind,
    FeatureSource,
    ImageKey,
    Modality,
    MultimodalItem,
    ProcessorFingerprint,
    PromptIdentity,
    spatial_merge_size,
)
from qsa_mm_prefix._version import __version__

__all__ = (  # noqa: RUF022 (grouped by topic, as the comments say)
    # Adapter shape: what an engine fills from its own multimodal items
    "BufferLike",
    "ContentKind",
    "FeatureSource",
    "Modality",
    "MultimodalItem",
    "PreprocessArg",
    "ProcessorFingerprint",
    "describe_item",
    "collect_items",
    # Identity
    "Bypass",
    "BypassReason",
    "ImageKey",
    "PromptIdentity",
    "build_prompt_identity",
    "prompt_identity",
    "content_digest",
    "image_key",
    "prompt_page_extras",
    "spatial_merge_size",
    # Constants
    "DEFAULT_PAGE_SIZE",
    "ENCODING_VERSION",
    "KEY_BYTES",
    # Errors
    "ContentError",
    "ContentTypeError",
    "InvalidFingerprintError",
    "InvalidGridError",
    "InvalidPromptError",
    "MultimodalPrefixError",
    "OverlappingSpansError",
    "SpanError",
    "SpanOutOfRangeError",
    "UnsupportedArgumentError",
    "UnsupportedItemError",
    # Version
    "__version__",
)
