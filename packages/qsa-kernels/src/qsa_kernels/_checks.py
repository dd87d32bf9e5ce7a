"""Input validation and launch-size helpers shared by the decode-path launchers and references.

Every check raises :class:`~qsa_kernels._errors.KernelInputError` naming the argument, the value
received and what is allowed. Shapes are reported as tuples, never as tensor contents.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from qsa_core import KVDType
from qsa_kernels._errors import KernelInputError

__all__ = (
    "KV_DTYPES",
    "check_contiguous",
    "check_dim",
    "check_dtype",
    "check_ndim",
    "check_same_device",
    "check_unit_last_stride",
    "kv_torch_dtype",
    "list_tile",
    "next_pow2",
    "sm_count",
)


def kv_torch_dtype(kv_dtype: KVDType) -> torch.dtype:
    """The ``torch.dtype`` that stores K/V of ``kv_dtype`` (the one place a KVDType meets torch).

    Raises:
        KernelInputError: ``kv_dtype`` is not a :class:`qsa_core.KVDType`.
    """
    value: object = kv_dtype  # callers without types pass flag strings
    if not isinstance(value, KVDType):
        msg = f"kv_dtype={kv_dtype!r} is not allowed; it must be a qsa_core.KVDType"
        raise KernelInputError(msg)
    dtype = getattr(torch, kv_dtype.torch_name)
    assert isinstance(dtype, torch.dtype)
    return dtype


#: K/V element types the decode path accepts: qsa-core's :class:`~qsa_core.KVDType`, fp8 first.
KV_DTYPES: tuple[torch.dtype, ...] = tuple(
    kv_torch_dtype(d) for d in sorted(KVDType, key=lambda d: d.itemsize)
)


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    """Reject a tensor whose rank is not ``ndim``; ``layout`` names its dims (``[B, Hq, D]``)."""
    if t.dim() != ndim:
        msg = f"{name} must be {layout} ({ndim} dims); got shape {tuple(t.shape)!r}"
        raise KernelInputError(msg)


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    """Reject a tensor whose dtype is not one of ``allowed``."""
    if t.dtype not in allowed:
        msg = f"{name} has dtype {t.dtype!r}; allowed: {tuple(allowed)!r}"
        raise KernelInputError(msg)


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Reject a tensor whose size along ``dim`` is not ``expected`` (``what`` says why)."""
    if t.shape[dim] != expected:
        msg = (
            f"{name} has size {t.shape[dim]!r} along dim {dim} (shape {tuple(t.shape)!r}); "
            f"expected {expected!r} ({what})"
        )
        raise KernelInputError(msg)


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Reject any tensor that does not live on ``device``."""
    for name, t in tensors.items():
        if t.device != device:
            msg = f"{name} is on {t.device!r}; expected {device!r}"
            raise KernelInputError(msg)


def check_contiguous(**tensors: torch.Tensor) -> None:
    """Reject any tensor that is not contiguous, naming it with its shape and strides."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            msg = (
                f"{name} must be contiguous; got shape {tuple(t.shape)!r} with strides "
                f"{t.stride()!r}"
            )
            raise KernelInputError(msg)


def check_unit_last_stride(**tensors: torch.Tensor) -> None:
    """Reject any tensor whose last dim does not have stride 1, naming it with its strides."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            msg = f"{name} must have unit stride on its last dim; got strides {t.stride()!r}"
            raise KernelInputError(msg)


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(n - 1, 0).bit_length()


def list_tile(width: int) -> tuple[int, int]:
    """``(tile, warps)`` of a kernel holding one ``width``-long list per program in registers.

    The tile is a power of two of at least 16 (``tl.arange``'s and ``tl.sort``'s); 8 warps from
    2,048 elements up, 4 below.
    """
    tile = max(16, next_pow2(width))
    return tile, 8 if tile >= 2048 else 4


@functools.cache
def _cuda_sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def sm_count(device: torch.device, *, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (queried once per device); ``cpu`` otherwise.

    ``cpu`` is the stand-in a launcher sizes its grid with under the Triton interpreter.
    """
    return _cuda_sm_count(device) if device.type == "cuda" else cpu
