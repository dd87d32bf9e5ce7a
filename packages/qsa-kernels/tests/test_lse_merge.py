"""LSE merge: matches the reference, ignores empty parts, and recombines split attention."""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import KernelInputError
from qsa_kernels.lse_merge import lse_merge, lse_merge_reference
from qsa_kernels.sparse_decode import sparse_decode_reference


@pytest.mark.parametrize("parts", [1, 3, 7])
def test_merge_matches_reference_with_empty_parts(kernel_device: str, parts: int) -> None:
    """-inf parts (with NaN outputs) get weight 0; all-empty rows give 0 and -inf."""
    torch.manual_seed(parts)
    dev = torch.device(kernel_device)
    out = torch.randn(parts, 3, 5, 24, device=dev)
    lse = torch.randn(parts, 3, 5, device=dev) * 4
    lse[:, 0, 0] = float("-inf")
    out[:, 0, 0] = float("nan")
    lse[0, 1, 2] = float("-inf")
    out[0, 1, 2] = float("nan")
    got, got_lse = lse_merge(out, lse)
    want, want_lse = lse_merge_reference(out, lse)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    assert bool(torch.isneginf(got_lse[0, 0]))
    assert not got[0, 0].any()


def test_merge_of_disjoint_token_sets_equals_attention_over_their_union(kernel_device: str) -> None:
    """Attention over token subsets, merged by LSE, equals attention over all tokens."""
    torch.manual_seed(5)
    dev = torch.device(kernel_device)
    q = torch.randn(2, 12, 32, device=dev).bfloat16()
    kv = torch.randn(20, 2, 4, 1, 32, device=dev).bfloat16()
    tokens = torch.randperm(80, device=dev)[:30].int().view(1, 30).repeat(2, 1)
    whole, whole_lse = sparse_decode_reference(q, tokens, kv)
    pieces = [tokens[:, :7], tokens[:, 7:8], tokens[:, 8:]]
    results = [sparse_decode_reference(q, p.contiguous(), kv) for p in pieces]
    # Reference outputs are bf16; merge their fp32 upcasts.
    outs = torch.stack([r[0].float() for r in results])
    lses = torch.stack([r[1] for r in results])
    merged, merged_lse = lse_merge(outs, lses, out_dtype=torch.bfloat16)
    torch.testing.assert_close(merged_lse, whole_lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(merged.float(), whole.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize(("first", "second"), [(1, 1), (3, 1), (2, 5)])
def test_merge_with_more_parts_equals_the_merge_of_their_concatenation(
    kernel_device: str, first: int, second: int
) -> None:
    """``more`` merges a second kernel's parts in the same launch, as if concatenated."""
    torch.manual_seed(first * 10 + second)
    dev = torch.device(kernel_device)
    out, out2 = torch.randn(first, 3, 4, 24, device=dev), torch.randn(second, 3, 4, 24, device=dev)
    lse, lse2 = torch.randn(first, 3, 4, device=dev) * 4, torch.randn(second, 3, 4, device=dev)
    lse[:, 0, 0] = float("-inf")  # a row whose first parts are all empty
    out[:, 0, 0] = float("nan")
    lse2[:, 1, 1] = float("-inf")
    out2[:, 1, 1] = float("nan")
    want = lse_merge(torch.cat([out, out2]), torch.cat([lse, lse2]), out_dtype=torch.bfloat16)

    got = lse_merge(out, lse, out_dtype=torch.bfloat16, more=(out2, lse2))
    ref = lse_merge_reference(out, lse, out_dtype=torch.bfloat16, more=(out2, lse2))

    for have in (got, ref):
        torch.testing.assert_close(have[0], want[0], atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(have[1], want[1], atol=1e-5, rtol=1e-5)
    assert not torch.isnan(got[0]).any()


def test_merge_refuses_more_parts_of_another_shape() -> None:
    """``more`` must share the batch and head dims; both shapes are named."""
    with pytest.raises(KernelInputError, match=r"\(1, 3, 5\).*\(2, 3, 4\)"):
        lse_merge_reference(
            torch.zeros(2, 3, 4), torch.zeros(2, 3), more=(torch.zeros(1, 3, 5), torch.zeros(1, 3))
        )


def test_merge_rejects_mismatched_lse_shape() -> None:
    """outputs [P, *N, D] and lse [P, *N] must agree; both shapes are named."""
    with pytest.raises(KernelInputError, match=r"\(2, 3, 4\).*\(2, 4\)"):
        lse_merge(torch.zeros(2, 3, 4), torch.zeros(2, 4))


def test_merge_rejects_half_precision_lse() -> None:
    """LSE is fp32 only."""
    with pytest.raises(KernelInputError, match="lse has dtype"):
        lse_merge_reference(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.bfloat16))
