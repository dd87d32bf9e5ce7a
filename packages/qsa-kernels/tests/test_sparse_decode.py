"""Sparse GQA decode against the gather-then-attend reference, with NaN-poisoned allocations."""

from __future__ import annotations

import math

import pytest
import torch

from qsa_kernels import KernelInputError
from qsa_kernels.lse_merge import lse_merge
from qsa_kernels.sparse_decode import (
    sparse_decode,
    sparse_decode_reference,
    sparse_decode_split,
    sparse_decode_split_reference,
)

DTYPES = [torch.float8_e4m3fn, torch.bfloat16]


def _case(
    shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: str, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, group, T, D, NS = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, group, D, generator=g).bfloat16()
    kv = (torch.randn(NS, 2, 4, 1, D, generator=g) * 1.5).to(dtype)
    perm = torch.stack([torch.randperm(NS * 4, generator=g)[:T] for _ in range(B)]).int()
    pad = torch.rand(B, T, generator=g) < 0.1  # padding anywhere, not only at the end
    perm[pad] = -1
    return q.to(device), perm.to(device), kv.to(device)


def _assert_close(
    got: torch.Tensor, want: torch.Tensor, lse: torch.Tensor, want_lse: torch.Tensor
) -> None:
    assert not torch.isnan(got).any(), "unwritten (NaN) output"
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)
    assert err.item() < 1e-2, f"relative RMS error {err.item():.2e}"
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=1e-4)


