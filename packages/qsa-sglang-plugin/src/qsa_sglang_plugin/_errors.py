"""Exceptions of the SGLang plugin.

Activation errors derive from :class:`BaseException`, not :class:`Exception`: SGLang's
``load_plugins()`` and ``HookRegistry.apply_hooks()`` catch ``Exception``, log it and carry on, so
an ``Exception`` raised while the plugin activates would leave an unverified server running.
A ``BaseException`` passes through those handlers and stops the process before it serves.
"""

from __future__ import annotations

__all__ = (
    "ActivationError",
    "AdapterError",
    "ConfigurationError",
    "FingerprintMismatchError",
    "ForeignHookError",
    "HookNotAppliedError",
    "LaunchError",
    "ModelCompatError",
    "OffloadRuntimeError",
    "SwitchError",
)


class ActivationError(BaseException):
    """The plugin cannot activate safely; the process must stop before it serves."""


class SwitchError(ActivationError):
    """A ``SGLANG_QSA_*`` switch holds a malformed or contradictory value."""


class FingerprintMismatchError(ActivationError):
    """An SGLang module that holds a hook target differs from the shipped manifest."""


class HookNotAppliedError(ActivationError):
    """A declared hook did not land on its target."""


class ForeignHookError(ActivationError):
    """Another plugin registered hooks on or around one of this plugin's targets."""


class ConfigurationError(ActivationError):
    """The server configuration is outside what the requested features support."""


class LaunchError(RuntimeError):
    """The launcher could not bring the server to a verified ready state."""


class OffloadRuntimeError(RuntimeError):
    """SGLang asked the offload runtime for something its leases do not allow.

    For example a request slot without a lease row, a row whose length disagrees with SGLang's,
    or a batch it cannot stage.
    """


class AdapterError(ValueError):
    """An SGLang object cannot be translated into the libraries' terms (a bad or missing value)."""


class ModelCompatError(AdapterError):
    """A checkpoint the model-compatibility feature reads is malformed (named, with its values)."""
