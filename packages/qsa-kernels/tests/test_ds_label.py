"""Double-sparsity label scores and heavy-token selection against the torch reference."""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import _topk_select as _select
from qsa_kernels._errors import KernelInputError
from qsa_kernels.ds_label import (
    fixed_width_lists,
    fixed_width_lists_reference,
    label_keys_reference,
    label_topk,
    label_topk_reference,
)


def _case(  # noqa: PLR0917
    batch: int,
    hq: int,
    hkv: int,
    d: int,
    c: int,
    width: int,
    *,
    exact: bool,
    seed: int,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    slots = batch * width + 7
    if exact:
        q = torch.randint(-2, 3, (batch, hq, d), generator=g).float()
        k = torch.randint(-2, 3, (slots, hkv, d), generator=g).float()
    else:
        q = torch.randn(batch, hq, d, generator=g)
        k = torch.randn(slots, hkv, d, generator=g)
    channels = torch.stack([torch.randperm(d, generator=g)[:c] for _ in range(hkv)]).to(torch.int32)
    labels = label_keys_reference(k.to(torch.bfloat16), channels)
    r2t = torch.randperm(slots, generator=g)[: batch * width].view(batch, width).to(torch.int32)
    return q.to(torch.bfloat16).to(device), labels.to(device), channels.to(device), r2t.to(device)


def test_reference_group_score_is_sum_over_query_heads() -> None:
    """Two query heads of one KV head add their heavy-channel dot products."""
    q = torch.zeros(1, 2, 4)
    q[0, 0, 3], q[0, 1, 1] = 2.0, 5.0
    labels = torch.tensor([[[1.0, 1.0]], [[3.0, 0.0]]], dtype=torch.bfloat16)  # slots x 1 x C=2
    res = label_topk_reference(
        q,
        labels,
        torch.tensor([[3, 1]]),
        torch.tensor([[1, 0]]),
        torch.tensor([2]),
        heavy_token_num=1,
    )
    assert res.scores[0, 0].tolist() == [6.0, 7.0]
    assert res.positions.tolist() == [[[1]]]


def test_rejects_indivisible_heads() -> None:
    """Query heads must be a multiple of KV heads."""
    with pytest.raises(KernelInputError, match="multiple"):
        label_topk_reference(
            torch.zeros(1, 3, 8),
            torch.zeros(4, 2, 2, dtype=torch.bfloat16),
            torch.zeros(2, 2, dtype=torch.int32),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([4]),
            heavy_token_num=2,
        )


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize(
    ("batch", "hq", "hkv", "d", "c", "width", "lens", "heavy"),
    [
        pytest.param(3, 24, 2, 256, 16, 1500, [1500, 1024, 301], 1024, id="qsa-geometry"),
        pytest.param(2, 8, 8, 128, 32, 700, [700, 3], 64, id="mha-c32"),
        pytest.param(2, 6, 2, 64, 5, 333, [333, 129], 37, id="odd-c5-k37"),
    ],
)
@pytest.mark.parametrize("radix_min_width", [1 << 62, 1], ids=["torch-topk", "radix"])
def test_kernel_equals_reference_on_exact_scores(  # noqa: PLR0917
    radix_min_width: int,
    batch: int,
    hq: int,
    hkv: int,
    d: int,
    c: int,
    width: int,
    lens: list[int],
    heavy: int,
    kernel_device: str,
    int_poison: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Integer-valued inputs: scores and selections (with ties) equal the reference exactly.

    Both selection paths: ``torch.topk`` and the radix select (negative and zero scores included).
    """
    monkeypatch.setattr(_select, "RADIX_MIN_WIDTH", radix_min_width)
    q, labels, channels, r2t = _case(
        batch, hq, hkv, d, c, width, exact=True, seed=c, device=kernel_device
    )
    sl = torch.tensor(lens, device=kernel_device)
    got = label_topk(q, labels, channels, r2t, sl, heavy_token_num=heavy)
    ref = label_topk_reference(q, labels, channels, r2t, sl, heavy_token_num=heavy)
    assert not (got.positions == int_poison).any()
    assert not torch.isnan(got.scores).any()
    assert torch.equal(got.scores.cpu(), ref.scores.cpu())
    assert torch.equal(got.positions.cpu(), ref.positions.cpu())


def test_random_scores_within_fp32_rounding(kernel_device: str) -> None:
    """Gaussian inputs: scores agree to fp32 accumulation error."""
    q, labels, channels, r2t = _case(
        2, 12, 1, 256, 16, 900, exact=False, seed=9, device=kernel_device
    )
    sl = torch.tensor([900, 555], device=kernel_device)
    got = label_topk(q, labels, channels, r2t, sl, heavy_token_num=128)
    ref = label_topk_reference(q, labels, channels, r2t, sl, heavy_token_num=128)
    fin = torch.isfinite(ref.scores)
    assert torch.equal(fin, torch.isfinite(got.scores))
    torch.testing.assert_close(got.scores[fin].cpu(), ref.scores[fin].cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("length_dtype", [torch.int32, torch.int64])
def test_fixed_width_lists_list_heavy_tokens_of_sparse_rows_and_the_context_of_dense_ones(
    kernel_device: str, length_dtype: torch.dtype
) -> None:
    """Rows at, below and above the threshold and within heavy: the kernel is the reference."""
    heavy, width, threshold = 4, 11, 8
    chosen = torch.arange(6 * 3 * heavy, dtype=torch.int32).view(6, 3, heavy).to(kernel_device)
    seq_lens = torch.tensor([8, 7, 12, 3, 4, 5], dtype=length_dtype, device=kernel_device)
    got = fixed_width_lists(chosen, seq_lens, width=width, threshold=threshold)
    want = fixed_width_lists_reference(chosen, seq_lens, width=width, threshold=threshold)
    assert torch.equal(got, want)
    assert got[0, 1].tolist() == [*chosen[0, 1].tolist(), *[-1] * (width - heavy)]  # sparse
    assert got[1, 2].tolist() == [0, 1, 2, 3, 4, 5, 6, -1, -1, -1, -1]  # below the threshold
    assert got[4, 0].tolist() == [0, 1, 2, 3, *[-1] * 7]  # within heavy: dense


def test_fixed_width_lists_refuse_a_width_below_heavy_and_float_lengths() -> None:
    chosen = torch.zeros(1, 1, 4, dtype=torch.int32)
    lengths = torch.ones(1, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="width=3 is not allowed; allowed: at least heavy=4"):
        fixed_width_lists_reference(chosen, lengths, width=3, threshold=0)
    with pytest.raises(KernelInputError, match=r"seq_lens has dtype torch.float32; allowed"):
        fixed_width_lists(chosen, lengths.float(), width=4, threshold=0)
