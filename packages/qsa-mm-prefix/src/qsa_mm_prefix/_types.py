"""The value types: processor fingerprint, the adapter item, image keys and a prompt's identity."""

from __future__ import annotations

import enum
import importlib.metadata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Final, TypeAlias, TypeGuard

from qsa_core import QWEN38_FLASH_NEXT
from qsa_mm_prefix._encoding import Packer, PreprocessArg
from qsa_mm_prefix._errors import (
    ContentError,
    InvalidFingerprintError,
    InvalidGridError,
    SpanOutOfRangeError,
)

BufferLike: TypeAlias = object
"""Any object that supports the buffer protocol (``bytes``, ``memoryview``, a numpy array, ...).

Typed as ``object`` because numpy's stubs declare ``__buffer__`` only for Python >= 3.12, so a
precise ``Buffer`` annotation would reject numpy arrays under 3.11; the check happens when the
content is hashed and raises :class:`~qsa_mm_prefix.ContentTypeError`.
"""

DEFAULT_PAGE_SIZE: Final[int] = QWEN38_FLASH_NEXT.page_size
"""Tokens per page of the host prefix cache: the QSA profile's page size (64, forced by SGLang)."""


def is_int_at_least(value: object, minimum: int) -> TypeGuard[int]:
    """Whether ``value`` is a true ``int`` (not ``bool``) and ``>= minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_nonempty_str(value: object) -> bool:
    return isinstance(value, str) and value != ""


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _canonical(value: object, path: str) -> PreprocessArg:
    """``value`` as a :data:`PreprocessArg` (:meth:`ProcessorFingerprint.from_settings`)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, PurePath):
        return str(value)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value)  # torch is not a dependency: its dtype is recognised by name
    if isinstance(value, Mapping):
        out: dict[str, PreprocessArg] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                msg = f"setting key {key!r} at {path!r} is not a str; allowed: str keys"
                raise InvalidFingerprintError(msg)
            out[key] = _canonical(item, f"{path}.{key}")
        return out
    if isinstance(value, list | tuple):
        return [_canonical(item, f"{path}[{i}]") for i, item in enumerate(value)]
    return value  # type: ignore[return-value]  # checked by ProcessorFingerprint.create


def spatial_merge_size(hf_config: object) -> int | None:
    """``vision_config.spatial_merge_size`` of an HF checkpoint config (object or mapping).

    ``None`` without a vision config or without the field: spans are then not checked against
    their grids (:func:`build_prompt_identity`).
    """
    vision = getattr(hf_config, "vision_config", None)
    if vision is None and isinstance(hf_config, Mapping):
        vision = hf_config.get("vision_config")
    if vision is None:
        return None
    value = vision.get("spatial_merge_size") if isinstance(vision, Mapping) else None
    if value is None:
        value = getattr(vision, "spatial_merge_size", None)
    return None if value is None else int(value)


