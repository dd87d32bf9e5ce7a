"""``qsa_kernels.context.attend_context`` on the GPU with upstream's kernels: CUDA against CPU.

The offload backend attends a prefill chunk over its staging area with upstream's chunk-prefill
Triton kernel, one entry for a plain chunk after a prefix, and with context-parallel prefill one
entry per zigzag block of this rank (``cu_q`` from SGLang's zigzag metadata, each block ending at
its absolute position, every entry based at the request's row 0). On the CPU both go through
upstream's per-row torch reference, which the CP gloo test (``test_cp_prefill.py``) runs; this
test checks the kernel's entries against that reference on the GPU, for every rank of 2 and 4 CP
ranks, with and without a prefix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qsa_testing import Platform, current_platform, extend_batch, random_block_selection

pytestmark = [
    pytest.mark.skipif(
        current_platform() is not Platform.CUDA or not torch.cuda.is_available(),
        reason="upstream's CUDA prefill kernel; the CPU path runs in test_cp_prefill.py",
    ),
    # Importing SGLang's QSA backend in this process compiles a MoE runner whose torch import
    # warns (an engine imports it in its own processes).
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

HQ, HKV, D = 16, 2, 128
TOPK = 64
SCALE = D**-0.5
#: The kernel multiplies bf16 probabilities by V (2^-8 relative) where the reference keeps them
#: fp32; with values of |V| up to 4 that is 1.6e-2 (5.9e-3 measured on rows that attend a few
#: tokens). A row attending another zigzag block's keys is off by O(1).
ATOL = 1.6e-2
SEED = 20261203


def _selection(start: int, end: int, gen: torch.Generator) -> torch.Tensor:
    """``[end - start, 4 TOPK + 3]`` the indexer's prefill token positions of rows ``[start,
    end)``: random complete blocks, then each row's open block."""
    _, positions = random_block_selection(torch.arange(start, end) + 1, TOPK, gen)
    return positions


def _zigzag(world: int, rank: int, prefix: int, size: int) -> tuple[Any, Any]:
    """SGLang's zigzag strategy and metadata of ``rank`` for one request's chunk."""
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

    end = prefix + size
    strategy = ZigzagCPStrategy(cp_size=world)
    batch = extend_batch([(0, prefix, end)])
    batch.attn_cp_metadata = strategy.build_metadata(size, [end], [size])
    return strategy, batch


@pytest.mark.parametrize("prefix", [0, 1000])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_kernel_attends_each_ranks_zigzag_rows_as_the_reference(
    world: int, prefix: int
) -> None:
    """Every rank's rows (the whole chunk at one rank, no CP metadata) equal the CPU reference
    within the kernel's bf16 precision."""
    from sglang.srt.runtime_context import get_parallel

    from qsa_kernels.context import attend_context
    from qsa_sglang_plugin._adapters._qsa_common import prefill_kernels, zigzag_entries

    size = 777
    gen = torch.Generator().manual_seed(SEED + world + prefix)
    end = prefix + size
    k = torch.randn((end, HKV, D), generator=gen).to(torch.bfloat16)
    v = torch.randn((end, HKV, D), generator=gen).to(torch.bfloat16)
    q = torch.randn((size, HQ, D), generator=gen).to(torch.bfloat16)
    picks = _selection(prefix, end, gen)
    cuda = torch.device("cuda")
    kernels = prefill_kernels()
    for rank in range(world):
        if world == 1:
            rows_q, rows_picks, meta = q, picks, None
        else:
            with get_parallel().override(attn_cp_size=world, attn_cp_rank=rank):
                strategy, batch = _zigzag(world, rank, prefix, size)
            meta = batch.attn_cp_metadata
            rows_q = strategy.shard_hidden_states(q, batch)
            rows_picks = strategy.shard_hidden_states(picks, batch)
        want = attend_context(rows_q, k, v, rows_picks, SCALE, kernels)
        zigzag = None if meta is None else zigzag_entries(meta)
        got = attend_context(
            rows_q.to(cuda),
            k.to(cuda),
            v.to(cuda),
            rows_picks.to(cuda),
            SCALE,
            kernels,
            zigzag=zigzag,
        )
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2**-7, atol=ATOL)
