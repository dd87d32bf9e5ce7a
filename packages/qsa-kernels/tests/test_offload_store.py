"""OffloadedKV's own contract: where appended tokens land, and bad calls that change nothing."""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import KernelPath
from qsa_kernels._errors import KernelInputError
from qsa_kernels.offload import OffloadedKV, OffloadGeometry

_L, _ROWS, _HKV, _D = 2, 3, 1, 16


def _store(device: str, max_blocks: int = 3, path: KernelPath = KernelPath.TRITON) -> OffloadedKV:
    geometry = OffloadGeometry(_L, _ROWS, 4, max_blocks, _HKV, _D, torch.bfloat16)
    return OffloadedKV(geometry, torch.device(device), path=path)


def _tokens(n: int, seed: int, device: str) -> torch.Tensor:
    """``[L, n, Hkv, D]`` bf16 values that are distinct per (layer, token)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(_L, n, _HKV, _D, generator=g).bfloat16().to(device)


def test_append_writes_each_row_at_its_own_offset_and_closes_blocks_to_host(
    kernel_device: str,
) -> None:
    """Rows at offsets 1, 3 and 0: each token lands in its row's tail; a closed block goes home."""
    store = _store(kernel_device)
    prompts = {0: 5, 1: 7, 2: 4}
    for row, n in prompts.items():
        store.admit(row, _tokens(n, row, kernel_device), _tokens(n, 10 + row, kernel_device))
    rows = [2, 0, 1]  # not in row order
    k, v = _tokens(3, 20, kernel_device), _tokens(3, 21, kernel_device)
    store.append(rows, k, v)
    store.wait_for_host_writes()
    if kernel_device != "cpu":
        torch.cuda.synchronize()
    for b, row in enumerate(rows):
        position = prompts[row]
        assert store.length(row) == position + 1
        offset = position % 4
        assert torch.equal(store.tail[:, row, 0, 0, offset], k[:, b])
        assert torch.equal(store.tail[:, row, 0, 1, offset], v[:, b])
    # Row 1 held 7 tokens: the appended one closed block 1, which is now on host bit for bit.
    closed = store.host_arena[1, :, 1]
    assert torch.equal(closed[:, 0, 3].to(kernel_device), k[:, 2])
    assert torch.equal(closed[:, 1, 3].to(kernel_device), v[:, 2])
    # Row 1's next token opens block 2: the slots that held block 1's tokens are cleared.
    assert store.tail[:, 1, 0, :, :3].any()
    store.append([1], _tokens(1, 22, kernel_device), _tokens(1, 23, kernel_device))
    assert not store.tail[:, 1, 0, :, 1:].any()


def test_append_to_a_full_row_raises_and_changes_no_row(kernel_device: str) -> None:
    """A full row anywhere in the batch rejects the whole append before anything is written."""
    store = _store(kernel_device, max_blocks=2)
    store.admit(0, _tokens(5, 0, kernel_device), _tokens(5, 1, kernel_device))
    store.admit(1, _tokens(8, 2, kernel_device), _tokens(8, 3, kernel_device))  # 8 = max tokens
    tail = store.tail.clone()
    with pytest.raises(KernelInputError, match=r"row 1 is full \(8 tokens\)"):
        store.append([0, 1], _tokens(2, 4, kernel_device), _tokens(2, 5, kernel_device))
    assert (store.length(0), store.length(1)) == (5, 8)
    assert torch.equal(store.tail, tail)


