"""Exceptions raised by ``qsa_kernels``.

Every error the package raises on purpose is a :class:`QSAKernelError`. Each class also subclasses
the builtin that fits its meaning, so callers may catch either.
"""

from __future__ import annotations

__all__ = (
    "DeviceUnavailableError",
    "KernelInputError",
    "QSAKernelError",
)


class QSAKernelError(Exception):
    """Base class of every error raised by ``qsa_kernels``."""


class KernelInputError(QSAKernelError, ValueError):
    """A kernel or reference received a tensor of the wrong shape, dtype, device or layout.

    The message names the argument, the value received (``!r``) and what is allowed.
    """


class DeviceUnavailableError(QSAKernelError, RuntimeError):
    """The operation needs a CUDA device (or pinned, device-mapped host memory) that is absent."""