GPU_CASES = [
    pytest.param(B, group, T, dtype, id=f"B{B}-G{group}-T{T}-{str(dtype)[6:]}")
    for B in (1, 3, 8)
    for group in (12, 24)
    for T in (1, 5, 2051)
    for dtype in DTYPES
]


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize(("B", "group", "T", "dtype"), GPU_CASES)
def test_sparse_decode_matches_reference_on_gpu(
    B: int, group: int, T: int, dtype: torch.dtype
) -> None:
    """Model shapes (D=256, 1 KV head), odd batches and counts, both K/V dtypes."""
    q, tok, kv = _case((B, group, T, 256, 1100), dtype, "cuda", seed=B * 1000 + group + T)
    got, lse = sparse_decode(q, tok, kv)
    want, want_lse = sparse_decode_reference(q, tok, kv)
    _assert_close(got, want, lse, want_lse)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize(
    ("B", "group", "T", "splits"),
    [(1, 12, 1, 1), (3, 24, 5, 2), (2, 12, 150, 3), (1, 12, 70, None)],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp8", "bf16"])
def test_sparse_decode_matches_reference_interpreted(  # noqa: PLR0917
    interpreter_device: str, dtype: torch.dtype, B: int, group: int, T: int, splits: int | None
) -> None:
    """Small shapes under the interpreter, several split counts."""
    q, tok, kv = _case((B, group, T, 32, 60), dtype, interpreter_device, seed=T)
    got, lse = sparse_decode(q, tok, kv, num_splits=splits)
    want, want_lse = sparse_decode_reference(q, tok, kv)
    _assert_close(got, want, lse, want_lse)


@pytest.mark.usefixtures("poisoned_empty")
def test_empty_row_gives_zero_output_and_neg_inf_lse(kernel_device: str) -> None:
    """A row whose slots are all -1 outputs exactly 0 with LSE -inf; other rows are unaffected."""
    D = 256 if kernel_device == "cuda" else 32
    q, tok, kv = _case((3, 12, 9, D, 20), torch.bfloat16, kernel_device, seed=1)
    tok[1] = -1
    got, lse = sparse_decode(q, tok, kv)
    assert not got[1].any()
    assert bool(torch.isneginf(lse[1]).all())
    want, want_lse = sparse_decode_reference(q, tok, kv)
    _assert_close(got, want, lse, want_lse)


def test_reference_equals_dense_float64_softmax() -> None:
    """The reference is plain softmax attention over the selected rows (checked in float64)."""
    q, tok, kv = _case((2, 12, 7, 32, 10), torch.bfloat16, "cpu", seed=9)
    tok[:, 0] = 5  # at least one valid token per row
    out, lse = sparse_decode_reference(q, tok, kv)
    for b in range(2):
        valid = tok[b][tok[b] >= 0].long()
        k = kv[valid // 4, 0, valid % 4, 0].double()
        v = kv[valid // 4, 1, valid % 4, 0].double()
        scores = q[b].double() @ k.T / math.sqrt(32)
        torch.testing.assert_close(lse[b].double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=0)
        dense = torch.softmax(scores, -1) @ v
        torch.testing.assert_close(out[b].double(), dense, atol=1e-2, rtol=1e-2)


def test_sparse_decode_rejects_heads_not_a_multiple_of_kv_heads() -> None:
    """Hq must be a multiple of Hkv; both counts are named."""
    q = torch.zeros(1, 5, 32, dtype=torch.bfloat16)
    kv = torch.zeros(4, 2, 4, 2, 32, dtype=torch.bfloat16)
    tok = torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"Hq=5.*Hkv=2"):
        sparse_decode(q, tok, kv)


def test_sparse_decode_rejects_fp32_queries() -> None:
    """Queries are bf16 only."""
    kv = torch.zeros(4, 2, 4, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="q has dtype"):
        sparse_decode_reference(torch.zeros(1, 12, 32), torch.zeros(1, 3, dtype=torch.int32), kv)


@pytest.mark.parametrize("strided", ["q", "token_slots"])
def test_sparse_decode_rejects_a_non_unit_last_stride_naming_the_tensor(strided: str) -> None:
    """A q or token_slots view with a strided last dim is refused with its name and strides."""
    q, slots, kv = _case((2, 4, 8, 16, 8), torch.bfloat16, "cpu", seed=7)
    if strided == "q":
        q = torch.cat([q, q], dim=2)[:, :, ::2]
    else:
        slots = torch.cat([slots, slots], dim=1)[:, ::2]
    with pytest.raises(KernelInputError, match=rf"{strided} must have unit stride .*got strides"):
        sparse_decode_reference(q, slots, kv)


def test_fp32_output_is_the_bf16_output_before_its_rounding(kernel_device: str) -> None:
    """A part meant for a later merge can stay fp32; rounded, it is the bf16 output."""
    q, slots, kv = _case((2, 12, 9, 16, 8), torch.bfloat16, kernel_device, seed=5)
    out32, lse32 = sparse_decode(q, slots, kv, out_dtype=torch.float32)
    out16, lse16 = sparse_decode(q, slots, kv)
    ref32, ref_lse = sparse_decode_reference(q, slots, kv, out_dtype=torch.float32)
    assert out32.dtype == ref32.dtype == torch.float32
    if kernel_device == "cpu":  # Triton's interpreter truncates fp32 -> bf16: one step apart
        torch.testing.assert_close(out32.bfloat16(), out16, atol=0, rtol=2**-7)
    else:
        assert torch.equal(out32.bfloat16(), out16)
    assert torch.equal(lse32, lse16)
    # On the GPU the kernel rounds the probabilities to bf16 for the P·V product (its tl.dot
    # operands), one bf16 step (2^-8 relative) per term: the fp32 part is that accurate, no more
    # (measured on the H200: 2.4e-3 at most).
    step = 2**-8 if kernel_device == "cuda" else 1e-3
    torch.testing.assert_close(out32, ref32, atol=step, rtol=step)
    torch.testing.assert_close(lse32, ref_lse, atol=2e-3, rtol=1e-4)


@pytest.mark.usefixtures("poisoned_empty")
def test_unmerged_parts_merge_into_the_merged_output(kernel_device: str) -> None:
    """merged=False gives the split-K parts; one LSE merge of them is the merged call's result,
    and of another call's parts too (a hot cache's and a tail's, merged once)."""
    q, slots, kv = _case((2, 12, 300, 16, 100), torch.bfloat16, kernel_device, seed=8)
    parts, part_lse = sparse_decode(q, slots, kv, merged=False, num_splits=3)
    assert parts.shape == (3, 2, 12, 16)
    assert part_lse.shape == (3, 2, 12)
    want, want_lse = sparse_decode(q, slots, kv, num_splits=3)
    got, got_lse = lse_merge(parts, part_lse, out_dtype=torch.bfloat16)
    assert torch.equal(got, want)
    assert torch.equal(got_lse, want_lse)
    ref, ref_lse = sparse_decode_reference(q, slots, kv, merged=False)
    assert ref.shape == (1, 2, 12, 16)
    assert ref_lse.shape == (1, 2, 12)
    assert ref.dtype == torch.float32
    # Two token sets decoded apart and merged once equal one decode of their union.
    first, second = slots[:, :150].contiguous(), slots[:, 150:].contiguous()
    halves = [sparse_decode(q, half, kv, merged=False) for half in (first, second)]
    both, both_lse = lse_merge(
        torch.cat([o for o, _ in halves]), torch.cat([lse for _, lse in halves])
    )
    torch.testing.assert_close(both, want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(both_lse, want_lse, atol=1e-4, rtol=1e-5)


def test_sparse_decode_refuses_an_output_dtype_it_does_not_produce() -> None:
    q, slots, kv = _case((1, 12, 4, 16, 4), torch.bfloat16, "cpu", seed=6)
    with pytest.raises(KernelInputError, match=r"out_dtype=torch.float16 is not allowed"):
        sparse_decode_reference(q, slots, kv, out_dtype=torch.float16)


# -- split K/V buffers (SGLang's MHA pool) ---------------------------------------------------------


def _split_case(  # noqa: PLR0917
    B: int, hkv: int, group: int, T: int, D: int, dtype: torch.dtype, device: str, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-KV-head lists into keys and values that are views of one wider buffer (so the token
    and head strides are not the dense ones)."""
    N = 3 * T + 11
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hkv * group, D, generator=g).bfloat16()
    both = (torch.randn(N, 2 * hkv + 1, D, generator=g) * 1.5).to(dtype)
    k, v = both[:, :hkv], both[:, hkv + 1 :]
    slots = torch.stack(
        [torch.stack([torch.randperm(N, generator=g)[:T] for _ in range(hkv)]) for _ in range(B)]
    ).int()
    slots[torch.rand(B, hkv, T, generator=g) < 0.1] = -1
    return q.to(device), slots.to(device), k.to(device), v.to(device)


SPLIT_GPU_CASES = [
    pytest.param(B, hkv, group, T, dtype, id=f"B{B}-Hkv{hkv}-G{group}-T{T}-{str(dtype)[6:]}")
    for B, hkv, group in ((1, 8, 4), (8, 8, 4), (3, 2, 8))  # Llama-8B's 32 q / 8 KV heads first
    for T in (1, 70, 1024, 4096)
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
]


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize(("B", "hkv", "group", "T", "dtype"), SPLIT_GPU_CASES)
def test_split_buffer_decode_matches_reference_on_gpu(
    B: int, hkv: int, group: int, T: int, dtype: torch.dtype
) -> None:
    """D=128 (Llama), strided key and value views, one token list per KV head."""
    q, slots, k, v = _split_case(B, hkv, group, T, 128, dtype, "cuda", seed=B + hkv + T)
    got, lse = sparse_decode_split(q, slots, k, v)
    want, want_lse = sparse_decode_split_reference(q, slots, k, v)
    _assert_close(got, want, lse, want_lse)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize(("T", "splits"), [(1, 1), (5, 2), (150, 3), (70, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_split_buffer_decode_matches_reference_interpreted(
    interpreter_device: str, dtype: torch.dtype, T: int, splits: int | None
) -> None:
    """Small shapes under the interpreter, several split counts, strided views."""
    q, slots, k, v = _split_case(2, 2, 4, T, 32, dtype, interpreter_device, seed=T)
    got, lse = sparse_decode_split(q, slots, k, v, num_splits=splits)
    want, want_lse = sparse_decode_split_reference(q, slots, k, v)
    _assert_close(got, want, lse, want_lse)


def test_split_buffer_decode_equals_the_record_store_decode(kernel_device: str) -> None:
    """The same tokens laid out as records and as split buffers give the same bits."""
    D = 128 if kernel_device == "cuda" else 32
    q, tok, kv = _case((3, 4, 40, D, 30), torch.bfloat16, kernel_device, seed=5)
    # record 4 * r + j of [NS, 2, 4, 1, D] is token slot 4 * r + j of [NS * 4, 1, D] buffers
    k = kv[:, 0].reshape(-1, 1, D)
    v = kv[:, 1].reshape(-1, 1, D)
    want, want_lse = sparse_decode(q, tok, kv, num_splits=2)
    got, lse = sparse_decode_split(q, tok, k, v, num_splits=2)
    assert torch.equal(got, want)
    assert torch.equal(lse, want_lse)


def test_split_buffer_decode_refuses_a_head_dim_its_tiles_cannot_hold() -> None:
    q = torch.zeros(1, 4, 24, dtype=torch.bfloat16)
    k = torch.zeros(8, 2, 24, dtype=torch.bfloat16)
    slots = torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"head dim D=24 must be a power of two"):
        sparse_decode_split(q, slots, k, k.clone())


def test_split_buffer_decode_refuses_keys_strided_along_the_head_dim() -> None:
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    k = torch.zeros(8, 2, 32, dtype=torch.bfloat16)[:, :, ::2]
    slots = torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"k_buffer must have unit stride"):
        sparse_decode_split(q, slots, k, k.contiguous())
