"""The request offload runtime: request leases and their rows, one prompt's staging, the step.

The runtime is driven here as an engine's attention backend drives it, with the store on the
torch reference path (CPU). A restored prefix's copies are stood for by fences that record the
waits asked of them (on CPU a restore's copies are done on return; the ordering itself is CUDA
stream work, exercised by the GPU engine tests).
"""

from __future__ import annotations

import pytest
import torch

from qsa_core import LeaseError, LeaseHandle, LeaseState, LeaseTable
from qsa_kernels import KernelPath
from qsa_kernels.offload import (
    LOG_EVERY_STEPS,
    OffloadCounts,
    OffloadedKV,
    OffloadGeometry,
    OffloadRuntime,
    OffloadStateError,
    PerHeadOffloadedKV,
    RowState,
)

LAYER_IDS = {3: 0, 7: 1}  # the engine's layer id -> offloaded ordinal
SLOT, ROW, PREFIX, CHUNK, D, TOPK = 5, 0, 64, 32, 64, 16
SCALE = D**-0.5


class RecordingFence:
    """A fence that counts the stream waits asked of it."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def _runtime(
    *, verify: bool = False, seen: list[OffloadCounts] | None = None, max_blocks: int = 64
) -> OffloadRuntime:
    geometry = OffloadGeometry(len(LAYER_IDS), 2, TOPK, max_blocks, 1, D, torch.bfloat16)
    kv = OffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
    runtime = OffloadRuntime(
        kv, LAYER_IDS, TOPK, verify=verify, on_counts=None if seen is None else seen.append
    )
    assert runtime.admit("r0", SLOT).slot == ROW
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


def _prefill(runtime: OffloadRuntime, kv: torch.Tensor, chunks: list[int]) -> int:
    """Stage ``kv[side, ordinal, token]``'s prompt chunk by chunk; its length."""
    start = 0
    for size in chunks:
        for layer_id, ordinal in LAYER_IDS.items():
            k, v = kv[0, ordinal, start : start + size], kv[1, ordinal, start : start + size]
            runtime.stage(layer_id, k, v, slot=SLOT, start=start, end=start + size)
        start += size
    return start


# ---- staging and a restored prefix ---------------------------------------------------------------


def test_a_layers_prefill_waits_for_its_own_restore_copies_only() -> None:
    runtime = _runtime()
    fences = _restore(runtime)
    new = torch.zeros(CHUNK, D, dtype=torch.bfloat16)
    k, v = runtime.stage(3, new, new, slot=SLOT, start=PREFIX, end=PREFIX + CHUNK)
    assert (fences[0].waits, fences[1].waits) == (1, 0)
    assert k.shape == (PREFIX + CHUNK, 1, D)
    assert bool(k[:PREFIX].eq(1).all())
    assert bool(v[:PREFIX].eq(-1).all())
    assert bool(k[PREFIX:].eq(0).all())
    runtime.stage(7, new, new, slot=SLOT, start=PREFIX, end=PREFIX + CHUNK)
    runtime.stage(3, new, new, slot=SLOT, start=PREFIX, end=PREFIX + CHUNK)  # waited for once
    assert (fences[0].waits, fences[1].waits) == (1, 1)


def test_the_hand_off_waits_for_every_layers_restore_copies() -> None:
    runtime = _runtime()
    fences = _restore(runtime)
    runtime.plan_decode([SLOT], [PREFIX + 1])
    assert [f.waits for f in fences.values()] == [1, 1]
    assert runtime.kv.length(ROW) == PREFIX + 1  # the prefix and the step's new token
    assert runtime.staged == {}


def test_a_checkpoint_of_the_staged_prefix_reads_it_after_every_restore_copy() -> None:
    runtime = _runtime()
    fences = _restore(runtime)
    k_layers, _ = runtime.staged_layers(ROW, PREFIX)
    assert [f.waits for f in fences.values()] == [1, 1]
    assert [int(k[0, 0, 0]) for k in k_layers] == [1, 2]


def test_the_next_prompt_waits_for_copies_still_reading_the_staged_one() -> None:
    runtime = _runtime()
    runtime.admit("r1", SLOT + 1)
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    reader = RecordingFence()
    runtime.keep_staging_until(reader)
    new = torch.zeros(CHUNK, D, dtype=torch.bfloat16)
    runtime.stage(3, new, new, slot=SLOT + 1, start=0, end=CHUNK)
    assert reader.waits == 1
    assert runtime.kv.state(ROW) is RowState.ACTIVE  # the waiting prompt was handed off first
    assert runtime.kv.length(ROW) == PREFIX
    assert list(runtime.staged) == [ROW + 1]


# ---- prefill, hand-off and decode equal the store driven directly --------------------------------