@pytest.mark.parametrize(
    ("rows", "shape", "message"),
    [
        ([0], (_L, 2, _HKV, _D), r"k and v must be \(2, 1, 1, 16\); got \(2, 2, 1, 16\)"),
        ([0, 0], (_L, 2, _HKV, _D), r"rows \[0, 0\] repeat a row"),
        ([2], (_L, 1, _HKV, _D), r"row 2 is 'free'; it must be active"),
        ([3], (_L, 1, _HKV, _D), r"row=3 is not allowed; allowed: \[0, 3\)"),
    ],
)
def test_append_rejects_bad_calls_with_their_values(
    rows: list[int], shape: tuple[int, ...], message: str, kernel_device: str
) -> None:
    store = _store(kernel_device)
    store.admit(0, _tokens(5, 0, kernel_device), _tokens(5, 1, kernel_device))
    x = torch.zeros(shape, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(KernelInputError, match=message):
        store.append(rows, x, x)
    assert store.length(0) == 5


def test_attend_rejects_a_missing_step_and_a_bad_layer(kernel_device: str) -> None:
    store = _store(kernel_device)
    store.admit(0, _tokens(9, 0, kernel_device), _tokens(9, 1, kernel_device))
    q = torch.zeros(1, 2, _D, dtype=torch.bfloat16, device=kernel_device)
    blocks = torch.tensor([[0, 1]], dtype=torch.int32, device=kernel_device)
    with pytest.raises(KernelInputError, match=r"attend before begin_step\(\)"):
        store.attend(0, [0], q, blocks)
    store.begin_step()
    with pytest.raises(KernelInputError, match=r"layer=2 is not allowed; allowed: \[0, 2\)"):
        store.attend(2, [0], q, blocks)


def _decode_steps(store: OffloadedKV, device: str, *, by_layer: bool) -> list[torch.Tensor]:
    """Admit rows of 5 and 7 tokens, then 6 decode steps (blocks close in both rows).

    Returns each step's merged attention outputs of both layers, ``[L, B, Hq, D]``.
    """
    store.admit(0, _tokens(5, 0, device), _tokens(5, 1, device))
    store.admit(1, _tokens(7, 2, device), _tokens(7, 3, device))
    rows = [1, 0]
    outputs = []
    for step in range(6):
        k, v = _tokens(2, 30 + step, device), _tokens(2, 40 + step, device)
        q = _tokens(4, 50 + step, device).reshape(_L, 2, 2, _D)
        stamp = store.begin_step()
        assert stamp == step
        if not by_layer:
            store.append(rows, k, v)
        else:
            store.advance(rows)
        per_layer = []
        for layer in range(_L):
            if by_layer:
                store.write_token(layer, rows, k[layer], v[layer])
            closed = [store.length(row) // 4 for row in rows]
            blocks = torch.tensor(
                [[b if b < c else -1 for b in range(4)] for c in closed],
                dtype=torch.int32,
                device=device,
            )
            if by_layer:  # a strided selection, as a slice of the indexer's output is
                blocks = blocks.T.contiguous().T
            out, _ = store.attend(layer, rows, q[layer], blocks)
            per_layer.append(out)
        outputs.append(torch.stack(per_layer))
    store.wait_for_host_writes()
    return outputs


def test_writing_layer_by_layer_equals_appending_all_layers_at_once(kernel_device: str) -> None:
    """advance + write_token per layer leaves the same tails, arena and outputs as append."""
    whole, layered = _store(kernel_device, 4), _store(kernel_device, 4)
    want = _decode_steps(whole, kernel_device, by_layer=False)
    got = _decode_steps(layered, kernel_device, by_layer=True)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(whole.tail, layered.tail)
    for row, closed in ((0, 2), (1, 3)):  # 11 and 13 tokens
        assert torch.equal(whole.host_arena[row, :, :closed], layered.host_arena[row, :, :closed])
    assert [whole.length(r) for r in (0, 1)] == [layered.length(r) for r in (0, 1)] == [11, 13]


def test_torch_reference_path_gives_the_triton_paths_results(kernel_device: str) -> None:
    """The path a CPU-only engine runs (torch references) agrees with the Triton kernels."""
    triton_store = _store(kernel_device, 4, path=KernelPath.TRITON)
    reference_store = _store(kernel_device, 4, path=KernelPath.REFERENCE)
    assert reference_store.path is KernelPath.REFERENCE
    want = _decode_steps(triton_store, kernel_device, by_layer=True)
    got = _decode_steps(reference_store, kernel_device, by_layer=True)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)
    for row, closed in ((0, 2), (1, 3)):  # 11 and 13 tokens
        assert torch.equal(
            triton_store.host_arena[row, :, :closed], reference_store.host_arena[row, :, :closed]
        )
    assert torch.equal(triton_store.tables.slot_block, reference_store.tables.slot_block)


def test_auto_path_takes_triton_on_cuda_and_the_references_elsewhere() -> None:
    assert _store("cpu", path=KernelPath.AUTO).path is KernelPath.REFERENCE
    if torch.cuda.is_available():
        assert _store("cuda", path=KernelPath.AUTO).path is KernelPath.TRITON


def test_write_token_refuses_rows_other_than_the_counted_ones(kernel_device: str) -> None:
    store = _store(kernel_device)
    store.admit(0, _tokens(5, 0, kernel_device), _tokens(5, 1, kernel_device))
    store.admit(1, _tokens(6, 2, kernel_device), _tokens(6, 3, kernel_device))
    x = torch.zeros(1, _HKV, _D, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(KernelInputError, match=r"the last advance\(\) counted rows None"):
        store.write_token(0, [0], x, x)
    store.advance([0])
    tail = store.tail.clone()
    counted = r"for rows \[1\]; the last advance\(\) counted rows \[0\]"
    with pytest.raises(KernelInputError, match=counted):
        store.write_token(0, [1], x, x)
    with pytest.raises(KernelInputError, match=r"layer=2 is not allowed"):
        store.write_token(2, [0], x, x)
    assert torch.equal(store.tail, tail)


def test_geometry_bytes_equal_what_the_store_allocates() -> None:
    store = _store("cpu", path=KernelPath.REFERENCE)
    g = store.geometry
    tables = store.tables
    allocated = sum(
        t.numel() * t.element_size()
        for t in (store.hot, store.tail, tables.slot_block, tables.slot_stamp, tables.block_slot)
    )
    assert g.device_bytes == allocated
    assert g.host_bytes == store.host_arena.numel() * store.host_arena.element_size()
