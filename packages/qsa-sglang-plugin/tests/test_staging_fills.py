"""A restored prefix's copies into the offload's staging area, waited for layer by layer.

The host prefix cache restores each QSA layer's K/V by copies of its own
(``PrefixCacheRuntime.restore_row``); the offload runtime orders the current stream after a
layer's copies only where that layer's staged K/V is first read, so the copies overlap the layers
before it. The fences here record the waits asked of them (on CPU a restore's copies are done on
return; the ordering itself is CUDA stream work, exercised by the GPU engine tests).
"""

from __future__ import annotations

import torch

from qsa_kernels import KernelPath
from qsa_kernels.offload import OffloadedKV, OffloadGeometry
from qsa_sglang_plugin._adapters._offload import OffloadRuntime
from qsa_testing import decode_batch, extend_batch

LAYER_IDS = {3: 0, 7: 1}  # SGLang layer id -> QSA ordinal
SLOT, ROW, PREFIX, CHUNK, D = 5, 0, 64, 32, 64


class RecordingFence:
    """A fence that counts the stream waits asked of it."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def _runtime() -> OffloadRuntime:
    geometry = OffloadGeometry(len(LAYER_IDS), 2, 16, 64, 1, D, torch.bfloat16)
    kv = OffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
    runtime = OffloadRuntime(kv, LAYER_IDS, 16, 0)
    runtime.bind(SLOT, ROW)
    return runtime


def _restore(runtime: OffloadRuntime) -> dict[int, RecordingFence]:
    """Stage a ``PREFIX``-token prefix as a restore does: views filled, one fence per layer."""
    k_layers, v_layers = runtime.stage_prefix(ROW, PREFIX)
    fences = {}
    for ordinal, (k, v) in enumerate(zip(k_layers, v_layers, strict=True)):
        k.fill_(ordinal + 1)
        v.fill_(-(ordinal + 1))
        fences[ordinal] = RecordingFence()
        runtime.fill_staging_until(ordinal, fences[ordinal])
    return fences


def test_a_layers_prefill_waits_for_its_own_restore_copies_only() -> None:
    runtime = _runtime()
    fences = _restore(runtime)
    batch = extend_batch([(SLOT, PREFIX, PREFIX + CHUNK)])
    new = torch.zeros(CHUNK, D, dtype=torch.bfloat16)
    k, v, prefix = runtime.stage(3, new, new, batch)
    assert (fences[0].waits, fences[1].waits) == (1, 0)
    assert prefix == PREFIX
    assert bool(k[:PREFIX].eq(1).all())
    assert bool(v[:PREFIX].eq(-1).all())
    runtime.stage(7, new, new, batch)
    runtime.stage(3, new, new, batch)  # a layer's copies are waited for once
    assert (fences[0].waits, fences[1].waits) == (1, 1)


def test_the_hand_off_waits_for_every_layers_restore_copies() -> None:
    runtime = _runtime()
    fences = _restore(runtime)
    runtime.begin_decode(decode_batch([SLOT], [PREFIX + 1]))
    assert [f.waits for f in fences.values()] == [1, 1]
    assert runtime.kv.length(ROW) == PREFIX + 1  # the prefix and the step's new token


def test_a_checkpoint_of_the_staged_prefix_reads_it_after_every_restore_copy() -> None:
    runtime = _runtime()
    fences = _restore(runtime)
    k_layers, _ = runtime.staged_layers(ROW, PREFIX)
    assert [f.waits for f in fences.values()] == [1, 1]
    assert [int(k[0, 0, 0]) for k in k_layers] == [1, 2]
