"""Which implementation of a composed path runs: the Triton kernels or their torch references."""

from __future__ import annotations

import enum

import torch

__all__ = ("KernelPath",)


class KernelPath(enum.Enum):
    """Which implementation computes a composed path (offload, sharded decode).

    Attributes:
        AUTO: :attr:`TRITON` for CUDA tensors, :attr:`REFERENCE` otherwise.
        TRITON: the Triton kernels (on CPU tensors only under ``TRITON_INTERPRET=1``).
        REFERENCE: the torch references (host-synchronising loops; not CUDA-graph safe).
    """

    AUTO = "auto"
    TRITON = "triton"
    REFERENCE = "reference"

    def resolve(self, device: torch.device) -> KernelPath:
        """The concrete path for tensors on ``device``."""
        if self is KernelPath.AUTO:
            return KernelPath.TRITON if device.type == "cuda" else KernelPath.REFERENCE
        return self