def test_a_staged_prompt_decodes_as_the_store_admitting_it_whole() -> None:
    """Two chunks staged, handed off at the first planned step, three decode steps: each layer's
    output equals the store's own attention over the same prompt, bit for bit."""
    gen = torch.Generator().manual_seed(20261204)
    steps, prompt = 3, PREFIX + CHUNK + 3
    kv = torch.randn((2, len(LAYER_IDS), prompt + steps, 1, D), generator=gen).to(torch.bfloat16)
    runtime = _runtime(verify=True)
    assert _prefill(runtime, kv, [PREFIX, CHUNK + 3]) == prompt
    direct = OffloadedKV(runtime.kv.geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
    direct.admit(ROW, kv[0, :, :prompt], kv[1, :, :prompt])
    for step in range(steps):
        length = prompt + step
        runtime.plan_decode([SLOT], [length + 1])
        direct.advance([ROW])
        direct.begin_step()
        for layer_id, ordinal in LAYER_IDS.items():
            q = torch.randn((1, 4 * D), generator=gen).to(torch.bfloat16)
            k_new, v_new = kv[0, ordinal, length : length + 1], kv[1, ordinal, length : length + 1]
            picks = torch.randperm((length + 1) // 4, generator=gen)[:TOPK].to(torch.int32)
            blocks = torch.full((1, TOPK), -1, dtype=torch.int32)
            blocks[0, : picks.numel()] = picks
            got = runtime.decode_layer(layer_id, q, k_new, v_new, blocks, SCALE)
            direct.write_token(ordinal, [ROW], k_new, v_new)
            want, _ = direct.attend(ordinal, [ROW], q.view(1, 4, D), blocks, scale=SCALE)
            assert torch.equal(got, want.reshape(1, -1).to(got.dtype)), (step, layer_id)
    runtime.release(_lease(runtime))
    counts = runtime.counts
    assert counts.verified_bytes > 0
    assert counts.differing_bytes == 0
    assert counts.decode_steps == steps
    assert counts.selected_blocks > 0


# ---- several prompts staged at once --------------------------------------------------------------


def _stage_whole(
    runtime: OffloadRuntime, slot: int, kv: torch.Tensor, start: int, end: int
) -> None:
    """Stage tokens ``[start, end)`` of ``kv[side, ordinal, token]``'s prompt for ``slot``."""
    for layer_id, ordinal in LAYER_IDS.items():
        runtime.stage(
            layer_id, kv[0, ordinal, start:end], kv[1, ordinal, start:end], slot=slot, start=start,
            end=end,
        )  # fmt: skip


def _two_area_runtime() -> tuple[OffloadRuntime, list[LeaseHandle]]:
    """Two staging areas, three rows, requests at engine slots 5, 6 and 7 (rows 0, 1, 2)."""
    geometry = OffloadGeometry(len(LAYER_IDS), 3, TOPK, 64, 1, D, torch.bfloat16, staged_prompts=2)
    kv = OffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
    runtime = OffloadRuntime(kv, LAYER_IDS, TOPK)
    return runtime, [runtime.admit(f"r{i}", 5 + i) for i in range(3)]


def test_two_prompts_of_one_prefill_batch_stage_side_by_side_and_each_row_gets_its_own() -> None:
    """A prompt half staged and another staged whole in the same batch, then the first one's
    second chunk: each keeps its own area, and each row's host arena and tail hold exactly its
    prompt once both start decoding."""
    runtime, (a, b, _) = _two_area_runtime()
    kv_a = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    kv_b = torch.randn((2, len(LAYER_IDS), CHUNK + 3, 1, D)).to(torch.bfloat16)
    _stage_whole(runtime, 5, kv_a, 0, CHUNK)
    _stage_whole(runtime, 6, kv_b, 0, CHUNK + 3)
    runtime.prompt_written(b, CHUNK + 3, CHUNK + 3)
    runtime.prompt_written(a, CHUNK, PREFIX)
    assert runtime.staged == {a.slot: CHUNK, b.slot: CHUNK + 3}
    k, _v = runtime.stage(
        3, kv_a[0, 0, CHUNK:], kv_a[1, 0, CHUNK:], slot=5, start=CHUNK, end=PREFIX
    )
    assert torch.equal(k, kv_a[0, 0])  # the first chunk is still there, beside the other prompt
    runtime.stage(7, kv_a[0, 1, CHUNK:], kv_a[1, 1, CHUNK:], slot=5, start=CHUNK, end=PREFIX)
    runtime.plan_decode([5, 6], [PREFIX + 1, CHUNK + 4])
    assert runtime.staged == {}
    steps = torch.randn((2, len(LAYER_IDS), 2, 1, D)).to(torch.bfloat16)  # each row's new token
    for layer_id, ordinal in LAYER_IDS.items():
        q = torch.randn((2, 4 * D)).to(torch.bfloat16)
        none = torch.full((2, TOPK), -1, dtype=torch.int32)
        runtime.decode_layer(layer_id, q, steps[0, ordinal], steps[1, ordinal], none, SCALE)
    for i, (handle, kv) in enumerate(((a, kv_a), (b, kv_b))):
        whole = torch.cat([kv, steps[:, :, i : i + 1]], dim=2)
        assert runtime.kv.length(handle.slot) == whole.shape[2]
        held = runtime.kv.compare(handle.slot, whole[0], whole[1])
        assert (held.bytes_differing, held.bytes_compared) == (0, whole.numel() * 2), handle


def test_a_third_prompt_takes_the_area_of_a_prompt_staged_whole_which_is_handed_off() -> None:
    runtime, (a, b, c) = _two_area_runtime()
    kv = torch.randn((2, len(LAYER_IDS), CHUNK, 1, D)).to(torch.bfloat16)
    _stage_whole(runtime, 5, kv, 0, CHUNK)
    _stage_whole(runtime, 6, kv, 0, CHUNK)
    runtime.prompt_written(a, CHUNK, PREFIX)  # half of a
    runtime.prompt_written(b, CHUNK, CHUNK)  # all of b
    _stage_whole(runtime, 7, kv, 0, CHUNK)
    assert runtime.staged == {a.slot: CHUNK, c.slot: CHUNK}
    assert runtime.counts.staged_peak == 2
    assert runtime.leases.state(b) is LeaseState.HOST_READY  # handed off (CPU: at once)
    assert runtime.kv.length(b.slot) == CHUNK


def test_a_prompt_of_known_length_is_whole_once_its_last_layer_stages_it() -> None:
    """Told each prompt's length at admission, the runtime knows from the forward itself that a
    prompt is staged whole, as an overlapped engine needs: its next batch's prompt claims an area
    before the engine's ``prompt_written`` of the batch before. Not before the last layer: a
    prompt whose later layers are still to be staged is never handed off."""
    geometry = OffloadGeometry(len(LAYER_IDS), 3, TOPK, 64, 1, D, torch.bfloat16, staged_prompts=2)
    runtime = OffloadRuntime(
        OffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE), LAYER_IDS, TOPK
    )
    a, b, c = (runtime.admit(f"r{i}", 5 + i, prompt_tokens=CHUNK) for i in range(3))
    kv = torch.randn((2, len(LAYER_IDS), CHUNK, 1, D)).to(torch.bfloat16)
    for slot in (5, 6):  # a's and b's first layer only
        runtime.stage(3, kv[0, 0], kv[1, 0], slot=slot, start=0, end=CHUNK)
    with pytest.raises(OffloadStateError, match=r"row 2 needs a staging area"):
        runtime.stage(3, kv[0, 0], kv[1, 0], slot=7, start=0, end=CHUNK)
    runtime.stage(7, kv[0, 1], kv[1, 1], slot=6, start=0, end=CHUNK)  # b's last layer
    _stage_whole(runtime, 7, kv, 0, CHUNK)  # b, never prompt_written, is handed off
    assert runtime.leases.state(a) is LeaseState.PREFILLING  # the older prompt, not whole, stays
    assert runtime.staged == {a.slot: CHUNK, c.slot: CHUNK}
    assert runtime.leases.state(b) is LeaseState.HOST_READY
    assert runtime.kv.length(b.slot) == CHUNK


def test_the_hand_off_reader_sees_each_prompt_still_staged_before_it_leaves() -> None:
    """The engine's checkpoint of a prompt's end runs as the prompt is handed off, by the step
    that first decodes it or by the prefill that needs its area, and reads the staged K/V."""
    runtime, (a, b, c) = _two_area_runtime()
    read: list[tuple[int, int, bool]] = []

    def reader(handle: LeaseHandle, tokens: int) -> None:
        k_layers, _ = runtime.staged_layers(handle.slot, tokens)
        same = all(torch.equal(k, kv[0, i]) for i, k in enumerate(k_layers))
        read.append((handle.slot, tokens, same))

    runtime.read_before_hand_off(reader)
    kv = torch.randn((2, len(LAYER_IDS), CHUNK, 1, D)).to(torch.bfloat16)
    for handle, slot in ((a, 5), (b, 6)):
        _stage_whole(runtime, slot, kv, 0, CHUNK)
        runtime.prompt_written(handle, CHUNK, CHUNK)
    _stage_whole(runtime, 7, kv, 0, CHUNK)  # c takes an area: a, the oldest, goes
    runtime.plan_decode([6], [CHUNK + 1])  # b's first decode step
    assert read == [(a.slot, CHUNK, True), (b.slot, CHUNK, True)]
    assert runtime.staged == {c.slot: CHUNK}


def test_a_prompt_finding_every_area_still_prefilling_is_refused_and_nothing_moves() -> None:
    runtime, (a, b, c) = _two_area_runtime()
    kv = torch.randn((2, len(LAYER_IDS), CHUNK, 1, D)).to(torch.bfloat16)
    _stage_whole(runtime, 5, kv, 0, CHUNK)
    _stage_whole(runtime, 6, kv, 0, CHUNK)
    with pytest.raises(
        OffloadStateError, match=r"row 2 needs a staging area, but all 2 hold prompts still "
        r"prefilling \(row -> tokens: \{0: 32, 1: 32\}\)"
    ):  # fmt: skip
        _stage_whole(runtime, 7, kv, 0, CHUNK)
    assert runtime.staged == {a.slot: CHUNK, b.slot: CHUNK}
    assert [runtime.leases.state(h) for h in (a, b, c)] == [LeaseState.PREFILLING] * 3


# ---- the lease: one identity, true states --------------------------------------------------------


def _lease(runtime: OffloadRuntime, slot: int = SLOT) -> LeaseHandle:
    handle = runtime.leases.at_engine_slot(slot)
    assert handle is not None
    return handle


def test_a_lease_prefills_hands_off_and_decodes_in_the_states_that_name_each_step() -> None:
    """On CPU the hand-off copy runs synchronously: seen complete at once, the lease moves through
    COPYING_TO_HOST to HOST_READY when the next prompt takes the staging area, and to DECODING at
    its first planned step (the whole prompt written is not yet a hand-off); release frees the
    row and the engine slot."""
    runtime = _runtime()
    first = _lease(runtime)
    assert runtime.leases.state(first) is LeaseState.PREFILLING
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    runtime.prompt_written(first, PREFIX, PREFIX)
    assert runtime.leases.state(first) is LeaseState.PREFILLING  # staged, not yet handed off
    second = runtime.admit("r1", SLOT + 1)
    new = torch.zeros(CHUNK, D, dtype=torch.bfloat16)
    runtime.stage(3, new, new, slot=SLOT + 1, start=0, end=CHUNK)  # claims the staging area
    assert runtime.leases.state(first) is LeaseState.HOST_READY
    runtime.plan_decode([SLOT], [PREFIX + 1])
    assert runtime.leases.state(first) is LeaseState.DECODING
    assert runtime.leases.state(second) is LeaseState.PREFILLING
    runtime.release(first)
    assert runtime.leases.state(first) is LeaseState.RELEASED
    assert runtime.leases.at_engine_slot(SLOT) is None
    assert runtime.kv.state(ROW) is RowState.FREE
    assert runtime.rows_in_use == 1


def test_a_request_that_ends_at_its_first_token_gives_its_staged_prompt_and_row_back() -> None:
    runtime = _runtime()
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    handle = _lease(runtime)
    runtime.release(handle)
    assert runtime.staged == {}
    assert runtime.kv.state(ROW) is RowState.FREE
    assert runtime.leases.num_free == runtime.leases.num_slots


def test_an_aborted_request_drains_and_frees_its_row_in_any_state() -> None:
    runtime = _runtime()
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    runtime.plan_decode([SLOT], [PREFIX + 1])
    runtime.release(_lease(runtime), aborted=True)
    assert runtime.kv.state(ROW) is RowState.FREE
    assert runtime.rows_in_use == 0
    again = runtime.admit("r2", SLOT)  # the engine slot and the row serve the next request
    assert (again.slot, runtime.leases.state(again)) == (ROW, LeaseState.PREFILLING)


@pytest.mark.gpu
def test_on_cuda_a_lease_is_copying_until_its_hand_off_copy_is_seen_complete() -> None:
    """The prompt's copy runs on a side stream: the lease is COPYING_TO_HOST when the first step
    is planned, and DECODING only at a plan after the copy completed; a release while it copies
    waits for it, and the row's host bytes equal the prompt's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    geometry = OffloadGeometry(len(LAYER_IDS), 2, TOPK, 64, 1, D, torch.bfloat16)
    kv = OffloadedKV(geometry, device, path=KernelPath.TRITON)
    runtime = OffloadRuntime(kv, LAYER_IDS, TOPK, verify=True)
    prompt = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D), device=device).to(torch.bfloat16)

    def decode_step(seq_len: int) -> None:
        runtime.plan_decode([SLOT], [seq_len])
        for layer_id in LAYER_IDS:
            q = torch.randn((1, 4 * D), device=device).to(torch.bfloat16)
            new = torch.randn((1, D), device=device).to(torch.bfloat16)
            blocks = torch.full((1, TOPK), -1, dtype=torch.int32, device=device)
            blocks[0, 0] = 0
            runtime.decode_layer(layer_id, q, new, new, blocks, SCALE)

    first = runtime.admit("r0", SLOT)
    _prefill(runtime, prompt, [PREFIX])
    # The side stream's copy starts after this queued work.
    torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
    decode_step(PREFIX + 1)
    assert runtime.leases.state(first) is LeaseState.COPYING_TO_HOST
    torch.cuda.synchronize()
    decode_step(PREFIX + 2)
    assert runtime.leases.state(first) is LeaseState.DECODING
    runtime.release(first)
    second = runtime.admit("r1", SLOT)
    _prefill(runtime, prompt, [PREFIX])
    torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
    decode_step(PREFIX + 1)
    assert runtime.leases.state(second) is LeaseState.COPYING_TO_HOST
    runtime.release(second)  # waits for the copy, then verifies the row byte for byte
    assert runtime.leases.state(second) is LeaseState.RELEASED
    assert runtime.counts.differing_bytes == 0
    assert runtime.counts.verified_bytes > 0


def test_a_second_release_of_a_lease_is_refused_and_changes_nothing() -> None:
    runtime = _runtime()
    first = _lease(runtime)
    runtime.release(first)
    second = runtime.admit("r1", SLOT)
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    with pytest.raises(LeaseError, match="stale lease handle"):
        runtime.release(first)
    assert runtime.leases.state(second) is LeaseState.PREFILLING
    assert runtime.staged == {second.slot: PREFIX}
    assert runtime.rows_in_use == 1


def test_a_lease_table_that_is_not_the_stores_rows_is_refused() -> None:
    geometry = OffloadGeometry(len(LAYER_IDS), 2, TOPK, 64, 1, D, torch.bfloat16)
    kv = OffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
    with pytest.raises(OffloadStateError, match="a lease table of 3 slots for a store of 2 rows"):
        OffloadRuntime(kv, LAYER_IDS, TOPK, leases=LeaseTable(3))


# ---- counts ----------------------------------------------------------------------------------


def test_every_change_of_the_counts_reaches_the_engine() -> None:
    seen: list[OffloadCounts] = []
    runtime = _runtime(seen=seen)
    assert seen[-1].rows_in_use == 1
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    runtime.plan_decode([], [], pad_to=2, capture=True)  # a capture is not a step
    assert seen[-1].decode_steps == 0
    runtime.plan_decode([SLOT], [PREFIX + 1], pad_to=2)
    assert seen[-1].decode_steps == 1
    runtime.release(_lease(runtime))
    assert seen[-1] == runtime.counts
    assert (runtime.counts.rows_in_use, runtime.counts.decode_steps) == (0, 1)


def test_the_block_counters_are_read_every_log_interval() -> None:
    runtime = _runtime(max_blocks=(PREFIX + LOG_EVERY_STEPS) // 4 + 1)
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    blocks = torch.arange(TOPK, dtype=torch.int32)[None]
    for step in range(LOG_EVERY_STEPS):
        runtime.plan_decode([SLOT], [PREFIX + step + 1])
        for layer_id in LAYER_IDS:
            new = torch.zeros(1, D, dtype=torch.bfloat16)
            q = torch.zeros(1, 4 * D, dtype=torch.bfloat16)
            runtime.decode_layer(layer_id, q, new, new, blocks, SCALE)
    per_step = len(LAYER_IDS) * TOPK
    # Read when the last step was planned: every step before it.
    assert runtime.counts.selected_blocks == (LOG_EVERY_STEPS - 1) * per_step
    assert runtime.counts.fetched_blocks == per_step  # the first step's misses; then all hit
    assert runtime.flush_counters() == (per_step, 0)
    assert runtime.counts.selected_blocks == LOG_EVERY_STEPS * per_step


# ---- refusals: each names the values and changes nothing -----------------------------------------


def test_an_engine_slot_that_holds_a_lease_is_refused_naming_its_request() -> None:
    runtime = _runtime()
    with pytest.raises(LeaseError, match=r"engine slot 5 of request 'r1' belongs to .*'r0'"):
        runtime.admit("r1", SLOT)
    assert runtime.rows_in_use == 1


def test_a_slot_without_a_lease_cannot_prefill_or_decode() -> None:
    runtime = _runtime()
    new = torch.zeros(CHUNK, D, dtype=torch.bfloat16)
    with pytest.raises(OffloadStateError, match="request slot 9 prefills but holds no lease"):
        runtime.stage(3, new, new, slot=9, start=0, end=CHUNK)
    with pytest.raises(OffloadStateError, match="request slot 9 decodes but holds no lease"):
        runtime.plan_decode([9], [CHUNK + 1])
    assert runtime.staged == {}


def test_a_lease_past_its_prefill_cannot_stage_again() -> None:
    runtime = _runtime()
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    runtime.plan_decode([SLOT], [PREFIX + 1])
    new = torch.zeros(CHUNK, D, dtype=torch.bfloat16)
    with pytest.raises(OffloadStateError, match="request slot 5 prefills but its lease is 'decod"):
        runtime.stage(3, new, new, slot=SLOT, start=PREFIX, end=PREFIX + CHUNK)
    assert runtime.staged == {}


def test_a_prompt_longer_than_the_staging_area_is_refused_before_any_write() -> None:
    runtime = _runtime()
    most = runtime.kv.geometry.max_tokens
    new = torch.zeros(most + 1, D, dtype=torch.bfloat16)
    with pytest.raises(OffloadStateError, match=rf"{most + 1} tokens exceeds the staging area"):
        runtime.stage(3, new, new, slot=SLOT, start=0, end=most + 1)
    assert runtime.staged == {}
    with pytest.raises(OffloadStateError, match=rf"holds 1 to {most}"):
        runtime.stage_prefix(ROW, most + 1)


def test_a_chunk_after_unstaged_tokens_is_refused() -> None:
    runtime = _runtime()
    new = torch.zeros(CHUNK, D, dtype=torch.bfloat16)
    with pytest.raises(OffloadStateError, match=r"prefills tokens \[32, 64\) but the staging"):
        runtime.stage(3, new, new, slot=SLOT, start=CHUNK, end=2 * CHUNK)
    assert runtime.staged == {ROW: 0}


def test_a_layer_that_is_not_offloaded_is_named() -> None:
    runtime = _runtime()
    new = torch.zeros(CHUNK, D, dtype=torch.bfloat16)
    with pytest.raises(
        OffloadStateError, match=r"layer 4 is not offloaded; offloaded layers: \[3, 7\]"
    ):
        runtime.stage(4, new, new, slot=SLOT, start=0, end=CHUNK)


def test_a_decode_length_that_disagrees_with_the_row_is_refused() -> None:
    runtime = _runtime()
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    runtime.plan_decode([SLOT], [PREFIX + 1])
    with pytest.raises(OffloadStateError, match=r"row 0 \(request slot 5\) holds 65 tokens"):
        runtime.plan_decode([SLOT], [PREFIX + 5])
    assert runtime.kv.length(ROW) == PREFIX + 1


def test_a_hand_off_of_a_prompt_that_is_not_staged_is_refused() -> None:
    runtime = _runtime()
    kv = torch.randn((2, len(LAYER_IDS), PREFIX, 1, D)).to(torch.bfloat16)
    _prefill(runtime, kv, [PREFIX])
    with pytest.raises(OffloadStateError, match=r"row 0 starts decoding after 10 tokens"):
        runtime.plan_decode([SLOT], [11])
    assert runtime.kv.state(ROW) is RowState.FREE
    assert runtime.staged == {ROW: PREFIX}


def test_a_runtime_that_chooses_tokens_refuses_block_ids_before_writing_the_token() -> None:
    geometry = OffloadGeometry(len(LAYER_IDS), 2, TOPK, 64, 1, D, torch.bfloat16, per_head=True)
    kv = PerHeadOffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
    runtime = OffloadRuntime(kv, LAYER_IDS, None)
    runtime.admit("r0", SLOT)
    new = torch.ones(PREFIX, D, dtype=torch.bfloat16)
    runtime.stage(3, new, new, slot=SLOT, start=0, end=PREFIX)
    runtime.stage(7, new, new, slot=SLOT, start=0, end=PREFIX)
    runtime.plan_decode([SLOT], [PREFIX + 1])
    token = torch.full((1, D), 5.0, dtype=torch.bfloat16)
    q = torch.zeros(1, 4 * D, dtype=torch.bfloat16)
    blocks = torch.zeros((1, TOPK), dtype=torch.int32)
    with pytest.raises(OffloadStateError, match="takes a QSA indexer's blocks"):
        runtime.decode_layer(3, q, token, token, blocks, SCALE)
    assert int(kv.step_lengths[0]) == PREFIX + 1  # the plan stands
    assert not bool(kv.tail.eq(5.0).any())  # the new token was not written


@pytest.mark.parametrize(("per_head", "staged_prompts"), [(False, 1), (True, 1), (False, 3)])
def test_the_fixed_device_bytes_are_what_a_runtime_allocates(
    per_head: bool, staged_prompts: int
) -> None:
    """Staging, hot caches, tails and tables: the figure pool sizing charges (qsa-core's
    ``OffloadSizes``) equals the bytes of the runtime's and its store's device tensors."""
    geometry = OffloadGeometry(
        2, 3, 5, 7, 2, D, torch.bfloat16, per_head=per_head, staged_prompts=staged_prompts
    )
    store = PerHeadOffloadedKV if per_head else OffloadedKV
    kv = store(geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
    runtime = OffloadRuntime(kv, LAYER_IDS, None)
    tables = kv.tables
    tensors = (
        runtime.staging_k,
        runtime.staging_v,
        kv.hot,
        kv.tail,
        tables.slot_block,
        tables.slot_stamp,
        tables.block_slot,
    )
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert OffloadRuntime.fixed_device_bytes(geometry) == allocated
    assert OffloadRuntime.fixed_device_bytes(geometry, verify=True) == (
        allocated + geometry.host_bytes
    )


def test_a_runtime_that_reads_blocks_refuses_chosen_tokens_before_writing_the_token() -> None:
    """decode_tokens on a store of every head's records is refused, naming why, and the step's
    token stays unwritten."""
    runtime = _runtime()
    new = torch.ones(PREFIX, D, dtype=torch.bfloat16)
    for layer_id in LAYER_IDS:
        runtime.stage(layer_id, new, new, slot=SLOT, start=0, end=PREFIX)
    runtime.plan_decode([SLOT], [PREFIX + 1])
    token = torch.full((1, D), 5.0, dtype=torch.bfloat16)
    q = torch.zeros(1, 4 * D, dtype=torch.bfloat16)
    positions = torch.zeros((1, 1, 4), dtype=torch.int32)
    with pytest.raises(OffloadStateError, match="decode_tokens takes tokens chosen per KV head"):
        runtime.decode_tokens(3, q, token, token, positions, SCALE)
    assert int(runtime.kv.step_lengths[0]) == PREFIX + 1  # the plan stands
    assert not bool(runtime.kv.tail.eq(5.0).any())  # the new token was not written


def test_every_count_is_described_once_as_a_series() -> None:
    """``OffloadCounts.series`` names every field, in order, once; only the rows in use are a
    value now (a gauge), the rest only grow (counters)."""
    import dataclasses

    series = OffloadCounts.series()
    assert [s.field for s in series] == [f.name for f in dataclasses.fields(OffloadCounts)]
    assert [s.field for s in series if not s.counter] == ["rows_in_use", "staged_peak"]
    assert len({s.name for s in series}) == len(series)
    assert all(s.help.endswith(".") for s in series)


def test_the_description_names_the_arena_and_the_device_buffers() -> None:
    """The start-up line gives the arena's bytes and sizes and the fixed device bytes."""
    from qsa_core import format_bytes

    runtime = _runtime()
    g = runtime.kv.geometry
    text = runtime.describe()
    assert text.startswith(f"host arena {format_bytes(g.host_bytes)} (2 rows x 2 attention")
    assert "all-head records, bfloat16, pageable); on cpu: staging, hot caches (16 blocks" in text
    assert text.endswith(format_bytes(OffloadRuntime.fixed_device_bytes(g)))
    assert runtime.describe_sharding() is None


def test_a_runtime_without_a_shard_group_has_no_index_to_shard() -> None:
    """D2 shards the index over the host arenas' group; an unsharded runtime refuses by value.
    (The sharded runtime's index runs on gloo ranks in ``qsa-sglang-plugin``'s
    ``test_offload_index_sharding.py``.)"""
    with pytest.raises(OffloadStateError, match=r"shard=None and block_topk=16"):
        _runtime().index()


@pytest.mark.parametrize("per_head", [False, True])
def test_a_runtime_for_a_geometry_gets_the_store_of_its_record_layout(per_head: bool) -> None:
    """Per-head records: a ``PerHeadOffloadedKV``; records of every head: an ``OffloadedKV``;
    verification's start-up line names the resident copy's bytes and device."""
    from qsa_core import format_bytes

    geometry = OffloadGeometry(len(LAYER_IDS), 2, TOPK, 64, 2, D, torch.bfloat16, per_head)
    runtime = OffloadRuntime.for_geometry(
        geometry, torch.device("cpu"), LAYER_IDS, None if per_head else TOPK, verify=True
    )
    assert type(runtime.kv) is (PerHeadOffloadedKV if per_head else OffloadedKV)
    assert runtime.describe_verification() == (
        f"a resident copy of every row's K/V ({format_bytes(geometry.host_bytes)}) is kept on "
        "cpu and checked against the host arena when each request ends"
    )
    assert _runtime().describe_verification() is None


@pytest.mark.parametrize("prefix", [0, 20])
def test_prefill_stages_the_chunk_and_attends_over_the_staged_prompt(prefix: int) -> None:
    """The chunk's rows over the staged prompt equal the context attention over the whole
    prompt, and the staging area holds the chunk."""
    from qsa_kernels.context import PrefillKernels, attend_context

    runtime = _runtime()
    gen = torch.Generator().manual_seed(prefix)
    tokens, chunk, hq = prefix + 12, 12, 4
    k = torch.randn((tokens, 1, D), generator=gen).to(torch.bfloat16)
    v = torch.randn((tokens, 1, D), generator=gen).to(torch.bfloat16)
    q = torch.randn((chunk, hq, D), generator=gen).to(torch.bfloat16)
    # each row's distinct causal positions, -1 padded to 8
    picks = torch.full((chunk, 8), -1)
    for row, p in enumerate(range(prefix, tokens)):
        chosen = torch.randperm(p + 1, generator=gen)[:8]
        picks[row, : chosen.numel()] = chosen
    kernels = PrefillKernels.reference()
    if prefix:
        runtime.stage(3, k[:prefix], v[:prefix], slot=SLOT, start=0, end=prefix)
    got = runtime.prefill(
        3,
        q,
        k[prefix:],
        v[prefix:],
        picks,
        slot=SLOT,
        start=prefix,
        end=tokens,
        scale=SCALE,
        kernels=kernels,
    )
    assert torch.equal(runtime.staging_k[0, 0, prefix:tokens], k[prefix:])
    assert torch.equal(got, attend_context(q, k, v, picks, SCALE, kernels))


def test_an_extend_batch_attends_each_request_over_its_own_staged_prompt() -> None:
    """Two prompts packed in one extend batch: each request's rows are its own prefill's, in the
    batch's order, and each prompt is staged in its own area."""
    from qsa_kernels.context import PrefillKernels, attend_context

    runtime, (a, b, _) = _two_area_runtime()
    gen = torch.Generator().manual_seed(11)
    lens, hq = [7, 5], 4
    k = torch.randn((sum(lens), 1, D), generator=gen).to(torch.bfloat16)
    v = torch.randn((sum(lens), 1, D), generator=gen).to(torch.bfloat16)
    q = torch.randn((sum(lens), hq, D), generator=gen).to(torch.bfloat16)
    picks = torch.full((sum(lens), 4), -1)
    positions = [p for n in lens for p in range(n)]
    for row, p in enumerate(positions):
        chosen = torch.randperm(p + 1, generator=gen)[:4]
        picks[row, : chosen.numel()] = chosen
    kernels = PrefillKernels.reference()
    got = runtime.extend(
        3, q, k, v, picks, slots=[5, 6], extend_lens=lens, seq_lens=lens, scale=SCALE,
        kernels=kernels,
    )  # fmt: skip
    first, second = slice(0, lens[0]), slice(lens[0], None)
    want = [attend_context(q[r], k[r], v[r], picks[r], SCALE, kernels) for r in (first, second)]
    assert torch.equal(got, torch.cat(want))
    for handle, rows, n in ((a, first, lens[0]), (b, second, lens[1])):
        k_layers, _v_layers = runtime.staged_layers(handle.slot, n)
        assert torch.equal(k_layers[0], k[rows])


def test_a_context_parallel_extend_is_one_requests_prefill_by_its_zigzag_rows() -> None:
    """With zigzag entries the batch is one request: the rows are its prefill's with them; a
    batch of two is refused by its count."""
    from qsa_kernels import KernelInputError
    from qsa_kernels.context import PrefillKernels, ZigzagEntries

    gen = torch.Generator().manual_seed(12)
    k = torch.randn((8, 1, D), generator=gen).to(torch.bfloat16)
    v = torch.randn((8, 1, D), generator=gen).to(torch.bfloat16)
    q = torch.randn((8, 4, D), generator=gen).to(torch.bfloat16)
    picks = torch.full((8, 4), -1)
    for p in range(8):
        chosen = torch.randperm(p + 1, generator=gen)[:4]
        picks[p, : chosen.numel()] = chosen
    zigzag = ZigzagEntries(torch.tensor([0, 4, 8]).int(), torch.tensor([4, 8]).int(), 4)
    kernels = PrefillKernels.reference()
    want = _runtime().prefill(
        3, q, k, v, picks, slot=SLOT, start=0, end=8, scale=SCALE, kernels=kernels, zigzag=zigzag
    )
    runtime = _runtime()
    got = runtime.extend(
        3, q, k, v, picks, slots=[SLOT], extend_lens=[8], seq_lens=[8], scale=SCALE,
        kernels=kernels, zigzag=zigzag,
    )  # fmt: skip
    assert torch.equal(got, want)
    with pytest.raises(KernelInputError, match="extend batch of 2 requests; allowed: 1"):
        runtime.extend(
            3, q, k, v, picks, slots=[SLOT, SLOT], extend_lens=[4, 4], seq_lens=[4, 4],
            scale=SCALE, kernels=kernels, zigzag=zigzag,
        )  # fmt: skip
