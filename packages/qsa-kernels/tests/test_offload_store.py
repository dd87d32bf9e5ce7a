"""The stores' own contract: where appended tokens land, and bad calls that change nothing."""

from __future__ import annotations

import pytest
import torch

from qsa_core import format_bytes
from qsa_kernels import KernelPath
from qsa_kernels._errors import KernelInputError
from qsa_kernels.offload import OffloadedKV, OffloadGeometry, PerHeadOffloadedKV, RowState

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


def _step_outputs(
    store: OffloadedKV, device: str, rows: list[int], seed: int, pad_to: int | None
) -> list[torch.Tensor]:
    """One layer-by-layer decode step of ``rows``; returns each layer's ``[B, Hq, D]`` output."""
    k, v = _tokens(len(rows), seed, device), _tokens(len(rows), seed + 1, device)
    q = _tokens(2 * len(rows), seed + 2, device).reshape(_L, len(rows), 2, _D)
    store.begin_step()
    step = store.advance(rows, pad_to=pad_to)
    pad = len(step) - len(rows)
    outputs = []
    for layer in range(_L):
        zeros = torch.zeros(pad, _HKV, _D, dtype=torch.bfloat16, device=device)
        store.write_token(layer, step, torch.cat((k[layer], zeros)), torch.cat((v[layer], zeros)))
        closed = store.step_closed_blocks.unsqueeze(1)
        every = torch.arange(4, dtype=torch.int32, device=device).expand(len(step), 4)
        blocks = torch.where(every < closed, every, -1)
        qs = torch.cat((q[layer], torch.zeros(pad, 2, _D, dtype=torch.bfloat16, device=device)))
        out, _ = store.attend(layer, step, qs, blocks)
        outputs.append(out[: len(rows)])
    return outputs


def test_a_step_padded_with_free_rows_equals_the_unpadded_step(kernel_device: str) -> None:
    """What a CUDA graph of a larger batch runs: padding changes no output, tail or arena block."""
    plain, padded = _store(kernel_device, 4), _store(kernel_device, 4)
    for store in (plain, padded):
        store.admit(0, _tokens(6, 0, kernel_device), _tokens(6, 1, kernel_device))
    for seed in range(0, 30, 5):  # six steps: row 0 goes from 6 to 12 tokens, closing 2 blocks
        want = _step_outputs(plain, kernel_device, [0], seed, None)
        got = _step_outputs(padded, kernel_device, [0], seed, 3)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)
    assert plain.length(0) == padded.length(0) == 12
    assert padded.state(1) is padded.state(2) is RowState.FREE
    assert torch.equal(plain.tail[:, 0], padded.tail[:, 0])
    assert torch.equal(plain.host_arena[0, :, :3], padded.host_arena[0, :, :3])
    assert torch.equal(plain.tables.slot_block[:, 0], padded.tables.slot_block[:, 0])
    assert (padded.tables.slot_block[:, 1:] == -1).all()  # padding selected nothing


def test_padding_refuses_a_batch_it_cannot_fill_and_changes_nothing(kernel_device: str) -> None:
    store = _store(kernel_device)
    store.admit(0, _tokens(5, 0, kernel_device), _tokens(5, 1, kernel_device))
    store.admit(1, _tokens(5, 2, kernel_device), _tokens(5, 3, kernel_device))
    with pytest.raises(KernelInputError, match=r"pad_to=4 needs 3 free rows to pad 1 rows; 1 of 3"):
        store.advance([0], pad_to=4)
    with pytest.raises(
        KernelInputError, match=r"pad_to=1 is not allowed; allowed: an int >= the 2"
    ):
        store.advance([0, 1], pad_to=1)
    assert (store.length(0), store.length(1)) == (5, 5)
    assert store.advance([0], pad_to=2) == (0, 2)


