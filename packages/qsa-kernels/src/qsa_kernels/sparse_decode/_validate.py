"""Argument checks shared by the sparse decode kernel and its reference."""

from __future__ import annotations

import math

import torch

from qsa_kernels._checks import (
    KV_DTYPES,
    check_dim,
    check_dtype,
    check_ndim,
    check_same_device,
    check_unit_last_stride,
)
from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS

__all__ = ("check_decode_args", "check_kernel_head_dim", "check_split_decode_args")


#: What a sparse decode may return its output as.
OUT_DTYPES = (torch.bfloat16, torch.float32)


def check_decode_args(
    q: torch.Tensor,
    token_slots: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float | None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> float:
    """Validate a sparse decode call; return the softmax scale (default ``1 / sqrt(D)``)."""
    _check_query_and_slots(q, token_slots, out_dtype)
    check_ndim("kv_cache", kv_cache, 5, "[NS, 2, 4, Hkv, D]")
    check_dtype("kv_cache", kv_cache, KV_DTYPES)
    check_dim("kv_cache", kv_cache, 1, 2, "K then V")
    check_dim("kv_cache", kv_cache, 2, BLOCK_TOKENS, "tokens per block")
    check_dim("kv_cache", kv_cache, 4, q.shape[2], "D of q")
    check_dim("token_slots", token_slots, 0, q.shape[0], "B of q")
    check_kernel_head_dim(q)
    check_same_device(q.device, token_slots=token_slots, kv_cache=kv_cache)
    _check_heads(q, token_slots, int(kv_cache.shape[3]), "kv_cache")
    if not kv_cache.is_contiguous():
        msg = f"kv_cache must be contiguous; got strides {kv_cache.stride()!r}"
        raise KernelInputError(msg)
    check_unit_last_stride(q=q, token_slots=token_slots)
    return _softmax_scale(q, scale)


#: Dtypes of SGLang's split K/V buffers the split reference reads.
SPLIT_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def check_split_decode_args(  # noqa: PLR0917
    q: torch.Tensor,
    token_slots: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    scale: float | None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> float:
    """Validate a split-buffer sparse decode call; return the softmax scale."""
    _check_query_and_slots(q, token_slots, out_dtype)
    check_ndim("k_buffer", k_buffer, 3, "[N, Hkv, D]")
    check_dtype("k_buffer", k_buffer, SPLIT_KV_DTYPES)
    if v_buffer.shape != k_buffer.shape or v_buffer.dtype != k_buffer.dtype:
        msg = (
            f"v_buffer {tuple(v_buffer.shape)!r} {v_buffer.dtype!r} must match k_buffer "
            f"{tuple(k_buffer.shape)!r} {k_buffer.dtype!r}"
        )
        raise KernelInputError(msg)
    check_dim("k_buffer", k_buffer, 2, q.shape[2], "D of q")
    check_dim("token_slots", token_slots, 0, q.shape[0], "B of q")
    check_same_device(q.device, token_slots=token_slots, k_buffer=k_buffer, v_buffer=v_buffer)
    _check_heads(q, token_slots, int(k_buffer.shape[1]), "k_buffer")
    return _softmax_scale(q, scale)


def check_kernel_head_dim(q: torch.Tensor) -> None:
    """The Triton kernel's head dim: a power of two >= 16 (its ``[BLOCK_N, D]`` tiles)."""
    D = q.shape[2]
    if D < 16 or D & (D - 1):
        msg = f"head dim D={D!r} must be a power of two >= 16"
        raise KernelInputError(msg)


def _check_query_and_slots(
    q: torch.Tensor, token_slots: torch.Tensor, out_dtype: torch.dtype
) -> None:
    """``q [B, Hq, D]`` bf16; ``token_slots [B, T]`` or ``[B, Hkv, T]`` int32; an output dtype."""
    if out_dtype not in OUT_DTYPES:
        msg = f"out_dtype={out_dtype!r} is not allowed; allowed: {OUT_DTYPES!r}"
        raise KernelInputError(msg)
    check_ndim("q", q, 3, "[B, Hq, D]")
    check_dtype("q", q, (torch.bfloat16,))
    if token_slots.dim() not in (2, 3):
        msg = (
            f"token_slots must be [B, T] (one list per row) or [B, Hkv, T] (one per KV head); "
            f"got shape {tuple(token_slots.shape)!r}"
        )
        raise KernelInputError(msg)
    check_dtype("token_slots", token_slots, (torch.int32,))


def _check_heads(q: torch.Tensor, token_slots: torch.Tensor, hkv: int, source: str) -> None:
    """``Hq`` a multiple of the ``hkv`` KV heads of ``source``; per-head lists name ``hkv``."""
    hq = q.shape[1]
    if hkv == 0 or hq % hkv:
        msg = f"Hq={hq!r} must be a positive multiple of Hkv={hkv!r}"
        raise KernelInputError(msg)
    if token_slots.dim() == 3:
        check_dim("token_slots", token_slots, 1, hkv, f"Hkv of {source}")


def _softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    """``scale``, validated, or ``1 / sqrt(D)``."""
    if scale is None:
        return 1.0 / math.sqrt(q.shape[2])
    if not math.isfinite(scale) or scale <= 0:
        msg = f"scale must be a finite positive float; got {scale!r}"
        raise KernelInputError(msg)
    return float(scale)
