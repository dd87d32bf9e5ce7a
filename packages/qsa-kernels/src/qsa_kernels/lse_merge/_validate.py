"""Argument checks shared by the LSE merge kernel and its reference."""

from __future__ import annotations

import torch

from qsa_kernels._checks import check_dtype
from qsa_kernels._errors import KernelInputError

__all__ = ("MERGE_OUT_DTYPES", "check_merge_args")

#: Output dtypes the merge can write.
MERGE_OUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def check_merge_args(
    outputs: torch.Tensor,
    lse: torch.Tensor,
    out_dtype: torch.dtype,
    more: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Check ``outputs`` ``[P, *N, D]`` against ``lse`` ``[P, *N]`` (fp32) and ``out_dtype``.

    ``more``'s parts are checked alike, and against the same ``*N`` and ``D``.
    """
    if more is not None:
        check_merge_args(*more, out_dtype)
        if tuple(more[0].shape[1:]) != tuple(outputs.shape[1:]) or more[0].device != outputs.device:
            msg = (
                f"more's outputs {tuple(more[0].shape)!r} on {more[0].device!r} must be "
                f"[P2, *N, D] with the *N and D of outputs {tuple(outputs.shape)!r}, on "
                f"{outputs.device!r}"
            )
            raise KernelInputError(msg)
    check_dtype("outputs", outputs, MERGE_OUT_DTYPES)
    check_dtype("lse", lse, (torch.float32,))
    if outputs.dim() < 2 or tuple(outputs.shape[:-1]) != tuple(lse.shape):
        msg = (
            f"outputs must be [P, *N, D] and lse [P, *N]; got {tuple(outputs.shape)!r} and "
            f"{tuple(lse.shape)!r}"
        )
        raise KernelInputError(msg)
    if outputs.shape[0] < 1:
        msg = f"need at least one part (P >= 1); got P={outputs.shape[0]!r}"
        raise KernelInputError(msg)
    if outputs.device != lse.device:
        msg = f"outputs on {outputs.device!r} but lse on {lse.device!r}"
        raise KernelInputError(msg)
    if out_dtype not in MERGE_OUT_DTYPES:
        msg = f"out_dtype {out_dtype!r} not supported; allowed: {MERGE_OUT_DTYPES!r}"
        raise KernelInputError(msg)