@pytest.mark.gpu
def test_a_captured_decode_step_replays_the_eager_steps() -> None:
    """One CUDA graph of write_token + attend, replayed over changing rows, equals eager steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device, batch = "cuda", 3

    def five_rows() -> OffloadedKV:
        geometry = OffloadGeometry(_L, 5, 4, 4, _HKV, _D, torch.bfloat16)
        store = OffloadedKV(geometry, torch.device(device), path=KernelPath.TRITON)
        store.admit(0, _tokens(6, 0, device), _tokens(6, 1, device))
        store.admit(2, _tokens(3, 2, device), _tokens(3, 3, device))
        return store

    eager, graphed, warm = five_rows(), five_rows(), five_rows()
    _step_outputs(warm, device, [0, 2], 7, batch)  # compiles every kernel before the capture
    k = torch.zeros(_L, batch, _HKV, _D, dtype=torch.bfloat16, device=device)
    v, q = torch.zeros_like(k), torch.zeros(_L, batch, 2, _D, dtype=torch.bfloat16, device=device)
    out = torch.zeros_like(q)
    every = torch.arange(4, dtype=torch.int32, device=device).expand(batch, 4)

    def layers(step: tuple[int, ...]) -> None:
        for layer in range(_L):
            graphed.write_token(layer, step, k[layer], v[layer])
            blocks = torch.where(every < graphed.step_closed_blocks.unsqueeze(1), every, -1)
            out[layer] = graphed.attend(layer, step, q[layer], blocks)[0]

    graph = torch.cuda.CUDAGraph()
    for i, rows in enumerate([[0, 2], [2, 0], [0], [0, 2], [2], [0, 2]]):  # blocks close in both
        seed = 100 + 10 * i
        want = _step_outputs(eager, device, rows, seed, None)
        k[:, : len(rows)] = _tokens(len(rows), seed, device)
        v[:, : len(rows)] = _tokens(len(rows), seed + 1, device)
        q[:, : len(rows)] = _tokens(2 * len(rows), seed + 2, device).reshape(_L, len(rows), 2, _D)
        graphed.begin_step()
        step = graphed.advance(rows, pad_to=batch)
        if i == 0:
            with torch.cuda.graph(graph):
                layers(step)
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(_L):
            assert torch.equal(out[layer, : len(rows)], want[layer]), (i, layer)
    assert [graphed.length(r) for r in (0, 2)] == [eager.length(r) for r in (0, 2)] == [11, 8]
    assert torch.equal(graphed.host_arena[[0, 2], :, :2], eager.host_arena[[0, 2], :, :2])
    assert torch.equal(graphed.tail[:, [0, 2]], eager.tail[:, [0, 2]])


def test_compare_finds_every_byte_of_arena_and_tail_and_one_that_differs(
    kernel_device: str,
) -> None:
    """compare() checks closed blocks and tail against a resident copy, and sees one bad byte."""
    store = _store(kernel_device, 4)
    k, v = _tokens(9, 0, kernel_device), _tokens(9, 1, kernel_device)
    store.admit(0, k[:, :6], v[:, :6])
    for t in range(6, 9):  # three decode tokens: block 1 closes, block 2 opens
        store.append([0], k[:, t : t + 1], v[:, t : t + 1])
    result = store.compare(0, k, v)
    assert result.bytes_compared == 2 * 9 * _L * _HKV * _D * 2
    assert result.bytes_differing == 0
    store.wait_for_host_writes()
    if kernel_device != "cpu":
        torch.cuda.synchronize()
    store.host_arena[0, 1, 1, 0, 2, 0, 5] += 1  # one K element of token 6, layer 1
    assert store.compare(0, k, v).bytes_differing in (1, 2)  # one bf16 element: 1 or 2 bytes
    with pytest.raises(KernelInputError, match=r"k and v must be \(2, 9, 1, 16\)"):
        store.compare(0, k[:, :8], v[:, :8])


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


@pytest.mark.parametrize("path", [KernelPath.TRITON, KernelPath.REFERENCE])
def test_attend_tokens_reads_each_heads_own_tokens_from_hot_cache_and_tail(
    kernel_device: str, path: KernelPath
) -> None:
    """Per-head records, per-layer steps, rows out of order: each KV head attends exactly its
    chosen tokens."""
    hkv, d, hq = 2, 16, 4
    geometry = OffloadGeometry(_L, 4, 6, 8, hkv, d, torch.bfloat16, per_head=True)
    store = PerHeadOffloadedKV(geometry, torch.device(kernel_device), path=path)
    g = torch.Generator().manual_seed(5)
    history = {2: 13, 0: 6}  # row -> prompt tokens; 13 + 1 closes no block, 6 + 1 neither
    keys, values = {}, {}
    for row, n in history.items():
        keys[row] = torch.randn(_L, n, hkv, d, generator=g).bfloat16()
        values[row] = torch.randn(_L, n, hkv, d, generator=g).bfloat16()
        store.admit(row, keys[row].to(kernel_device), values[row].to(kernel_device))
    rows = [2, 0]
    for step in range(3):  # the first step fetches, later ones hit, the last one closes block 3
        store.begin_step()
        store.advance(rows)
        new_k = torch.randn(_L, 2, hkv, d, generator=g).bfloat16()
        new_v = torch.randn(_L, 2, hkv, d, generator=g).bfloat16()
        for b, row in enumerate(rows):
            keys[row] = torch.cat([keys[row], new_k[:, b : b + 1]], dim=1)
            values[row] = torch.cat([values[row], new_v[:, b : b + 1]], dim=1)
        for layer in range(_L):
            store.write_token(
                layer, rows, new_k[layer].to(kernel_device), new_v[layer].to(kernel_device)
            )
            q = torch.randn(2, hq, d, generator=g).bfloat16()
            # Head 0: a spread of closed tokens and the newest; head 1: a few, padded.
            positions = torch.full((2, hkv, 5), -1, dtype=torch.int32)
            for b, row in enumerate(rows):
                n = keys[row].shape[1]
                positions[b, 0] = torch.tensor([0, n // 2, n - 3, n - 2, n - 1])
                positions[b, 1, : 2 + step % 2] = torch.tensor([1, n - 1, 3])[: 2 + step % 2]
            blocks = store.token_blocks(rows, positions.to(kernel_device))
            out, lse = store.attend_tokens(
                layer, rows, q.to(kernel_device), positions.to(kernel_device), blocks
            )
            for b, row in enumerate(rows):
                for h in range(hkv):
                    chosen = positions[b, h][positions[b, h] >= 0].long()
                    k = keys[row][layer, chosen, h].float()  # [n, D]
                    v = values[row][layer, chosen, h].float()
                    heads = slice(h * hq // hkv, (h + 1) * hq // hkv)
                    scores = q[b, heads].float() @ k.T / d**0.5
                    want = torch.softmax(scores, dim=-1) @ v
                    torch.testing.assert_close(
                        out[b, heads].float().cpu(), want, atol=1e-2, rtol=1e-2
                    )
                    torch.testing.assert_close(
                        lse[b, heads].cpu(), torch.logsumexp(scores, dim=-1), atol=1e-3, rtol=1e-3
                    )


def test_token_blocks_refuses_more_blocks_than_a_hot_cache_holds() -> None:
    """A head whose tokens span more closed blocks than hot_slots is refused, naming both."""
    geometry = OffloadGeometry(1, 1, 2, 8, 1, 16, torch.bfloat16, per_head=True)
    store = PerHeadOffloadedKV(geometry, torch.device("cpu"))
    store.admit(0, torch.zeros(1, 20, 1, 16).bfloat16(), torch.zeros(1, 20, 1, 16).bfloat16())
    store.advance([0])
    two = torch.tensor([[[0, 1, 4, 5]]], dtype=torch.int32)  # 4 tokens of 2 blocks: they fit
    assert store.token_blocks([0], two).tolist() == [[[0, 1]]]
    positions = torch.tensor([[[0, 4, 8, 12]]], dtype=torch.int32)  # 4 blocks
    with pytest.raises(KernelInputError, match=r"needs 4 distinct blocks .*hot_slots=2"):
        store.token_blocks([0], positions)


def test_each_record_layout_has_its_own_store_and_refuses_the_other_geometry() -> None:
    """Token lists per head are the per-head store's, whole blocks and prefixes the all-head
    store's: neither class has the other's calls, and each refuses the other's geometry by its
    ``per_head`` value."""
    every_head = OffloadGeometry(1, 1, 2, 8, 2, 16, torch.bfloat16)
    per_head = OffloadGeometry(1, 1, 2, 8, 2, 16, torch.bfloat16, per_head=True)
    with pytest.raises(KernelInputError, match=r"per_head=True .*PerHeadOffloadedKV"):
        OffloadedKV(per_head, torch.device("cpu"))
    with pytest.raises(KernelInputError, match=r"per_head=False"):
        PerHeadOffloadedKV(every_head, torch.device("cpu"))
    for call in ("token_blocks", "attend_tokens"):
        assert not hasattr(OffloadedKV, call), call
    for call in ("attend", "export_prefix"):
        assert not hasattr(PerHeadOffloadedKV, call), call


def test_per_head_records_hold_each_heads_tokens_and_cost_the_same_bytes(
    kernel_device: str,
) -> None:
    """Per-head records: record layer l * Hkv + h holds head h of layer l, byte for byte, after
    a prompt and decode steps that close a block; the arena's bytes equal the all-heads store's."""
    hkv = 3
    shape = (_L, _ROWS, 4, 4, hkv, _D, torch.bfloat16)
    per_head = PerHeadOffloadedKV(
        OffloadGeometry(*shape, per_head=True), torch.device(kernel_device)
    )
    every_head = OffloadedKV(OffloadGeometry(*shape), torch.device(kernel_device))
    assert per_head.geometry.host_bytes == every_head.geometry.host_bytes
    assert per_head.geometry.record_shape == (2, 4, 1, _D)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(_L, 10, hkv, _D, generator=g).bfloat16().to(kernel_device)
    v = torch.randn(_L, 10, hkv, _D, generator=g).bfloat16().to(kernel_device)
    per_head.admit(1, k[:, :6], v[:, :6])
    for t in range(6, 10):  # block 1 closes at token 7
        per_head.append([1], k[:, t : t + 1], v[:, t : t + 1])
    result = per_head.compare(1, k, v)
    assert (result.bytes_compared, result.bytes_differing) == (2 * 10 * _L * hkv * _D * 2, 0)
    arena = per_head.host_arena[1].cpu()  # [L Hkv, NB, 2, 4, 1, D]
    for layer in range(_L):
        for head in range(hkv):
            want = k[layer, 4:8, head].cpu()
            assert torch.equal(arena[layer * hkv + head, 1, 0, :, 0], want)


def test_a_geometry_for_a_context_holds_its_open_last_block() -> None:
    """``for_context`` gives ``ceil(context / 4)`` arena blocks: 4,097 tokens need 1,025."""
    geometry = OffloadGeometry.for_context(
        layers=2,
        rows=3,
        context_len=4097,
        hot_slots=16,
        kv_heads=1,
        head_dim=64,
        dtype=torch.bfloat16,
    )
    assert (geometry.max_blocks, geometry.max_tokens) == (1025, 4100)
    assert not geometry.per_head


def test_a_geometry_for_an_empty_context_is_refused_naming_the_context() -> None:
    with pytest.raises(KernelInputError, match="context_len=0"):
        OffloadGeometry.for_context(
            layers=2,
            rows=3,
            context_len=0,
            hot_slots=16,
            kv_heads=1,
            head_dim=64,
            dtype=torch.bfloat16,
        )


@pytest.mark.parametrize(
    ("hot_blocks", "context_len", "slots"),
    [
        (None, 262_144, 2048),  # qsa-core's default: 4 x the top-k
        (None, 4_096, 1024),  # clipped to the context's blocks
        (None, 1_000, 512),  # never below one selection
        (4096, 262_144, 4096),
        (4096, 8_192, 2048),
    ],
)
def test_a_qsa_geometry_sizes_hot_caches_from_the_top_k_clipped_to_a_contexts_blocks(
    hot_blocks: int | None, context_len: int, slots: int
) -> None:
    """qsa-core's hot slots of the indexer's top-k (4 x by default), at most a context's blocks."""
    geometry = OffloadGeometry.for_block_topk(
        layers=2,
        rows=1,
        context_len=context_len,
        block_topk=512,
        hot_blocks=hot_blocks,
        kv_heads=1,
        head_dim=64,
        dtype=torch.bfloat16,
    )
    assert geometry.hot_slots == slots
    assert not geometry.per_head


