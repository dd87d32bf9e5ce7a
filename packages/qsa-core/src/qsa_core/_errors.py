"""Exception classes of qsa-core; each subclasses the builtin that matches its cause."""

from __future__ import annotations


class QSAConfigError(ValueError):
    """A model config or profile field is missing or has a value QSA does not support."""


class ResidencyError(ValueError):
    """A hot-cache state or a decode step's selection violates the residency contract."""


class LeaseError(RuntimeError):
    """An illegal lease transition, a stale handle, or no free slot."""


class PlacementError(ValueError):
    """A slot, page, rank or shard-group size outside what the placement allows."""


class LayoutError(ValueError):
    """A context-parallel layout was asked for with invalid sizes or rows."""


class MergeError(ValueError):
    """Top-k candidates that cannot be ordered: NaN scores, duplicate ids or a bad ``k``."""


class CapacityError(ValueError):
    """A capacity-plan input (TP size, budget, length, request count) is out of range."""


class PromptError(ValueError):
    """A prompt the model cannot serve: no token, or a token id outside the vocabulary."""


class JSONFileError(ValueError):
    """A JSON file a user named cannot be read, is not bounded JSON, or is too large or deep."""
