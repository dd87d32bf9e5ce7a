"""Exception classes of qsa-testing; each subclasses the builtin that matches its cause."""

from __future__ import annotations


class ModelSpecError(ValueError):
    """A tiny-model variant was asked for with a value it cannot take."""


class EngineConfigError(ValueError):
    """An engine configuration names a server argument, switch or stand-in that does not exist."""


class EngineStartError(RuntimeError):
    """An SGLang server did not become healthy; the message carries its log's tail and path."""


class EngineRequestError(RuntimeError):
    """An SGLang server refused or failed a request; the message carries the reply and log path."""


class StandInError(RuntimeError):
    """A stand-in was asked for that does not exist, or its target changed shape upstream."""
