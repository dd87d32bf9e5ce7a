"""Distributed top-k candidate merge against qsa_core.merge_topk and the torch reference."""

from __future__ import annotations

import pytest
import torch

from qsa_core import merge_topk
from qsa_kernels._errors import KernelInputError
from qsa_kernels.topk_merge import merge_candidates, merge_candidates_reference


def _candidates(ranks: int, rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Coarse scores (many ties, signed zeros, infinities) with disjoint ids and some padding."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-4, 5, (ranks, rows, k), generator=g).float() * 0.25
    scores[torch.rand(scores.shape, generator=g) < 0.1] = -0.0
    scores[0, 0, 0], scores[-1, -1, -1] = float("inf"), float("-inf")
    ids = torch.randperm(ranks * rows * k * 3, generator=g)[: ranks * rows * k]
    ids = ids.view(ranks, rows, k).to(torch.int32)
    ids[0, :, : k // 3] = -1
    return scores, ids


def _core_merge(
    scores: torch.Tensor, ids: torch.Tensor, topk: int
) -> list[list[tuple[float, int]]]:
    rows = []
    for r in range(scores.shape[1]):
        per_rank = [
            [(float(s), int(i)) for s, i in zip(scores[w, r], ids[w, r], strict=True) if i >= 0]
            for w in range(scores.shape[0])
        ]
        rows.append([(c.score, c.global_id) for c in merge_topk(per_rank, topk)])
    return rows


def test_reference_equals_qsa_core_merge() -> None:
    """The torch reference reproduces qsa_core.merge_topk row by row."""
    scores, ids = _candidates(3, 4, 9, seed=1)
    ref = merge_candidates_reference(scores, ids, topk=20)
    for r, want in enumerate(_core_merge(scores, ids, 20)):
        got = [(float(s), int(i)) for s, i in zip(ref.scores[r], ref.ids[r], strict=True) if i >= 0]
        assert got == want


def test_nan_score_is_rejected() -> None:
    """A NaN on a valid candidate raises, naming its rank, row and position."""
    scores, ids = _candidates(2, 2, 4, seed=2)
    ids[1, 1, 3] = 5
    scores[1, 1, 3] = float("nan")
    with pytest.raises(KernelInputError, match="rank 1 row 1 position 3"):
        merge_candidates_reference(scores, ids)


@pytest.mark.parametrize(
    ("ranks", "rows", "k", "topk"),
    [
        pytest.param(2, 3, 512, 512, id="2x512"),
        pytest.param(4, 5, 512, 512, id="4x512"),
        pytest.param(8, 2, 512, 512, id="8x512"),
        pytest.param(3, 7, 13, 30, id="odd-3x13-top30"),
        pytest.param(2, 1, 2048, 2048, id="2x2048"),
    ],
)
def test_kernel_equals_qsa_core_merge(
    ranks: int, rows: int, k: int, topk: int, kernel_device: str
) -> None:
    """Scores (bitwise, -0.0 as +0.0) and ids equal qsa_core's merge; padding is (-inf, -1)."""
    scores, ids = _candidates(ranks, rows, k, seed=ranks * k)
    got = merge_candidates(scores.to(kernel_device), ids.to(kernel_device), topk=topk)
    ref = merge_candidates_reference(scores, ids, topk=topk)
    assert torch.equal(got.ids.cpu(), ref.ids)
    assert torch.equal(got.scores.cpu().view(torch.int32), ref.scores.view(torch.int32))
    if k <= 512 and ranks * k <= 1024:
        for r, want in enumerate(_core_merge(scores, ids, topk)):
            valid = got.ids[r] >= 0
            pairs = list(
                zip(got.scores[r][valid].tolist(), got.ids[r][valid].tolist(), strict=True)
            )
            assert pairs == want


def test_kernel_rejects_nan(kernel_device: str) -> None:
    """The GPU launcher refuses NaN scores on valid candidates."""
    scores, ids = _candidates(2, 2, 8, seed=4)
    ids[0, 1, 7] = 99
    scores[0, 1, 7] = float("nan")
    with pytest.raises(KernelInputError, match="NaN"):
        merge_candidates(scores.to(kernel_device), ids.to(kernel_device))
