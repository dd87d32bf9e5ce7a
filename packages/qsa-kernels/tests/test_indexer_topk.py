"""QSA indexer scoring and exact block top-k against the torch reference."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsa_kernels import _topk_radix as _radix
from qsa_kernels import _topk_select as _select
from qsa_kernels._errors import KernelInputError
from qsa_kernels._topk_keys import KEY_NONE
from qsa_kernels.indexer_topk import (
    indexer_scores,
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_reference,
)
from qsa_kernels.indexer_topk import triton as indexer_triton

DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _case(
    seq_lens: list[int],
    pages: int,
    width: int,
    dtype: torch.dtype,
    *,
    exact: bool,
    seed: int,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random indexer inputs; ``exact`` draws small integers so every dot product is exact."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    if exact:
        q = torch.randint(-2, 3, (batch, 4, 128), generator=g).float()
        k = torch.randint(-2, 3, (pages, 16, 128), generator=g).float()
    else:
        q = torch.randn(batch, 4, 128, generator=g)
        k = torch.randn(pages, 16, 128, generator=g)
    perm = torch.randperm(pages, generator=g)
    pt = torch.stack([perm[torch.randperm(pages, generator=g)[:width]] for _ in range(batch)])
    return (
        q.to(dtype).to(device),
        k.to(dtype).to(device),
        pt.to(torch.int32).to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def test_reference_scores_follow_the_formula() -> None:
    """A hand-built block's score is the sum of relu'd head dots over sqrt(128)."""
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    q[0, 0, 0], q[0, 1, 0], q[0, 2, 1], q[0, 3, 0] = 2.0, -1.0, 3.0, 1.0
    k = torch.zeros(2, 16, 128, dtype=torch.bfloat16)
    k[1, 0, 0], k[1, 0, 1] = 1.0, 1.0  # block 0 lives in page 1
    pt = torch.tensor([[1, 0]], dtype=torch.int32)
    s = indexer_scores_reference(q, k, pt, torch.tensor([8]))
    assert s[0, 0].item() == pytest.approx((2 + 0 + 3 + 1) / math.sqrt(128))
    assert s[0, 1].item() == 0.0
    assert torch.isneginf(s[0, 2:]).all()


def test_reference_ties_prefer_smaller_block_ids() -> None:
    """With every score equal, the top-k is the k smallest block ids."""
    q = torch.ones(1, 4, 128, dtype=torch.bfloat16)
    k = torch.ones(4, 16, 128, dtype=torch.bfloat16)
    pt = torch.tensor([[3, 2, 1, 0]], dtype=torch.int32)
    out = indexer_topk_reference(q, k, pt, torch.tensor([4 * 50 + 2]), topk=7)
    assert out.tolist() == [list(range(7))]


def test_rejects_wrong_key_shape() -> None:
    """A key cache that is not [pages, 16, 128] is refused with the shape in the message."""
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"\(3, 8, 128\)"):
        indexer_topk_reference(
            q,
            torch.zeros(3, 8, 128, dtype=torch.bfloat16),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([4]),
        )


CASES = [
    pytest.param(
        [4 * 600 + 3, 4 * 17, 4 * 512, 4 * 513, 2, 0, 4 * 16 * 9 + 1],
        64,
        48,
        512,
        id="mixed-lengths-k512",
    ),
    pytest.param(
        [4 * 16 * 40, 4 * 16 * 40 - 1, 4 * 2049 + 1], 160, 140, 2048, id="k2048-page-edges"
    ),
    pytest.param([4 * 333 + 1, 4 * 100], 40, 30, 37, id="odd-k37"),
    pytest.param([4 * 16 * 30], 40, 20, 64, id="length-beyond-page-table"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize(("seq_lens", "pages", "width", "topk"), CASES)
def test_topk_equals_reference_on_exact_scores(  # noqa: PLR0917
    seq_lens: list[int],
    pages: int,
    width: int,
    topk: int,
    dtype: torch.dtype,
    kernel_device: str,
    poisoned_int: Callable[..., torch.Tensor],
    int_poison: int,
) -> None:
    """Exactly representable dots (many ties): the kernel's ids equal the reference's."""
    q, k, pt, sl = _case(seq_lens, pages, width, dtype, exact=True, seed=topk, device=kernel_device)
    out = poisoned_int(len(seq_lens), topk)
    indexer_topk(q, k, pt, sl, topk=topk, out=out)
    assert not (out == int_poison).any()
    assert torch.equal(out.cpu(), indexer_topk_reference(q, k, pt, sl, topk=topk).cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
def test_scores_match_reference_within_fp32_rounding(
    dtype: torch.dtype, kernel_device: str, poisoned_float: Callable[..., torch.Tensor]
) -> None:
    """Random keys: scores agree to fp32 accumulation error and -inf marks invisible blocks."""
    q, k, pt, sl = _case(
        [4 * 700 + 3, 4 * 31 + 2, 1], 64, 50, dtype, exact=False, seed=3, device=kernel_device
    )
    out = poisoned_float(3, 50 * 16)
    indexer_scores(q, k, pt, sl, out=out)
    ref = indexer_scores_reference(q, k, pt, sl)
    assert not torch.isnan(out).any()
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(out[fin].cpu(), ref[fin].cpu(), rtol=1e-5, atol=1e-5)


def test_random_selection_differs_only_at_fp32_near_ties(kernel_device: str) -> None:
    """Random keys: any block picked by one side only scores within rounding of the k-th score."""
    q, k, pt, sl = _case(
        [4 * 900, 4 * 1300 + 1], 96, 90, torch.bfloat16, exact=False, seed=5, device=kernel_device
    )
    out = indexer_topk(q, k, pt, sl, topk=512)
    ref = indexer_topk_reference(q, k, pt, sl, topk=512)
    scores = indexer_scores_reference(q, k, pt, sl)
    for row in range(2):
        got, want = set(out[row].tolist()), set(ref[row].tolist())
        assert len(got) == 512
        kth = scores[row, sorted(want)].min().item()
        for blk in got ^ want:
            assert abs(scores[row, blk].item() - kth) <= 1e-5 * max(1.0, abs(kth))


def test_all_zero_scores_select_the_smallest_ids(kernel_device: str) -> None:
    """Queries anti-aligned with every key give score 0 everywhere: ids 0..k-1 win."""
    q = torch.ones(2, 4, 128, dtype=torch.bfloat16, device=kernel_device)
    k = -torch.ones(70, 16, 128, dtype=torch.bfloat16, device=kernel_device)
    pt = torch.randperm(70, device=kernel_device)[:64].view(1, 64).repeat(2, 1).to(torch.int32)
    sl = torch.tensor([4 * 1000 + 3, 4 * 600], device=kernel_device)
    out = indexer_topk(q, k, pt, sl, topk=512)
    assert out.cpu().tolist() == [list(range(512))] * 2


def _row_keys(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Packed order keys of ``scores [rows, width]`` (columns ``>= n`` are non-candidates)."""
    rows, width = scores.shape
    keys = torch.empty((rows, width), dtype=torch.int64, device=scores.device)
    _select._pack_rows_kernel[(rows, -(-width // 1024))](
        scores, lengths, keys, width, scores.stride(0), keys.stride(0), BLOCK=1024
    )
    return keys


def _scores(mode: str, rows: int, width: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if mode == "random":
        s = torch.rand(rows, width, generator=g) * 7
    elif mode == "few-values":
        s = torch.randint(0, 4, (rows, width), generator=g).float() / 8
    elif mode == "all-equal":
        s = torch.full((rows, width), 1.5)
    else:  # signed zeros, with a few ones so the threshold falls among the zeros
        s = torch.where(torch.rand(rows, width, generator=g) < 0.5, -0.0, 0.0)
        s[:, ::97] = 1.0
    return s.to(device)


MODES = ["random", "few-values", "all-equal", "signed-zeros"]


def _hist_reference(keys: torch.Tensor) -> torch.Tensor:
    """``[rows, BINS]``: per row, the count of real keys per radix digit."""
    valid = keys != KEY_NONE
    digit = torch.clamp(keys >> _radix.SHIFT, 0, _radix.BINS - 1)
    rows = [torch.bincount(d[v], minlength=_radix.BINS) for d, v in zip(digit, valid, strict=True)]
    return torch.stack(rows).to(torch.int32)


def _hist_of(ws: torch.Tensor) -> torch.Tensor:
    """The histogram a workspace holds, its copies summed: ``[rows, BINS]``."""
    copies = ws[:, : _radix.COPIES * _radix.BINS].view(-1, _radix.COPIES, _radix.BINS)
    return copies.sum(1, dtype=torch.int32)


@pytest.mark.parametrize("mode", MODES)
def test_radix_histogram_counts_every_real_key(mode: str, kernel_device: str) -> None:
    """Pass 1 counts each real key once, bin 0 (zeros) through its per-tile path included."""
    s = _scores(mode, 3, 2999, seed=len(mode), device=kernel_device)
    n = torch.tensor([2999, 1500, 0], dtype=torch.int32, device=kernel_device)
    keys = _row_keys(s, n)
    ws = _radix.new_workspace(3, keys.device)
    _radix.stage_hist(keys, ws, 100)
    assert torch.equal(_hist_of(ws).cpu(), _hist_reference(keys.cpu()))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cap", [1024, 16], ids=["rank", "overflow"])
def test_radix_select_equals_reference(
    mode: str,
    cap: int,
    monkeypatch: pytest.MonkeyPatch,
    kernel_device: str,
    poisoned_int: Callable[..., torch.Tensor],
) -> None:
    """Radix select: same ids as the reference, ties to smaller ids, both threshold paths."""
    monkeypatch.setattr(_radix, "CHUNK", 1024)
    monkeypatch.setattr(_radix, "CAND_CAP", cap)
    width, k = 3001, 100
    s = _scores(mode, 5, width, seed=len(mode) + cap, device=kernel_device)
    n = torch.tensor(
        [width, width - 1, k, k - 1, 1024 + 7], dtype=torch.int32, device=kernel_device
    )
    keys = _row_keys(s, n)
    out = poisoned_int(5, k)
    _radix.radix_topk_from_keys(keys, k, out)
    assert torch.equal(out.cpu(), _select.row_topk_reference(s, n, k).cpu())
    ws = _radix.new_workspace(5, keys.device)
    _radix.stage_hist(keys, ws, k)
    _radix.stage_flags(keys, ws, k)
    candidates = ws[:, _radix.COPIES * _radix.BINS + _radix._CAND_COUNT.value]
    overflowed = bool((candidates > cap).any())
    if cap == 16 and mode != "random":
        assert overflowed  # the 4-bit radix over the row's bin resolved it
    if cap == 1024 and mode == "random":
        assert not overflowed  # ranking the candidates resolved it


@st.composite
def _radix_rows(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows of scores with few distinct values (ties), signed zeros, negatives and gaps."""
    rows = draw(st.integers(1, 3))
    width = draw(st.integers(1, 2600))
    values = draw(
        st.lists(
            st.sampled_from([-2.5, -0.0, 0.0, 1e-40, 0.5, 1.0, 1.0625, 7.0, 3e38]),
            min_size=1,
            max_size=6,
        )
    )
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(values), (rows, width), generator=g)
    s = torch.tensor(values)[pick]
    if draw(st.booleans()):  # some distinct scores among the ties
        s = s + torch.rand(rows, width, generator=g) * draw(st.sampled_from([1e-3, 1.0]))
    n = torch.tensor([draw(st.integers(0, width)) for _ in range(rows)], dtype=torch.int32)
    return s, n, draw(st.integers(1, 700))


@settings(max_examples=80, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_radix_rows(), cap=st.sampled_from([8, 64, 1024]), tiles=st.sampled_from([1, 2, 4]))
def test_radix_select_equals_reference_on_drawn_rows(
    case: tuple[torch.Tensor, torch.Tensor, int],
    cap: int,
    tiles: int,
    monkeypatch: pytest.MonkeyPatch,
    kernel_device: str,
) -> None:
    """Any mix of ties, signed zeros, negatives, lengths and k; small caps force the overflow path.

    Small ``CHUNK`` and ``MAX_TILES`` give rows of several tiles with several chunks each, so the
    per-tile offsets, the last-program epilogues and the column-ordered write are exercised across
    tile edges (on a GPU, with the programs of a row running concurrently).
    """
    s, n, k = case
    monkeypatch.setattr(_radix, "CHUNK", 256)
    monkeypatch.setattr(_radix, "MAX_TILES", tiles)
    monkeypatch.setattr(_radix, "CAND_CAP", cap)
    keys = _row_keys(s.to(kernel_device), n.to(kernel_device))
    out = torch.full((s.shape[0], k), 12345, dtype=torch.int32, device=kernel_device)
    _radix.radix_topk_from_keys(keys, k, out)
    assert torch.equal(out.cpu(), _select.row_topk_reference(s, n, k))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize(("seq_lens", "pages", "width", "topk"), CASES)
def test_radix_indexer_topk_equals_reference(  # noqa: PLR0917
    seq_lens: list[int],
    pages: int,
    width: int,
    topk: int,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    kernel_device: str,
    poisoned_int: Callable[..., torch.Tensor],
) -> None:
    """Indexer top-k through the radix select: exact ids on tie-heavy scores, bf16 and fp8.

    The histogram the scoring kernel fills is the one stage 1 computes from its keys.
    """
    monkeypatch.setattr(_select, "RADIX_MIN_WIDTH", 1)
    monkeypatch.setattr(_radix, "CHUNK", 1024)
    q, k, pt, sl = _case(
        seq_lens, pages, width, dtype, exact=True, seed=topk + 7, device=kernel_device
    )
    out = poisoned_int(len(seq_lens), topk)
    indexer_topk(q, k, pt, sl, topk=topk, out=out)
    assert torch.equal(out.cpu(), indexer_topk_reference(q, k, pt, sl, topk=topk).cpu())
    fused = _radix.new_workspace(len(seq_lens), q.device)
    keys = indexer_triton.indexer_keys(q, k, pt, sl, radix=(fused, topk))
    assert torch.equal(_hist_of(fused).cpu(), _hist_reference(keys.cpu()))


def test_radix_candidate_overflow_stays_exact(
    monkeypatch: pytest.MonkeyPatch, kernel_device: str
) -> None:
    """All-zero indexer scores put every block in one bin: the overflow path keeps ids 0..k-1."""
    monkeypatch.setattr(_select, "RADIX_MIN_WIDTH", 1)
    monkeypatch.setattr(_radix, "CAND_CAP", 32)
    q = torch.ones(2, 4, 128, dtype=torch.bfloat16, device=kernel_device)
    k = -torch.ones(70, 16, 128, dtype=torch.bfloat16, device=kernel_device)
    pt = torch.randperm(70, device=kernel_device)[:64].view(1, 64).repeat(2, 1).to(torch.int32)
    sl = torch.tensor([4 * 1000 + 3, 4 * 600], device=kernel_device)
    out = indexer_topk(q, k, pt, sl, topk=512)
    assert out.cpu().tolist() == [list(range(512))] * 2


@pytest.mark.gpu
def test_radix_indexer_topk_replays_from_a_cuda_graph_on_new_queries() -> None:
    """Captured once, replayed on new queries: exact ids every time (workspace zeroed per replay).

    The rows are wide enough for the radix path (4800 blocks), of three lengths, one at a page
    edge; integer-valued inputs make every score exact, so the reference decides the ids.
    """
    q, k, pt, sl = _case(
        [4 * 4800, 4 * 16 * 200 + 3, 4 * 4097],
        1000,
        300,
        torch.bfloat16,
        exact=True,
        seed=5,
        device="cuda",
    )
    assert _select.uses_radix(pt.shape[1] * 16)
    out = torch.empty(3, 512, dtype=torch.int32, device="cuda")
    indexer_topk(q, k, pt, sl, topk=512, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_topk(q, k, pt, sl, topk=512, out=out)
    g = torch.Generator().manual_seed(6)
    for replay in range(3):
        q.copy_(torch.randint(-2, 3, tuple(q.shape), generator=g).to(q.dtype))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        want = indexer_topk_reference(q, k, pt, sl, topk=512)
        assert torch.equal(out, want), replay
