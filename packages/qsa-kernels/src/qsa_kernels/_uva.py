"""Zero-copy access to pinned host memory from device kernels (unified virtual addressing).

Under UVA a page-locked host allocation has the same address on the host and on every device, so a
kernel may load from and store to it directly over PCIe. Triton only accepts CUDA tensors, so a
pinned CPU tensor is re-wrapped as a CUDA-typed view of the same bytes through
``__cuda_array_interface__``. The view does not own the memory; it keeps the host tensor alive.
Views are cached per host tensor object (dropped when it dies), so repeated calls are cheap and a
call inside CUDA graph capture after a warm-up call does no pointer query.
"""

from __future__ import annotations

import weakref
from typing import Final

import torch

from qsa_kernels._errors import DeviceUnavailableError, KernelInputError

__all__ = ("device_view",)

_TYPESTR: Final[dict[torch.dtype, str]] = {
    torch.uint8: "|u1",
    torch.int8: "|i1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
}


#: Device views by (id of the host tensor, device); an entry is removed when its host tensor dies.
_VIEWS: dict[tuple[int, str], torch.Tensor] = {}


class _CudaArrayInterface:
    """Minimal ``__cuda_array_interface__`` exporter that also pins the source tensor's lifetime."""

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, owner: torch.Tensor, typestr: str) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (owner.numel(),),
            "typestr": typestr,
            "data": (owner.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Return a tensor on ``device`` aliasing the bytes of ``host`` (zero-copy when on CUDA).

    Args:
        host: Contiguous tensor. If ``device`` is CUDA it must be a pinned CPU tensor (or already
            live on ``device``, in which case it is returned as is). If ``device`` is the CPU (the
            Triton interpreter), ``host`` is returned as is.
        device: The device the kernel runs on.

    Returns:
        A tensor with ``host``'s shape and dtype whose loads and stores reach ``host``'s memory.

    Raises:
        KernelInputError: ``host`` is not contiguous, or is a CPU tensor that is not pinned.
        DeviceUnavailableError: ``device`` is CUDA but CUDA is absent.
    """
    if host.device == device or device.type == "cpu":
        return host
    if device.type != "cuda":
        msg = f"device must be 'cuda' or 'cpu'; got {device!r}"
        raise KernelInputError(msg)
    if not torch.cuda.is_available():
        msg = f"device {device!r} requested but torch.cuda.is_available() is False"
        raise DeviceUnavailableError(msg)
    if not host.is_contiguous():
        msg = f"host tensor must be contiguous; got strides {host.stride()!r}"
        raise KernelInputError(msg)
    if host.device.type != "cpu" or not host.is_pinned():
        msg = (
            f"host tensor must be a pinned CPU tensor (torch.empty(..., pin_memory=True)); "
            f"got device={host.device!r}, pinned={host.is_pinned()!r}"
        )
        raise KernelInputError(msg)
    key = (id(host), str(device))
    cached = _VIEWS.get(key)
    if (
        cached is not None
        and cached.data_ptr() == host.data_ptr()
        and cached.dtype == host.dtype
        and cached.shape == host.shape
    ):
        return cached
    flat = host.view(torch.uint8).reshape(-1)
    raw = torch.as_tensor(_CudaArrayInterface(flat, _TYPESTR[torch.uint8]), device=device)
    view = raw.view(host.dtype).view(host.shape)
    if key not in _VIEWS:
        weakref.finalize(host, _VIEWS.pop, key, None)
    _VIEWS[key] = view
    return view
