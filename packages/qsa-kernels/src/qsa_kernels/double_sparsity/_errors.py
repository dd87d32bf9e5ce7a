"""Exceptions of the double-sparsity layer.

Both subclass :class:`~qsa_kernels.KernelInputError` (so ``ValueError`` and ``QSAKernelError``):
a caller that already catches bad kernel input catches these too.
"""

from __future__ import annotations

from qsa_kernels._errors import KernelInputError

__all__ = ("ChannelConfigError", "DSConfigError")


class DSConfigError(KernelInputError):
    """A double-sparsity option is out of range (names the option, its value, what is allowed)."""


class ChannelConfigError(DSConfigError):
    """The heavy-channel calibration file is unreadable or malformed.

    The message names the file, the layer key, the head, the bad value and what is allowed.
    """
