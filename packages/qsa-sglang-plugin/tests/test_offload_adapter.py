"""SGLang's ``ForwardBatch`` translated into the offload runtime's calls.

The offload backend stages an extend batch's chunk (``stage_chunk``) and plans a decode step
(``plan_decode``) from real SGLang ``ForwardBatch`` objects, including the CUDA graph runner's
padded view of one (``num_padding`` rows at the end), and the prefill graph runner's dummy
requests. The runtime itself is ``qsa_kernels.offload.OffloadRuntime`` (its own tests are in
qsa-kernels).
"""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import KernelPath
from qsa_kernels.context import PrefillKernels
from qsa_kernels.offload import (
    ChunkSpan,
    OffloadedKV,
    OffloadGeometry,
    OffloadRuntime,
    OffloadStateError,
    RowState,
)
from qsa_sglang_plugin._adapters._offload import (
    extend_layer,
    extend_spans,
    plan_decode,
    stage_chunk,
)
from qsa_sglang_plugin._errors import OffloadRuntimeError
from qsa_testing import decode_batch, extend_batch

LAYER_IDS = {3: 0, 7: 1}  # SGLang layer id -> QSA ordinal
SLOTS, ROWS, D = (5, 9), (0, 1), 64


def _runtime() -> OffloadRuntime:
    geometry = OffloadGeometry(len(LAYER_IDS), 4, 16, 64, 1, D, torch.bfloat16)
    kv = OffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
    runtime = OffloadRuntime(kv, LAYER_IDS, 16)
    for slot, row in zip(SLOTS, ROWS, strict=True):
        assert runtime.admit(f"r{slot}", slot).slot == row
    return runtime


def _stage_prompt(runtime: OffloadRuntime, slot: int, chunks: list[int]) -> int:
    start = 0
    for size in chunks:
        batch = extend_batch([(slot, start, start + size)])
        for layer_id in LAYER_IDS:
            k = torch.full((size, D), float(layer_id), dtype=torch.bfloat16)
            staged_k, _, prefix = stage_chunk(runtime, layer_id, k, k, batch)
            assert (prefix, staged_k.shape[0]) == (start, start + size)
        start += size
    return start


def test_a_chunk_stages_at_the_batchs_prefix_length() -> None:
    runtime = _runtime()
    assert _stage_prompt(runtime, SLOTS[0], [24, 9]) == 33
    assert runtime.staged == {ROWS[0]: 33}
    k_layers, _ = runtime.staged_layers(ROWS[0], 33)
    assert [int(k[32, 0, 0]) for k in k_layers] == list(LAYER_IDS)


def test_one_prompt_staging_refuses_an_extend_batch_of_two_before_anything_is_staged() -> None:
    """DS-Offload and a context-parallel prefill stage one prompt at a time."""
    runtime = _runtime()
    batch = extend_batch([(SLOTS[0], 0, 8), (SLOTS[1], 0, 8)])
    k = torch.zeros(16, D, dtype=torch.bfloat16)
    with pytest.raises(OffloadRuntimeError, match=r"an extend batch of 2 requests.*=1"):
        stage_chunk(runtime, 3, k, k, batch)
    assert runtime.staged == {}


def test_an_extend_batch_is_read_as_each_requests_chunk_and_rows() -> None:
    """A request continuing its prompt and one starting: each chunk's span and its rows of the
    batch's token rows."""
    batch = extend_batch([(SLOTS[0], 24, 33), (SLOTS[1], 0, 13)])
    assert extend_spans(batch) == [
        ChunkSpan(SLOTS[0], 24, 33, slice(0, 9)),
        ChunkSpan(SLOTS[1], 0, 13, slice(9, 22)),
    ]


def test_a_padded_graph_step_plans_the_real_rows_and_pads_with_free_ones() -> None:
    runtime = _runtime()
    first = _stage_prompt(runtime, SLOTS[0], [20])
    second = _stage_prompt(runtime, SLOTS[1], [13])  # hands the first prompt off
    batch = decode_batch([*SLOTS, 0, 0], [first + 1, second + 1, 1, 1])
    batch.num_padding = 2
    plan_decode(runtime, batch, graph=True)
    assert [runtime.kv.state(r) for r in ROWS] == [RowState.ACTIVE, RowState.ACTIVE]
    assert [runtime.kv.length(r) for r in ROWS] == [first + 1, second + 1]
    assert runtime.kv.step_row_ids.numel() == 4  # two real rows, two free ones
    assert runtime.counts.decode_steps == 1


def test_a_captured_step_is_all_padding_and_not_counted() -> None:
    runtime = _runtime()
    batch = decode_batch([0, 0, 0], [1, 1, 1])
    plan_decode(runtime, batch, capture=True)
    assert runtime.kv.step_row_ids.numel() == 3
    assert runtime.counts.decode_steps == 0
    assert [runtime.kv.state(r) for r in ROWS] == [RowState.FREE, RowState.FREE]


def test_prefill_graph_capture_stages_nothing_and_its_dummy_rows_attend_to_zeros() -> None:
    """SGLang's prefill graph runner warms up and captures over requests ``arange(bs)`` that hold
    no host-arena row (SGLang's own flag says so); outside the capture those slots are refused."""
    from sglang.srt.runtime_context import get_flags

    runtime, flags = _runtime(), get_flags().dp
    dummy = extend_batch([(0, 0, 8), (1, 0, 8)])  # slots 0 and 1 hold no lease
    q = torch.ones(16, 2, D, dtype=torch.bfloat16)
    k = torch.ones(16, D, dtype=torch.bfloat16)
    indices = torch.zeros(16, 4, dtype=torch.int32)

    def attend(batch: object) -> torch.Tensor:
        kernels = PrefillKernels.reference()
        return extend_layer(runtime, 3, q, k, k, indices, batch, scale=1.0, kernels=kernels)

    flags.capturing_prefill_graph = True
    try:
        out = attend(dummy)
    finally:
        flags.capturing_prefill_graph = False
    assert (out.shape, out.dtype, int(out.count_nonzero())) == (q.shape, q.dtype, 0)
    assert runtime.staged == {}
    with pytest.raises(OffloadStateError, match="slot 0 prefills but holds no lease"):
        attend(dummy)
    real = attend(extend_batch([(SLOTS[0], 0, 16)]))  # a leased request stages its chunk
    assert runtime.staged == {ROWS[0]: 16}
    assert real.shape == q.shape
