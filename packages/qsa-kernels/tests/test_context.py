"""Prefill over one request's context, and over packed no-prefix chunks, on an engine's kernels.

The position arithmetic (a context's rows as slots, each packed request's base row, the chunk
kernel's entries for the context's last rows or for a rank's zigzag blocks) is checked against
the fp32 oracle :func:`qsa_kernels.cp.sparse_prefill_reference`, with the kernels of both paths
stood for by the torch references of their contracts (:meth:`PrefillKernels.reference`).
"""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import KernelPath
from qsa_kernels.context import PrefillKernels, ZigzagEntries, attend_chunks, attend_context
from qsa_kernels.cp import sparse_prefill_reference

HQ, HKV, D, WIDTH = 4, 2, 16, 12
SCALE = D**-0.5
KERNELS = PrefillKernels.reference()
PATHS = [KernelPath.REFERENCE, KernelPath.TRITON]  # TRITON: the packed and chunk kernels


def _selection(positions: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``[T, WIDTH]`` distinct causal positions per row (``<=`` its own), ``-1`` padded."""
    rows = []
    for p in positions.tolist():
        picked = torch.randperm(p + 1, generator=gen)[:WIDTH]
        rows.append(torch.cat([picked, picked.new_full((WIDTH - picked.numel(),), -1)]))
    return torch.stack(rows)


def _request(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn((tokens, HQ, D), generator=gen)
    k = torch.randn((tokens, HKV, D), generator=gen)
    v = torch.randn((tokens, HKV, D), generator=gen)
    return q, k, v, _selection(torch.arange(tokens), gen)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
@pytest.mark.parametrize("prefix", [0, 37])
def test_a_chunk_after_its_prefix_attends_over_the_context_as_the_oracle(
    path: KernelPath, prefix: int
) -> None:
    """The chunk's rows (the context's last ``T``) over the whole context equal the oracle's
    rows of the request."""
    gen = torch.Generator().manual_seed(1 + prefix)
    q, k, v, picks = _request(prefix + 29, gen)
    want, _ = sparse_prefill_reference(q, k, v, picks, [q.shape[0]], scale=SCALE)
    got = attend_context(q[prefix:], k, v, picks[prefix:], SCALE, KERNELS, path=path)
    torch.testing.assert_close(got, want[prefix:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
@pytest.mark.parametrize("world", [2, 3])
def test_each_ranks_zigzag_rows_attend_over_the_gathered_chunk_as_the_oracle(
    path: KernelPath, world: int
) -> None:
    """Rank ``r`` holds blocks ``r`` and ``2C - 1 - r`` of a chunk after a prefix; its entries
    (one per block, each ending at its last row's position) give the oracle's rows."""
    prefix, block = 11, 7
    size = 2 * world * block
    gen = torch.Generator().manual_seed(world)
    q, k, v, picks = _request(prefix + size, gen)
    want, _ = sparse_prefill_reference(q, k, v, picks, [q.shape[0]], scale=SCALE)
    for rank in range(world):
        blocks = (rank, 2 * world - 1 - rank)
        rows = torch.cat([torch.arange(b * block, (b + 1) * block) + prefix for b in blocks])
        zigzag = ZigzagEntries(
            cu_q=torch.tensor([0, block, 2 * block], dtype=torch.int32),
            kv_ends=torch.tensor([prefix + (b + 1) * block for b in blocks], dtype=torch.int32),
            max_rows=block,
        )
        got = attend_context(q[rows], k, v, picks[rows], SCALE, KERNELS, zigzag=zigzag, path=path)
        torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
def test_packed_prompts_each_attend_over_their_own_chunk_as_the_oracle(path: KernelPath) -> None:
    """Three whole prompts packed in one batch; keys given flat (``[T, Hkv * D]``) as an
    engine's projection hands them over."""
    gen = torch.Generator().manual_seed(7)
    lens = [5, 23, 14]
    parts = [_request(n, gen) for n in lens]
    q, k, v, picks = (torch.cat([p[i] for p in parts]) for i in range(4))
    want, _ = sparse_prefill_reference(q, k, v, picks, lens, scale=SCALE)
    tokens = q.shape[0]
    got = attend_chunks(
        q, k.reshape(tokens, -1), v.reshape(tokens, -1), picks, lens, SCALE, KERNELS, path=path
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_positions_past_the_context_are_padding_on_the_reference_path() -> None:
    """A selected position at or past the context's end is not read (no out-of-range row)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, picks = _request(9, gen)
    past = picks.clone()
    past[:, -1] = 9  # one past the end
    got = attend_context(q, k, v, past, SCALE, KERNELS, path=KernelPath.REFERENCE)
    want = attend_context(q, k, v, picks, SCALE, KERNELS, path=KernelPath.REFERENCE)
    assert torch.equal(got, want)


def test_the_output_keeps_the_querys_dtype() -> None:
    """bf16 queries over bf16 K/V come back bf16 (the fp32 softmax is internal)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, picks = (
        t.to(torch.bfloat16) if t.is_floating_point() else t for t in _request(8, gen)
    )
    for path in PATHS:
        assert attend_context(q, k, v, picks, SCALE, KERNELS, path=path).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("requests", "seq_lens", "extend_lens", "zigzag"),
    [
        (1, [96], [96], True),  # one whole prompt
        (1, [160], [64], False),  # a chunk after its prefix
        (2, [96, 32], [96, 32], False),  # several requests
    ],
)
def test_only_one_whole_prompt_attends_by_zigzag_rows(
    requests: int, seq_lens: list[int], extend_lens: list[int], zigzag: bool
) -> None:
    assert ZigzagEntries.applies(requests, seq_lens, extend_lens) is zigzag
