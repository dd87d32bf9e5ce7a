"""Write-back of closed blocks and prompt hand-off: bit-exact, nothing else touched, event given."""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import KernelInputError
from qsa_kernels.writeback import (
    offload_prompt,
    offload_prompt_reference,
    writeback_blocks,
    writeback_blocks_reference,
)

DTYPES = [torch.float8_e4m3fn, torch.bfloat16]


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    bits = torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16)
    if dtype == torch.bfloat16:
        return bits.view(torch.bfloat16)
    return (bits & 0x7E).to(torch.uint8).view(torch.float8_e4m3fn)


def _wait(event: torch.cuda.Event | None, device: str) -> None:
    if device == "cuda":
        assert isinstance(event, torch.cuda.Event)
        event.synchronize()
    else:
        assert event is None


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp8", "bf16"])
def test_writeback_copies_closed_blocks_exactly_and_nothing_else(
    kernel_device: str, dtype: torch.dtype
) -> None:
    """Each closed block lands at its arena place bit for bit; every other record is unchanged."""
    torch.manual_seed(11)
    L, R, S, NB, Hkv, D = (3, 4, 16, 50, 1, 256) if kernel_device == "cuda" else (2, 3, 5, 9, 1, 16)
    dev = torch.device(kernel_device)
    hot = _random((L, R, S, 2, 4, Hkv, D), dtype).to(dev)
    arena = _random((R, L, NB, 2, 4, Hkv, D), dtype)
    if kernel_device == "cuda":
        arena = arena.pin_memory()
    arena_ref = arena.clone()
    entries = [(1, 0, 2, 7), (0, L - 1, S - 1, 0), (R - 1, 1, 0, NB - 1), (2, 0, 3, 4)]
    rows, layers, slots, blocks = (
        torch.tensor(col, dtype=torch.int32, device=dev) for col in zip(*entries, strict=True)
    )
    event = writeback_blocks(hot, arena, rows=rows, layers=layers, slots=slots, blocks=blocks)
    _wait(event, kernel_device)
    writeback_blocks_reference(
        hot.cpu(),
        arena_ref,
        rows=rows.cpu(),
        layers=layers.cpu(),
        slots=slots.cpu(),
        blocks=blocks.cpu(),
    )
    assert torch.equal(arena.view(torch.uint8), arena_ref.view(torch.uint8))
    for r, layer, s, b in entries:
        assert torch.equal(
            arena[r, layer, b].view(torch.uint8), hot[layer, r, s].cpu().view(torch.uint8)
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp8", "bf16"])
def test_writeback_skips_entries_whose_block_is_minus_one(
    kernel_device: str, dtype: torch.dtype
) -> None:
    """A fixed-size launch with masked entries (-1) writes only the unmasked records."""
    L, R, S, NB, Hkv, D = 2, 3, 2, 4, 1, 16
    dev = torch.device(kernel_device)
    hot = _random((L, R, S, 2, 4, Hkv, D), dtype).to(dev)
    arena = _random((R, L, NB, 2, 4, Hkv, D), dtype)
    if kernel_device == "cuda":
        arena = arena.pin_memory()
    before = arena.clone()
    rows, layers, slots, blocks = (
        torch.tensor(col, dtype=torch.int32, device=dev)
        for col in ([0, 1, 2], [1, 0, 1], [0, 1, 1], [-1, 3, -1])
    )
    for copy in (writeback_blocks, writeback_blocks_reference):
        arena.copy_(before)
        event = copy(hot, arena, rows=rows, layers=layers, slots=slots, blocks=blocks)
        if kernel_device == "cuda":
            torch.cuda.synchronize()
        del event
        expected = before.clone()
        expected[1, 0, 3] = hot[0, 1, 1].cpu()
        assert torch.equal(arena.view(torch.uint8), expected.view(torch.uint8)), copy.__name__


@pytest.mark.parametrize("tokens", [3, 4, 37])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp8", "bf16"])
def test_offload_prompt_packs_complete_blocks_only(
    kernel_device: str, dtype: torch.dtype, tokens: int
) -> None:
    """Complete blocks become (4 K rows, 4 V rows) records; the open tail and other rows stay."""
    torch.manual_seed(tokens)
    L, R, NB, Hkv, D = (12, 3, 20, 1, 256) if kernel_device == "cuda" else (2, 3, 12, 1, 16)
    dev = torch.device(kernel_device)
    k = _random((L, tokens, Hkv, D), dtype).to(dev)
    v = _random((L, tokens, Hkv, D), dtype).to(dev)
    arena = _random((R, L, NB, 2, 4, Hkv, D), dtype)
    if kernel_device == "cuda":
        arena = arena.pin_memory()
    arena_ref = arena.clone()
    n, event = offload_prompt(k, v, arena, 1, first_block=2)
    _wait(event, kernel_device)
    n_ref = offload_prompt_reference(k.cpu(), v.cpu(), arena_ref, 1, first_block=2)
    assert n == n_ref == tokens // 4
    assert torch.equal(arena.view(torch.uint8), arena_ref.view(torch.uint8))
    if n:
        last = n - 1
        want_k = k[:, 4 * last : 4 * last + 4].cpu().view(torch.uint8)
        assert torch.equal(arena[1, :, 2 + last, 0].view(torch.uint8), want_k)
        want_v = v[:, 4 * last : 4 * last + 4].cpu().view(torch.uint8)
        assert torch.equal(arena[1, :, 2 + last, 1].view(torch.uint8), want_v)


@pytest.mark.gpu
def test_offload_prompt_takes_more_blocks_than_a_grid_axis_beyond_the_first_holds() -> None:
    """A 262,148-token prompt (65,537 blocks; CUDA grid axes 1 and 2 stop at 65,535) lands whole."""
    torch.manual_seed(5)
    L, T, Hkv, D = 2, 4 * 65_537, 1, 16
    k = _random((L, T, Hkv, D), torch.bfloat16).cuda()
    v = _random((L, T, Hkv, D), torch.bfloat16).cuda()
    arena = torch.zeros((1, L, T // 4, 2, 4, Hkv, D), dtype=torch.bfloat16).pin_memory()
    arena_ref = arena.clone()
    n, event = offload_prompt(k, v, arena, 0)
    _wait(event, "cuda")
    assert n == offload_prompt_reference(k.cpu(), v.cpu(), arena_ref, 0) == T // 4
    assert torch.equal(arena.view(torch.uint8), arena_ref.view(torch.uint8))


@pytest.mark.gpu
def test_writeback_runs_after_work_queued_on_the_current_stream() -> None:
    """A block written on the current stream just before the call is what reaches the arena."""
    dev = torch.device("cuda")
    hot = torch.zeros((1, 1, 2, 2, 4, 1, 256), dtype=torch.bfloat16, device=dev)
    arena = torch.zeros((1, 1, 4, 2, 4, 1, 256), dtype=torch.bfloat16).pin_memory()
    torch.cuda._sleep(10_000_000)  # type: ignore[no-untyped-call]
    # keep the current stream busy so a racing copy would see 0
    hot[0, 0, 1].fill_(3.0)
    idx = torch.tensor([0], dtype=torch.int32, device=dev)
    one = torch.tensor([1], dtype=torch.int32, device=dev)
    event = writeback_blocks(hot, arena, rows=idx, layers=idx, slots=one, blocks=one)
    assert event is not None
    event.synchronize()
    assert bool((arena[0, 0, 1] == 3.0).all())
    assert not arena[0, 0, 0].any()


def test_offload_prompt_rejects_blocks_past_the_arena() -> None:
    """A prompt that does not fit the row's NB blocks is refused, naming the range."""
    k = torch.zeros((1, 40, 1, 16), dtype=torch.bfloat16)
    arena = torch.zeros((1, 1, 9, 2, 4, 1, 16), dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="NB=9"):
        offload_prompt_reference(k, k.clone(), arena, 0)


def test_writeback_rejects_a_strided_index_vector_naming_it() -> None:
    """The kernel reads index vectors densely: a strided view would copy the wrong records."""
    hot = torch.zeros((2, 3, 1, 2, 4, 1, 16), dtype=torch.bfloat16)
    arena = torch.zeros((3, 2, 4, 2, 4, 1, 16), dtype=torch.bfloat16)
    before = arena.clone()
    layers = torch.tensor([[0, 0], [1, 1]], dtype=torch.int32)[:, 0]  # [0, 1] with stride 2
    rows = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(
        KernelInputError, match=r"layers must be contiguous; got shape \(2,\) with strides \(2,\)"
    ):
        writeback_blocks(hot, arena, rows=rows, layers=layers, slots=rows, blocks=rows)
    with pytest.raises(KernelInputError, match="layers must be contiguous"):
        writeback_blocks_reference(hot, arena, rows=rows, layers=layers, slots=rows, blocks=rows)
    assert torch.equal(arena, before)


def test_writeback_rejects_mismatched_index_lengths() -> None:
    """The four index vectors must have one length."""
    hot = torch.zeros((1, 1, 2, 2, 4, 1, 16), dtype=torch.bfloat16)
    arena = torch.zeros((1, 1, 4, 2, 4, 1, 16), dtype=torch.bfloat16)
    one = torch.zeros(1, dtype=torch.int32)
    two = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="slots"):
        writeback_blocks(hot, arena, rows=one, layers=one, slots=two, blocks=one)


def test_offload_prompt_rejects_a_non_contiguous_v_naming_it() -> None:
    """A v view with gaps between its tokens is refused with its name, shape and strides."""
    k = torch.zeros((1, 8, 1, 16), dtype=torch.bfloat16)
    v = torch.zeros((1, 8, 2, 16), dtype=torch.bfloat16)[:, :, :1]
    arena = torch.zeros((1, 1, 4, 2, 4, 1, 16), dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"v must be contiguous; got shape \(1, 8, 1, 16\)"):
        offload_prompt_reference(k, v, arena, 0)
