"""Model-shaped harness: the QSA decode path of every layer, offloaded against resident.

Each decode step appends one token to every request in every QSA layer, then, layer by layer,
scores the compressed index with the indexer, picks the top blocks, and attends. The resident path
keeps every token on the device and attends over ``expand_blocks`` of the selection (the blocks'
tokens plus the open group). The offloaded path (:class:`qsa_kernels.offload.OffloadedKV`) keeps
the history in the host arena, fetches the selected blocks that miss into the hot cache and merges
the attention over them with the attention over the open block. Both must select the same tokens
and give the same outputs; at the end the host arena must hold every closed block bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from qsa_kernels import KernelPath
from qsa_kernels.expand import expand_blocks
from qsa_kernels.indexer_topk import indexer_topk
from qsa_kernels.offload import OffloadedKV, OffloadGeometry
from qsa_kernels.sparse_decode import sparse_decode

_INDEX_HEADS = 4
_INDEX_DIM = 128
_BLOCKS_PER_PAGE = 16


@dataclass(frozen=True)
class Case:
    """One harness configuration (per rank)."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    topk: int
    hot_slots: int
    prompt_lens: tuple[int, ...]
    steps: int
    dtype: torch.dtype


# Qwen3.8-Flash-Next at TP2: 12 QSA layers, 12 query heads and 1 KV head of 256 per rank, top-512
# blocks, a 4x hot cache. Prompts: below the budget (every block selected), on a block boundary,
# and far above it (eviction at work); the steps cross block boundaries.
QWEN_TP2 = Case(12, 12, 1, 256, 512, 2048, (1_001, 8_192, 70_003), 6, torch.float8_e4m3fn)
# The same path at a size Triton's interpreter runs in seconds on a CPU.
SMALL = Case(2, 12, 1, 256, 4, 6, (9, 16, 45), 5, torch.bfloat16)


def _run(case: Case, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1234)
    rows = list(range(len(case.prompt_lens)))
    max_tokens = max(case.prompt_lens) + case.steps
    max_blocks = -(-max_tokens // 4)
    pages_per_row = -(-max_blocks // _BLOCKS_PER_PAGE)
    geometry = OffloadGeometry(
        layers=case.layers,
        rows=len(rows),
        hot_slots=case.hot_slots,
        max_blocks=max_blocks,
        kv_heads=case.kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
    )

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    # Compressed index keys of every block a row can reach, per layer, in pages of 16 blocks.
    index_keys = rand(case.layers, len(rows) * pages_per_row, _BLOCKS_PER_PAGE, _INDEX_DIM)
    index_keys = index_keys.bfloat16()
    page_table = (
        torch.arange(len(rows) * pages_per_row, dtype=torch.int32, device=device)
        .view(len(rows), pages_per_row)
        .contiguous()
    )
    # Resident K/V: every token of every row, one record per block.
    resident = torch.zeros(
        (case.layers, len(rows) * max_blocks, 2, 4, case.kv_heads, case.head_dim),
        dtype=case.dtype,
        device=device,
    )
    store = OffloadedKV(geometry, device, path=KernelPath.TRITON)
    lengths = list(case.prompt_lens)

    def write_resident(row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        tokens = torch.arange(start, start + k.shape[1], device=device)
        records = resident.view(case.layers, -1, case.kv_heads, case.head_dim)
        # token t of row r sits in record r*NB + t//4, half 0 (K) or 1 (V), row t%4
        base = (row * max_blocks + tokens // 4) * 8 + tokens % 4
        records[:, base] = k
        records[:, base + 4] = v

    for row, length in zip(rows, case.prompt_lens, strict=True):
        k = rand(case.layers, length, case.kv_heads, case.head_dim).to(case.dtype)
        v = rand(case.layers, length, case.kv_heads, case.head_dim).to(case.dtype)
        write_resident(row, 0, k, v)
        store.admit(row, k, v)

    for _ in range(case.steps):
        k_new = rand(case.layers, len(rows), case.kv_heads, case.head_dim).to(case.dtype)
        v_new = rand(case.layers, len(rows), case.kv_heads, case.head_dim).to(case.dtype)
        for b, row in enumerate(rows):
            write_resident(row, lengths[row], k_new[:, b : b + 1], v_new[:, b : b + 1])
            lengths[row] += 1
        store.append(rows, k_new, v_new)
        assert [store.length(r) for r in rows] == lengths
        store.begin_step()
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        for layer in range(case.layers):
            index_q = rand(len(rows), _INDEX_HEADS, _INDEX_DIM).bfloat16()
            blocks = indexer_topk(index_q, index_keys[layer], page_table, seq_lens, topk=case.topk)
            q = rand(len(rows), case.q_heads, case.head_dim).bfloat16()

            positions = expand_blocks(blocks, seq_lens, token_topk=4 * case.topk)
            row_base = torch.tensor(rows, dtype=torch.int32, device=device) * max_blocks * 4
            resident_slots = torch.where(positions >= 0, row_base.unsqueeze(-1) + positions, -1).to(
                torch.int32
            )
            want_out, want_lse = sparse_decode(q, resident_slots, resident[layer])
            got_out, got_lse = store.attend(layer, rows, q, blocks)

            # The same tokens: every complete selected block plus the open group of each row.
            expected_count = (blocks >= 0).sum(-1) * 4 + seq_lens % 4
            assert torch.equal((positions >= 0).sum(-1), expected_count)
            torch.testing.assert_close(got_lse, want_lse, atol=2e-3, rtol=1e-4)
            torch.testing.assert_close(got_out, want_out, atol=2e-2, rtol=2e-2)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    host = store.host_arena
    for row in rows:
        closed = lengths[row] // 4
        want = resident[:, row * max_blocks : row * max_blocks + closed].cpu()
        got = host[row, :, :closed]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"row {row}"


def test_offloaded_decode_matches_resident_on_cpu_interpreter(interpreter_device: str) -> None:
    """Small geometry under Triton's interpreter: same outputs, arena holds every closed block."""
    _run(SMALL, torch.device(interpreter_device))


@pytest.mark.gpu
def test_offloaded_decode_matches_resident_at_qwen38_shapes() -> None:
    """All 12 QSA layers at TP2 shapes, FP8 K/V, 70K-token request: offloaded equals resident."""
    _run(QWEN_TP2, torch.device("cuda"))