class Modality(enum.Enum):
    """What kind of media a multimodal item carries."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


class ContentKind(enum.Enum):
    """What an item's ``content`` bytes are.

    ``PIXELS`` is the processed pixel tensor the vision encoder reads (e.g. ``pixel_values``);
    ``ENCODED`` is the raw image file (PNG, JPEG, ...) that the fingerprinted processor turns into
    pixels. Both identify the image exactly when paired with the processor fingerprint; they hash
    to different keys, so an engine must use one kind consistently.
    """

    PIXELS = "pixels"
    ENCODED = "encoded"


class FeatureSource(enum.Enum):
    """Where an item's features come from.

    Only ``PROCESSOR`` (the engine's own processor ran on media the request sent) yields a key;
    embeddings or features a caller supplies are not tied to content this package can verify.
    """

    PROCESSOR = "processor"
    PRECOMPUTED_EMBEDDING = "precomputed-embedding"
    CALLER_FEATURES = "caller-features"

    @classmethod
    def of_item(cls, input_format: str, precomputed_embeddings: object) -> FeatureSource:
        """The source of an engine item given its input format's name and embeddings, if any.

        Embeddings (anything but ``None`` or an empty list or tuple) or the format
        ``PRECOMPUTED_EMBEDDING`` are ``PRECOMPUTED_EMBEDDING``; else the format ``NORMAL`` (media
        the engine's processor ran on) is ``PROCESSOR``, any other ``CALLER_FEATURES``.
        """
        embeddings = precomputed_embeddings
        unset = embeddings is None or (isinstance(embeddings, list | tuple) and not embeddings)
        if input_format == "PRECOMPUTED_EMBEDDING" or not unset:
            return cls.PRECOMPUTED_EMBEDDING
        return cls.PROCESSOR if input_format == "NORMAL" else cls.CALLER_FEATURES


class BypassReason(enum.Enum):
    """Why a prompt gets no identity and must never be matched or captured.

    One list for every layer that decides it: an item's media or features
    (:func:`build_prompt_identity`), an engine's item that is not one exact
    :class:`MultimodalItem` (:func:`describe_item`), and the prompt as a whole
    (:func:`prompt_page_extras`). The values are the label values operators see.
    """

    # the item's media or features
    VIDEO = "video"
    AUDIO = "audio"
    PRECOMPUTED_EMBEDDING = "precomputed-embedding"
    CALLER_FEATURES = "caller-features"
    MISSING_CONTENT = "missing-content"
    # an engine's item that cannot be described exactly
    UNKNOWN_MODALITY = "unknown-modality"
    NO_SPAN = "no-span"
    MULTI_SPAN = "multi-span"
    BAD_SPAN = "bad-span"
    BAD_GRID = "bad-grid"
    CONTENT_ON_DEVICE = "content-on-device"
    UNSUPPORTED_CONTENT = "unsupported-content"
    # the prompt as a whole
    INPUT_EMBEDS = "input-embeds"
    """Embeddings given instead of token ids."""
    EMBED_OVERRIDES = "embed-overrides"
    """Positional embedding overrides: the same ids carry other vectors."""
    NO_PROCESSOR = "no-processor"
    """Media, but no processor fingerprint on this engine."""
    INVALID_MULTIMODAL = "invalid-multimodal"
    """Media items whose spans or grids contradict the prompt (logged as an engine bug)."""


@dataclass(frozen=True, slots=True)
class ProcessorFingerprint:
    """Identity of the preprocessing that turns an image into the tokens the model sees.

    Build it with :meth:`create`. ``args_encoding`` is the canonical encoding of every argument
    that can change the processor's output (resize bounds, patch and merge sizes, mean and std,
    rescale factor, resampling filter, ...): mapping keys are sorted, ``True`` and ``1`` differ,
    ``1`` and ``1.0`` differ, a list and a tuple with equal items are equal.

    Attributes:
        name: Processor class or model processor name, e.g. ``"Qwen2VLImageProcessorFast"``.
        version: Version of the code that implements it, e.g. ``"transformers==4.57.1"``.
        args_encoding: Canonical bytes of the preprocessing arguments.
        digest: 16-byte digest of name, version and arguments (derived, not an argument).
    """

    name: str
    version: str
    args_encoding: bytes
    digest: bytes = field(init=False, repr=False, compare=False)

    @classmethod
    def create(
        cls, name: str, version: str, args: Mapping[str, PreprocessArg]
    ) -> ProcessorFingerprint:
        """Fingerprint a processor from its name, version and output-changing arguments.

        Args:
            name: Non-empty processor name.
            version: Non-empty version string of the processor's implementation.
            args: Every preprocessing argument that changes the output. Values are ``None``,
                ``bool``, integers, reals, ``str``, ``bytes``, and sequences or ``str``-keyed
                mappings of those (numpy scalars count as integers or reals).

        Raises:
            InvalidFingerprintError: ``name`` or ``version`` is empty, or an argument name is not
                a string.
            UnsupportedArgumentError: An argument value has another type.
        """
        if not _is_nonempty_str(name):
            raise InvalidFingerprintError(f"processor name must be a non-empty str, got {name!r}")
        if not _is_nonempty_str(version):
            raise InvalidFingerprintError(
                f"processor version must be a non-empty str, got {version!r}"
            )
        given: object = args
        if not isinstance(given, Mapping):
            raise InvalidFingerprintError(
                f"preprocessing arguments must be a mapping of names to values, got {args!r}"
            )
        bad = [key for key in args if not _is_nonempty_str(key)]
        if bad:
            raise InvalidFingerprintError(
                f"preprocessing argument names must be non-empty str, got {bad!r}"
            )
        packer = Packer("preprocess-args")
        packer.argument(dict(args))
        return cls(name=name, version=version, args_encoding=packer.encoded())

    @classmethod
    def from_settings(
        cls, name: str, version: str, settings: Mapping[str, object]
    ) -> ProcessorFingerprint:
        """Fingerprint a processor from its own account of its settings (e.g. an HF ``to_dict()``).

        The settings are made canonical first: an enum member becomes ``"Class.NAME"``, a path and
        a ``torch.dtype`` their ``str``, a tuple a list, mappings and sequences item by item;
        anything else goes to :meth:`create` as it is, which accepts or refuses it.

        Raises:
            InvalidFingerprintError: a mapping key that is not a ``str`` (named with its path), or
                what :meth:`create` refuses.
            UnsupportedArgumentError: a value with no canonical encoding.
        """
        args = {key: _canonical(value, key) for key, value in settings.items()}
        return cls.create(name, version, args)

    @classmethod
    def from_processor(
        cls,
        processor: object,
        *,
        hf_config: object | None = None,
        extra: Mapping[str, object] | None = None,
        packages: Sequence[str] = ("transformers",),
    ) -> ProcessorFingerprint:
        """Fingerprint a processor object by its own account of its output-changing settings.

        ``name`` is the processor's ``module.qualname``; ``version`` pins each of ``packages``
        (``"transformers==4.57.1;sglang==0.5.23"``: their processing code is part of the output,
        ``absent`` for one not installed). The settings are the processor's
        ``preprocess_fingerprint_payload()`` when it has one (the payload an engine's own
        processor hashes into its artifact keys), else its ``to_dict()`` (an HF image
        processor); plus the checkpoint's ``model_type`` and ``architectures`` from
        ``hf_config`` (its ``to_dict()``, or a mapping) and any ``extra`` settings, all made
        canonical by :meth:`from_settings`.

        Raises:
            InvalidFingerprintError: the processor has neither method, or its payload has a
                non-``str`` mapping key.
            UnsupportedArgumentError: a payload value has no canonical encoding.
        """
        if hasattr(processor, "preprocess_fingerprint_payload"):
            payload = processor.preprocess_fingerprint_payload()
        elif hasattr(processor, "to_dict"):
            payload = processor.to_dict()
        else:
            msg = (
                f"processor {type(processor).__qualname__!r} exposes neither "
                "preprocess_fingerprint_payload() nor to_dict(); "
                "its settings cannot be fingerprinted"
            )
            raise InvalidFingerprintError(msg)
        settings: dict[str, object] = {"processor": payload}
        if hf_config is not None:
            to_dict = getattr(hf_config, "to_dict", None)
            cfg = to_dict() if callable(to_dict) else dict(hf_config)  # type: ignore[call-overload]
            settings["model_type"] = cfg.get("model_type")
            settings["architectures"] = cfg.get("architectures")
        if extra:
            settings["extra"] = dict(extra)
        kind = type(processor)
        version = ";".join(f"{name}=={_dist_version(name)}" for name in packages)
        return cls.from_settings(f"{kind.__module__}.{kind.__qualname__}", version, settings)

    def __post_init__(self) -> None:
        digest = Packer("processor").text(self.name).text(self.version).blob(self.args_encoding)
        object.__setattr__(self, "digest", digest.digest())


def _check_nonneg_ints(values: tuple[int, ...], what: str) -> None:
    bad = [v for v in values if not is_int_at_least(v, 0)]
    if bad:
        raise ContentError(f"{what} must hold non-negative ints, got {values!r}")


@dataclass(frozen=True, slots=True)
class MultimodalItem:
    """One multimodal item of a prompt, as a serving engine describes it (the adapter shape).

    The engine fills one of these per item from its own objects; nothing here depends on any
    engine. An item covers one contiguous run of placeholder tokens.

    Attributes:
        modality: Image, video or audio. Only images get keys; the others bypass the prompt.
        start: Index of the item's first placeholder token in the prompt (tokens, >= 0).
        length: Number of placeholder tokens (tokens, >= 1). The span is ``[start, start+length)``.
        content: The bytes that identify the item, any object with the buffer protocol (``bytes``,
            ``memoryview``, a numpy array, the numpy view of a contiguous CPU torch tensor).
            Must be C-contiguous; it is hashed in place, never copied. ``None`` when the engine
            no longer has it, which bypasses the prompt.
        content_kind: Whether ``content`` is the processed pixel tensor or the encoded file.
        grid: The vision grid ``(t, h, w)`` in patches before any spatial merge, or ``None`` for
            processors without one.
        dtype: The content's element type as the engine names it (e.g. ``"bfloat16"``). ``None``
            uses the buffer's own format code.
        shape: The content's shape, e.g. ``[N, C·P·P]`` for Qwen-VL ``pixel_values``. ``None``
            uses the buffer's own shape.
        source: Where the features come from; anything but ``PROCESSOR`` bypasses the prompt.
    """

    modality: Modality
    start: int
    length: int
    content: BufferLike | None = field(default=None, compare=False, repr=False)
    content_kind: ContentKind = ContentKind.PIXELS
    grid: tuple[int, int, int] | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    source: FeatureSource = FeatureSource.PROCESSOR

    def __post_init__(self) -> None:
        if not is_int_at_least(self.start, 0):
            raise SpanOutOfRangeError(f"item start must be an int >= 0, got {self.start!r}")
        if not is_int_at_least(self.length, 1):
            raise SpanOutOfRangeError(f"item length must be an int >= 1, got {self.length!r}")
        if self.grid is not None:
            given: object = self.grid
            if not isinstance(given, (tuple, list)):
                raise InvalidGridError(
                    f"grid must be three positive ints (t, h, w) or None, got {self.grid!r}"
                )
            grid = tuple(self.grid)
            if len(grid) != 3 or not all(is_int_at_least(v, 1) for v in grid):
                raise InvalidGridError(
                    f"grid must be three positive ints (t, h, w), got {self.grid!r}"
                )
            object.__setattr__(self, "grid", grid)
        if self.shape is not None:
            given_shape: object = self.shape
            if not isinstance(given_shape, (tuple, list)):
                raise ContentError(f"shape must be a tuple of ints or None, got {self.shape!r}")
            shape = tuple(self.shape)
            _check_nonneg_ints(shape, "shape")
            object.__setattr__(self, "shape", shape)
        if self.dtype is not None and not _is_nonempty_str(self.dtype):
            raise ContentError(f"dtype must be a non-empty str or None, got {self.dtype!r}")

    @property
    def end(self) -> int:
        """One past the last placeholder token (tokens)."""
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class ImageKey:
    """Fixed-size identity of one image at one place in one prompt.

    ``digest`` covers the content digest and size, the content kind, dtype and shape, the processor
    fingerprint, the image's order among the prompt's images, its span and its grid. The other
    fields repeat the span data in the clear for page arithmetic and logs.

    Attributes:
        digest: 16 bytes (XXH3-128); the key itself.
        content_digest: 16 bytes (XXH3-128) of the content bytes alone.
        order: 0-based index of the image among the prompt's images, in the engine's order.
        start: First placeholder token (tokens).
        length: Placeholder tokens (tokens).
        grid: ``(t, h, w)`` or ``None``.
    """

    digest: bytes
    content_digest: bytes
    order: int
    start: int
    length: int
    grid: tuple[int, int, int] | None

    def __bytes__(self) -> bytes:
        return self.digest

    @property
    def end(self) -> int:
        """One past the last placeholder token (tokens)."""
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class Bypass:
    """Why a prompt is not reusable, and which item made it so.

    Has the ``reusable`` / ``bypass_reason`` surface of :class:`PromptIdentity`, so a caller can
    test either with ``if not identity.reusable``.

    Attributes:
        reason: The bypass class.
        item_index: Index of the first offending item in the engine's item list.
        detail: The offending value, for logs (e.g. ``"offsets=[(3, 9), (20, 40)]"``).
    """

    reason: BypassReason
    item_index: int
    detail: str = ""

    @property
    def reusable(self) -> bool:
        """Always ``False``."""
        return False

    @property
    def bypass_reason(self) -> BypassReason:
        """The bypass class."""
        return self.reason


@dataclass(frozen=True, slots=True)
class PromptIdentity:
    """What a prompt's images add to the identity of each of its pages.

    For a reusable prompt, ``page_identities[p]`` is the extra identity of page ``p`` (tokens
    ``[p·page_size, (p+1)·page_size)``, the last page possibly partial): empty bytes when no image
    overlaps the page; otherwise a 16-byte digest of the page size and the keys of every image
    overlapping the page, by position, each with the offset (tokens) of the overlap's first token
    inside the image; with the key's span that fixes the overlap exactly. A page's identity depends
    only on the images that overlap it, so two prompts that differ only after page ``p`` agree on
    pages ``0..p``; the prefix cache's chained page keys carry the earlier pages' identity forward.

    A bypassed prompt has no page identities and no image keys; it must never be matched or
    captured. Give a prefix key :attr:`page_extras`, not ``page_identities``: it leaves text pages
    out, so they key exactly as the same tokens without images.

    Attributes:
        num_tokens: Prompt length (tokens).
        page_size: Tokens per page.
        image_keys: One key per image, in the engine's item order; empty when bypassed.
        page_identities: One entry per page, ``ceil(num_tokens / page_size)`` entries; empty when
            bypassed.
        bypass: The bypass, or ``None`` for a reusable prompt.
    """

    num_tokens: int
    page_size: int
    image_keys: tuple[ImageKey, ...]
    page_identities: tuple[bytes, ...]
    bypass: Bypass | None = None

    @property
    def reusable(self) -> bool:
        """Whether the prompt's pages may be matched against and captured into a prefix cache."""
        return self.bypass is None

    @property
    def bypass_reason(self) -> BypassReason | None:
        """The bypass class, or ``None`` for a reusable prompt."""
        return None if self.bypass is None else self.bypass.reason

    @property
    def page_extras(self) -> dict[int, bytes]:
        """``page -> identity`` of the pages an image overlaps, for a prefix key's page extras.

        Text pages have no entry, so their keys equal those of the same tokens in a prompt
        without images; a page after an image still differs through the chained page keys.
        """
        return {page: extra for page, extra in enumerate(self.page_identities) if extra}

    @property
    def num_pages(self) -> int:
        """``ceil(num_tokens / page_size)``, counting a final partial page."""
        return -(-self.num_tokens // self.page_size)

    def images_overlapping(self, start: int, stop: int) -> tuple[ImageKey, ...]:
        """Keys of the images with at least one token in ``[start, stop)``, by position."""
        return tuple(
            sorted(
                (k for k in self.image_keys if k.start < stop and k.end > start),
                key=lambda k: k.start,
            )
        )