def test_a_qsa_geometry_refuses_hot_caches_smaller_than_one_steps_selection() -> None:
    with pytest.raises(KernelInputError, match="hot_slots=100"):
        OffloadGeometry.for_block_topk(
            layers=2,
            rows=1,
            context_len=1 << 20,
            block_topk=512,
            hot_blocks=100,
            kv_heads=1,
            head_dim=64,
            dtype=torch.bfloat16,
        )


def test_a_per_head_geometry_caps_its_hot_cache_at_a_contexts_blocks() -> None:
    """Per-head records for double sparsity: hot caches of the blocks one step may read, but no
    more than the context holds (qsa-core's ``ds_offload_sizes``)."""

    def geometry(context_len: int) -> OffloadGeometry:
        return OffloadGeometry.per_head_for_context(
            layers=2,
            rows=1,
            context_len=context_len,
            hot_blocks=300,
            kv_heads=2,
            head_dim=64,
            dtype=torch.bfloat16,
        )

    wide, short = geometry(4096), geometry(40)
    assert wide.per_head
    assert (wide.hot_slots, wide.store_layers) == (300, 4)
    assert (short.hot_slots, short.max_blocks) == (10, 10)


def test_a_per_head_geometry_refuses_qsa_cores_refusal_as_its_own_error() -> None:
    """A size qsa-core refuses comes back as the package's input error, with qsa-core's text."""
    with pytest.raises(KernelInputError, match="hot_blocks=0"):
        OffloadGeometry.per_head_for_context(
            layers=2,
            rows=1,
            context_len=64,
            hot_blocks=0,
            kv_heads=2,
            head_dim=64,
            dtype=torch.bfloat16,
        )


