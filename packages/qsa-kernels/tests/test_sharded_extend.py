"""``ShardedKVStore.extend`` under context parallelism, on one rank: which path a batch takes.

The owner-side and no-prefix paths themselves are pinned on gloo ranks (``test_sharded.py``, and
``qsa-sglang-plugin``'s ``test_sharded_kv.py`` / ``test_cp_prefill.py``); here a recording
exchange shows the decision: one whole prompt attends by its zigzag rows without an exchange,
any other batch is gathered into token order, attended, and scattered back.
"""

from __future__ import annotations

import torch

from qsa_core import QWEN38_FLASH_NEXT, ShardPlacement
from qsa_kernels import KernelPath
from qsa_kernels.context import PrefillKernels, ZigzagEntries
from qsa_kernels.sharded import HeadLayout, ShardedKVStore, ShardGroup

HQ, D, TOPK = 4, 64, 16
SCALE = D**-0.5


class _Recording:
    """An exchange of one rank: every row is this rank's; the calls are recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls.append("gather")
        return rows

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls.append("scatter")
        return rows


def _store() -> ShardedKVStore:
    shard = ShardGroup(ShardPlacement(1, QWEN38_FLASH_NEXT.blocks_per_page, 4), 0)
    return ShardedKVStore(
        shard, {3: 0}, slots=256, kv_heads=1, head_dim=D, dtype=torch.bfloat16, q_heads=HQ,
        block_topk=TOPK, max_rows=2, device=torch.device("cpu"), path=KernelPath.REFERENCE,
        head_layout=HeadLayout.REPLICATED,
    )  # fmt: skip


def _extend(
    lens: list[int], exchange: _Recording | None, zigzag: ZigzagEntries | None = None
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(lens))
    tokens = sum(lens)
    q = torch.randn((tokens, HQ * D), generator=gen).to(torch.bfloat16)
    k = torch.randn((tokens, D), generator=gen).to(torch.bfloat16)
    v = torch.randn((tokens, D), generator=gen).to(torch.bfloat16)
    picks = torch.full((tokens, 4 * TOPK + 3), -1)
    for row, p in enumerate(p for n in lens for p in range(n)):
        chosen = torch.randperm(p + 1, generator=gen)[:8]
        picks[row, : chosen.numel()] = chosen
    return _store().extend(
        3, q, k, v, picks, slots=torch.arange(tokens), extend_lens=lens, seq_lens=lens,
        slot_table=torch.arange(256)[None].expand(len(lens), -1),
        table_rows=torch.arange(len(lens)), scale=SCALE, kernels=PrefillKernels.reference(),
        exchange=exchange, zigzag=zigzag,
    )  # fmt: skip


def test_a_context_parallel_batch_of_two_requests_is_gathered_attended_and_scattered() -> None:
    exchange = _Recording()
    got = _extend([6, 5], exchange, zigzag=None)
    assert exchange.calls == ["gather", "gather", "scatter"]  # q, indices, then the output
    assert torch.equal(got, _extend([6, 5], None))


def test_one_whole_prompt_attends_by_its_zigzag_rows_without_an_exchange() -> None:
    """One rank's zigzag blocks of an 8-token prompt are its two halves: the whole chunk."""
    zigzag = ZigzagEntries(torch.tensor([0, 4, 8]).int(), torch.tensor([4, 8]).int(), 4)
    exchange = _Recording()
    got = _extend([8], exchange, zigzag)
    assert exchange.calls == []
    assert torch.allclose(got.float(), _extend([8], None).float(), atol=2e-2)
