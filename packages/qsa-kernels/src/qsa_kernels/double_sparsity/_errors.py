"""Exceptions of the double-sparsity layer.

The option and channel-file errors subclass :class:`~qsa_kernels.KernelInputError` (so
``ValueError`` and ``QSAKernelError``): a caller that already catches bad kernel input catches
them too. A call the decode runtime's step does not allow is a :class:`DSStateError`.
"""

from __future__ import annotations

from qsa_kernels._errors import KernelInputError, QSAKernelError

__all__ = ("ChannelConfigError", "DSConfigError", "DSStateError")


class DSConfigError(KernelInputError):
    """A double-sparsity option is out of range (names the option, its value, what is allowed)."""


class ChannelConfigError(DSConfigError):
    """The heavy-channel calibration file is unreadable or malformed.

    The message names the file, the layer key, the head, the bad value and what is allowed.
    """


class DSStateError(QSAKernelError, RuntimeError):
    """A call the decode runtime's planned step does not allow.

    For example a layer's decode before its step's plan, or a captured layer before the captured
    step's tables. The message names the call and the planned step.
    """