def test_an_arena_larger_than_the_hosts_memory_is_refused_with_its_sizes() -> None:
    """The refusal names the arena's bytes and the product that makes them; unknown or enough
    memory passes."""
    geometry = OffloadGeometry(2, 3, 16, 100, 1, 64, torch.bfloat16)
    geometry.check_host_memory(None)
    geometry.check_host_memory(geometry.host_bytes)
    with pytest.raises(KernelInputError) as refused:
        geometry.check_host_memory(geometry.host_bytes - 1)
    text = str(refused.value)
    assert f"(3 rows x 2 record layers x 100 blocks x {geometry.record_bytes} B)" in text
    assert "available" in text


def test_a_pool_of_rows_contexts_is_no_shortfall() -> None:
    geometry = OffloadGeometry.for_context(
        layers=2, rows=4, context_len=1024, hot_slots=8, kv_heads=1, head_dim=64,
        dtype=torch.bfloat16, staged_prompts=2,
    )  # fmt: skip
    assert geometry.pool_shortfall(4 * 1024, 1024) is None
    assert geometry.pool_shortfall(5 * 1024 - 1, 1024) is None


@pytest.mark.parametrize("prompts", [1, 2])
def test_a_short_pool_names_its_tokens_fit_rows_and_the_staging_bytes(prompts: int) -> None:
    """One staged prompt too many is the advice only when more than one is staged."""
    geometry = OffloadGeometry.for_context(
        layers=2, rows=4, context_len=1024, hot_slots=8, kv_heads=1, head_dim=64,
        dtype=torch.bfloat16, staged_prompts=prompts,
    )  # fmt: skip
    message = geometry.pool_shortfall(1536, 1024)
    assert message is not None
    staging = geometry.sizes.staging_bytes
    assert staging > 0
    assert (
        "the K/V pool holds 1536 tokens, room for 1 request(s) of the 1024-token context at "
        f"once, against 4 request rows; the staging area takes {format_bytes(staging)} of the "
        f"GPU budget for {prompts} whole prompt(s)"
    ) in message
    advice = f"(--prefill-max-requests 1) would free {format_bytes(staging - staging // 2)}"
    assert (advice in message) is (prompts > 1)
    assert ("--prefill-max-requests" in message) is (prompts > 1)
