"""Exceptions raised by qsa-mm-prefix.

Every class subclasses the builtin a caller would expect (``ValueError`` for a bad value,
``TypeError`` for a value of the wrong kind), so ``except ValueError`` keeps working. A *bypass*
(video, audio, precomputed embeddings, caller-supplied features) is not an error: it is reported
on the returned :class:`~qsa_mm_prefix.PromptIdentity`.
"""

from __future__ import annotations


class MultimodalPrefixError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidPromptError(MultimodalPrefixError, ValueError):
    """A prompt-level argument is out of range (token count, page size, merge size)."""


class SpanError(MultimodalPrefixError, ValueError):
    """A multimodal item's token span is malformed or does not fit the prompt."""


class SpanOutOfRangeError(SpanError):
    """A span starts before token 0, is empty, or ends past the prompt's last token."""


class OverlappingSpansError(SpanError):
    """Two items claim the same placeholder token."""


class InvalidGridError(SpanError):
    """A grid is not three positive integers ``(t, h, w)``, or disagrees with its span's length."""


class ContentError(MultimodalPrefixError, ValueError):
    """An item's content cannot be hashed as given (not C-contiguous, shape that cannot hold it)."""


class InvalidFingerprintError(MultimodalPrefixError, ValueError):
    """A processor fingerprint has an empty name or version, or a non-string argument name."""


class UnsupportedArgumentError(MultimodalPrefixError, TypeError):
    """A preprocessing argument has a type with no canonical encoding."""


class UnsupportedItemError(MultimodalPrefixError, ValueError):
    """An item that gets no key (not an image, no content, features not from the processor)."""


class ContentTypeError(MultimodalPrefixError, TypeError):
    """An item's content does not support the buffer protocol."""
