"""Selected-block fetch: kernel and reference against the qsa-core residency contract."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_core import HotCacheState, plan_residency_step
from qsa_kernels import KernelInputError
from qsa_kernels.fetch import HotCacheTables, fetch_selected_blocks, fetch_selected_blocks_reference

DTYPES = [torch.float8_e4m3fn, torch.bfloat16]


def _arena(shape: tuple[int, int, int, int, int], dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    R, L, NB, Hkv, D = shape
    bits = torch.randint(-(2**15), 2**15 - 1, (R, L, NB, 2, 4, Hkv, D), dtype=torch.int16)
    if dtype == torch.bfloat16:
        raw = bits.view(torch.bfloat16)
    else:
        raw = (bits & 0x7E).to(torch.uint8).view(torch.float8_e4m3fn)  # no NaN encodings
    return raw.pin_memory() if pin else raw


def _random_selection(K: int, pool: list[int], rng: random.Random, mode: str) -> list[int]:
    if mode == "empty":
        return [-1] * K
    n = K if mode == "full" else rng.randint(0, K)
    ids = rng.sample(pool, n)
    out = [-1] * K
    for pos, blk in zip(rng.sample(range(K), n), ids, strict=True):
        out[pos] = blk
    return out


def _check_map_consistent(tables: HotCacheTables) -> None:
    sb = tables.slot_block.cpu()
    bs = tables.block_slot.cpu()
    for layer in range(tables.layers):
        for row in range(tables.rows):
            expected = torch.full((tables.blocks,), -1, dtype=torch.int32)
            blocks = sb[layer, row]
            occupied = blocks >= 0
            expected[blocks[occupied].long()] = torch.nonzero(occupied).flatten().int()
            assert torch.equal(bs[layer, row], expected), (layer, row)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp8", "bf16"])
def test_fetch_reproduces_core_contract_step_by_step(
    kernel_device: str, dtype: torch.dtype
) -> None:
    """Over mixed, all-miss, all-hit and empty steps: slots, state and records match qsa-core."""
    rng = random.Random(7)
    torch.manual_seed(7)
    big = kernel_device == "cuda"
    L, R, S, NB, K, Hkv, D = (3, 5, 64, 300, 48, 1, 256) if big else (2, 3, 8, 40, 6, 1, 16)
    dev = torch.device(kernel_device)
    arena = _arena((R, L, NB, Hkv, D), dtype, pin=big)
    hot = _arena((L, R, S, Hkv, D), dtype, pin=False).to(dev)
    hot_ref = hot.clone()
    tables = HotCacheTables.empty(L, R, S, NB, dev)
    tables_ref = tables.clone()
    rows = torch.tensor([4, 0, 2] if big else [2, 0], dtype=torch.int32, device=dev)
    layers = torch.tensor([2, 0] if big else [1], dtype=torch.int32, device=dev)
    states = {
        (lay, row): HotCacheState.empty(S) for lay in layers.tolist() for row in rows.tolist()
    }
    pool = list(range(min(NB, 3 * S)))
    modes = ["full", "mixed", "repeat", "mixed", "empty", "full", "mixed", "repeat", "mixed"]
    previous: list[list[list[int]]] | None = None
    for step, mode in enumerate(modes, start=1):
        if mode == "repeat" and previous is not None:
            chosen = previous  # all-hit: the same selection again
        else:
            chosen = [
                [_random_selection(K, pool, rng, mode) for _ in layers.tolist()]
                for _ in rows.tolist()
            ]
        previous = chosen
        selected = torch.tensor(chosen, dtype=torch.int32, device=dev)
        counters = torch.zeros(2, dtype=torch.int64, device=dev)
        counters_ref = torch.zeros(2, dtype=torch.int64, device=dev)
        got = fetch_selected_blocks(
            selected, rows, layers, step=step, tables=tables, hot=hot, host_arena=arena,
            counters=counters,
        )  # fmt: skip
        want = fetch_selected_blocks_reference(
            selected, rows, layers, step=step, tables=tables_ref, hot=hot_ref, host_arena=arena,
            counters=counters_ref,
        )  # fmt: skip
        assert torch.equal(got, want), (step, mode)
        selected_count, missed = 0, 0
        for b, row in enumerate(rows.tolist()):
            for j, layer in enumerate(layers.tolist()):
                plan = plan_residency_step(states[layer, row], chosen[b][j], step, num_blocks=NB)
                selected_count += sum(x >= 0 for x in chosen[b][j])
                missed += len(plan.fills)
                states[layer, row] = plan.state
                local = [s if s < 0 else s - row * S for s in got[b, j].tolist()]
                global_ok = [s == -1 or s // S == row for s in got[b, j].tolist()]
                assert all(global_ok), (step, b, j)
                assert local == list(plan.selected_slots), (step, mode, b, j)
                assert tables.residency(layer, row) == plan.state.to_lists(), (step, mode)
        # The counters hold every selected entry and every miss of the step (qsa-core's fills).
        assert counters.tolist() == counters_ref.tolist() == [selected_count, missed], (step, mode)
        # Every record of the hot cache, targeted or not, equals the reference's bit for bit.
        assert torch.equal(hot.view(torch.uint8), hot_ref.view(torch.uint8)), (step, mode)
        _check_map_consistent(tables)


def test_fetch_writes_only_the_missed_slots(kernel_device: str) -> None:
    """A fetch rewrites exactly the victim slots; other rows, layers and slots keep their bytes."""
    torch.manual_seed(3)
    dev = torch.device(kernel_device)
    L, R, S, NB, Hkv, D = 2, 3, 8, 20, 1, 16
    arena = _arena((R, L, NB, Hkv, D), torch.bfloat16, pin=kernel_device == "cuda")
    hot = torch.full((L, R, S, 2, 4, Hkv, D), float("nan"), dtype=torch.bfloat16, device=dev)
    before = hot.clone()
    tables = HotCacheTables.empty(L, R, S, NB, dev)
    selected = torch.tensor([[[5, -1, 17, 2]]], dtype=torch.int32, device=dev)
    rows = torch.tensor([1], dtype=torch.int32, device=dev)
    layers = torch.tensor([1], dtype=torch.int32, device=dev)
    got = fetch_selected_blocks(
        selected, rows, layers, step=1, tables=tables, hot=hot, host_arena=arena
    )
    # Empty slots rank by index: ids 5, 17, 2 take local slots 0, 1, 2 of row 1.
    assert got.tolist() == [[[S + 0, -1, S + 1, S + 2]]]
    changed = (hot.view(torch.int16) != before.view(torch.int16)).flatten(3).any(-1)
    expected = torch.zeros_like(changed)
    expected[1, 1, :3] = True
    assert torch.equal(changed, expected)
    for slot, blk in enumerate((5, 17, 2)):
        assert torch.equal(
            hot[1, 1, slot].cpu().view(torch.int16), arena[1, 1, blk].view(torch.int16)
        )


def test_fetch_returns_minus_one_for_all_padding(kernel_device: str) -> None:
    """An all-padding selection returns all -1 and leaves tables and hot cache unchanged."""
    dev = torch.device(kernel_device)
    arena = _arena((1, 1, 8, 1, 16), torch.bfloat16, pin=kernel_device == "cuda")
    hot = torch.zeros((1, 1, 4, 2, 4, 1, 16), dtype=torch.bfloat16, device=dev)
    tables = HotCacheTables.empty(1, 1, 4, 8, dev)
    selected = torch.full((1, 1, 3), -1, dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    got = fetch_selected_blocks(
        selected, zero, zero, step=0, tables=tables, hot=hot, host_arena=arena
    )
    assert got.tolist() == [[[-1, -1, -1]]]
    assert tables.residency(0, 0) == ([-1] * 4, [-1] * 4)
    assert not hot.any()


def _tiny_fetch(
    fetch: Callable[..., torch.Tensor],
    selected: list[int],
    arena_dtype: torch.dtype = torch.bfloat16,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``fetch`` for one request and one layer with S=4 slots and NB=8 blocks."""
    zero = torch.zeros(1, dtype=torch.int32)
    return fetch(
        torch.tensor([[selected]], dtype=torch.int32),
        zero,
        zero,
        step=1,
        tables=HotCacheTables.empty(1, 1, 4, 8, torch.device("cpu")),
        hot=torch.zeros((1, 1, 4, 2, 4, 1, 16), dtype=torch.bfloat16),
        host_arena=torch.zeros((1, 1, 8, 2, 4, 1, 16), dtype=arena_dtype),
        counters=counters,
    )


def test_fetch_rejects_more_entries_than_slots() -> None:
    """K > S cannot be served and is refused with both numbers in the message."""
    with pytest.raises(KernelInputError, match=r"K=5.*S=4"):
        _tiny_fetch(fetch_selected_blocks, [-1] * 5)


@pytest.mark.parametrize("fetch", [fetch_selected_blocks, fetch_selected_blocks_reference])
def test_fetch_refuses_counters_that_are_not_two_int64s_and_counts_nothing(
    fetch: Callable[..., torch.Tensor],
) -> None:
    """The counters are named with what is allowed; a refused call leaves them as they were."""
    narrow = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"counters has dtype torch.int32; allowed"):
        _tiny_fetch(fetch, [1, -1], counters=narrow)
    wide = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(KernelInputError, match=r"counters has size 3 along dim 0"):
        _tiny_fetch(fetch, [1, -1], counters=wide)
    assert not narrow.any()
    assert not wide.any()


def test_fetch_rejects_mismatched_arena_dtype() -> None:
    """The arena and hot cache must share a dtype; the message names both."""
    with pytest.raises(KernelInputError, match="float8_e4m3fn"):
        _tiny_fetch(fetch_selected_blocks_reference, [-1, -1], torch.float8_e4m3fn)


def test_fetch_reference_rejects_duplicate_ids() -> None:
    """Duplicate valid ids in one row violate the contract and are refused by the reference."""
    with pytest.raises(KernelInputError, match="distinct"):
        _tiny_fetch(fetch_selected_blocks_reference, [3, -1, 3])


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.lists(st.integers(min_value=-1, max_value=11), min_size=5, max_size=5),
        min_size=1,
        max_size=6,
    )
)
def test_reference_agrees_with_core_on_arbitrary_steps(steps: list[list[int]]) -> None:
    """For any sequence of selections the torch reference follows qsa-core's plan exactly."""
    S, NB = 6, 12
    tables = HotCacheTables.empty(1, 1, S, NB, torch.device("cpu"))
    hot = torch.zeros((1, 1, S, 2, 4, 1, 16), dtype=torch.bfloat16)
    arena = torch.arange(NB * 128, dtype=torch.float32).bfloat16().view(1, 1, NB, 2, 4, 1, 16)
    state = HotCacheState.empty(S)
    zero = torch.zeros(1, dtype=torch.int32)
    for step, raw in enumerate(steps, start=1):
        seen: set[int] = set()
        sel = []
        for x in raw:  # keep the first occurrence of each id, pad the repeats
            sel.append(x if x not in seen else -1)
            seen.add(x)
        got = fetch_selected_blocks_reference(
            torch.tensor([[sel]], dtype=torch.int32),
            zero,
            zero,
            step=step,
            tables=tables,
            hot=hot,
            host_arena=arena,
        )
        plan = plan_residency_step(state, sel, step, num_blocks=NB)
        state = plan.state
        assert got[0, 0].tolist() == list(plan.selected_slots)
        assert tables.residency(0, 0) == state.to_lists()
        for slot, blk in enumerate(state.slot_block):
            if blk >= 0:
                assert torch.equal(hot[0, 0, slot], arena[0, 0, blk])


def _tables_from_states(
    states: list[tuple[list[int], list[int]]], NB: int, dev: torch.device
) -> HotCacheTables:
    """One layer, one row per state; ``block_slot`` built as the inverse of ``slot_block``."""
    S = len(states[0][0])
    tables = HotCacheTables.empty(1, len(states), S, NB, dev)
    for row, (blocks, stamps) in enumerate(states):
        tables.slot_block[0, row] = torch.tensor(blocks, dtype=torch.int32)
        tables.slot_stamp[0, row] = torch.tensor(stamps, dtype=torch.int64)
        for slot, blk in enumerate(blocks):
            if blk >= 0:
                tables.block_slot[0, row, blk] = slot
    return tables


@st.composite
def _state_and_selection(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], int]:
    S = draw(st.integers(min_value=1, max_value=24))
    NB = 40
    K = draw(st.integers(min_value=1, max_value=S))
    blocks = draw(st.lists(st.integers(0, NB - 1), min_size=S, max_size=S, unique=True))
    empty = draw(st.lists(st.booleans(), min_size=S, max_size=S))
    slot_block = [-1 if e else b for b, e in zip(blocks, empty, strict=True)]
    # Narrow stamp ranges give many ties (few rank groups); wide ones force the sort fallback.
    top = draw(st.sampled_from([2, 6, 1000]))
    slot_stamp = draw(st.lists(st.integers(-1, top), min_size=S, max_size=S))
    pool = draw(st.lists(st.integers(0, NB - 1), min_size=K, max_size=K, unique=True))
    pad = draw(st.lists(st.booleans(), min_size=K, max_size=K))
    selected = [-1 if p else b for b, p in zip(pool, pad, strict=True)]
    return slot_block, slot_stamp, selected, top + 1


@settings(max_examples=60, deadline=None)
@given(case=_state_and_selection())
def test_kernel_matches_core_from_arbitrary_states(
    case: tuple[list[int], list[int], list[int], int], interpreter_device: str
) -> None:
    """From any valid state (ties, empty slots with stamps, distinct stamps) one step is exact."""
    slot_block, slot_stamp, selected, step = case
    NB, S = 40, len(slot_block)
    dev = torch.device(interpreter_device)
    tables = _tables_from_states([(slot_block, slot_stamp)], NB, dev)
    arena = _arena((1, 1, NB, 1, 4), torch.bfloat16, pin=False)
    hot = torch.zeros((1, 1, S, 2, 4, 1, 4), dtype=torch.bfloat16)
    zero = torch.zeros(1, dtype=torch.int32)
    got = fetch_selected_blocks(
        torch.tensor([[selected]], dtype=torch.int32),
        zero,
        zero,
        step=step,
        tables=tables,
        hot=hot,
        host_arena=arena,
    )
    state = HotCacheState(tuple(slot_block), tuple(slot_stamp))
    plan = plan_residency_step(state, selected, step, num_blocks=NB)
    assert got[0, 0].tolist() == list(plan.selected_slots)
    assert tables.residency(0, 0) == plan.state.to_lists()
    _check_map_consistent(tables)
    for fill in plan.fills:
        assert torch.equal(
            hot[0, 0, fill.slot].view(torch.int16), arena[0, 0, fill.block].view(torch.int16)
        )


def test_fetch_orders_victims_with_many_distinct_stamps(kernel_device: str) -> None:
    """Victims spread over more stamps than the min-extraction rounds still follow qsa-core."""
    dev = torch.device(kernel_device)
    S, NB, K = 64, 200, 40
    rng = random.Random(11)
    # Every slot occupied, each with its own stamp, shuffled so slot order != age order.
    stamps = list(range(S))
    rng.shuffle(stamps)
    blocks = rng.sample(range(NB), S)
    tables = _tables_from_states([(blocks, stamps)], NB, dev)
    arena = _arena((1, 1, NB, 1, 16), torch.bfloat16, pin=kernel_device == "cuda")
    hot = torch.zeros((1, 1, S, 2, 4, 1, 16), dtype=torch.bfloat16, device=dev)
    hot_ref = hot.clone()
    tables_ref = tables.clone()
    state = HotCacheState(tuple(blocks), tuple(stamps))
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    resident = list(blocks)
    for step in range(S, S + 4):
        fresh = rng.sample([b for b in range(NB) if b not in resident], K - 3)
        sel = fresh + rng.sample(resident, 3)  # 37 misses over 37 distinct stamps, 3 hits
        rng.shuffle(sel)
        selected = torch.tensor([[sel]], dtype=torch.int32, device=dev)
        got = fetch_selected_blocks(
            selected, zero, zero, step=step, tables=tables, hot=hot, host_arena=arena
        )
        fetch_selected_blocks_reference(
            selected, zero, zero, step=step, tables=tables_ref, hot=hot_ref, host_arena=arena
        )
        plan = plan_residency_step(state, sel, step, num_blocks=NB)
        state = plan.state
        resident = [b for b in state.slot_block if b >= 0]
        assert got[0, 0].tolist() == list(plan.selected_slots), step
        assert tables.residency(0, 0) == state.to_lists(), step
        assert torch.equal(hot.view(torch.int16), hot_ref.view(torch.int16)), step
        _check_map_consistent(tables)


def test_fetch_step_tensor_is_read_on_device_and_advanced(kernel_device: str) -> None:
    """A [1] int64 step tensor stamps like the int step and is advanced by one per call."""
    rng = random.Random(5)
    dev = torch.device(kernel_device)
    L, R, S, NB, K = 2, 3, 8, 30, 5
    arena = _arena((R, L, NB, 1, 16), torch.float8_e4m3fn, pin=kernel_device == "cuda")
    hot = torch.zeros((L, R, S, 2, 4, 1, 16), dtype=torch.float8_e4m3fn, device=dev)
    hot_ref = hot.clone()
    tables = HotCacheTables.empty(L, R, S, NB, dev)
    tables_ref = tables.clone()
    rows = torch.tensor([1, 2], dtype=torch.int32, device=dev)
    layers = torch.tensor([1, 0], dtype=torch.int32, device=dev)
    step_t = torch.tensor([3], dtype=torch.int64, device=dev)
    for step in range(3, 9):
        chosen = [[_random_selection(K, list(range(20)), rng, "mixed") for _ in range(2)]] * 2
        selected = torch.tensor(chosen, dtype=torch.int32, device=dev)
        got = fetch_selected_blocks(
            selected, rows, layers, step=step_t, tables=tables, hot=hot, host_arena=arena
        )
        want = fetch_selected_blocks_reference(
            selected, rows, layers, step=step, tables=tables_ref, hot=hot_ref, host_arena=arena
        )
        assert torch.equal(got, want), step
        assert int(step_t.item()) == step + 1
        assert torch.equal(tables.slot_stamp, tables_ref.slot_stamp), step
        assert torch.equal(tables.slot_block, tables_ref.slot_block), step
        assert torch.equal(hot.view(torch.uint8), hot_ref.view(torch.uint8)), step


@pytest.mark.gpu
def test_fetch_replays_from_a_cuda_graph_step_by_step() -> None:
    """One captured fetch, replayed over new selections, follows the reference and qsa-core."""
    rng = random.Random(23)
    dev = torch.device("cuda")
    L, R, S, NB, K = 3, 4, 96, 400, 64
    arena = _arena((R, L, NB, 1, 256), torch.float8_e4m3fn, pin=True)
    hot = torch.zeros((L, R, S, 2, 4, 1, 256), dtype=torch.float8_e4m3fn, device=dev)
    hot_ref = hot.clone()
    tables = HotCacheTables.empty(L, R, S, NB, dev)
    tables_ref = tables.clone()
    rows = torch.tensor([3, 0, 2], dtype=torch.int32, device=dev)
    layers = torch.tensor([2, 0, 1], dtype=torch.int32, device=dev)
    states = {(lay, row): HotCacheState.empty(S) for lay in (2, 0, 1) for row in (3, 0, 2)}
    static_sel = torch.full((3, 3, K), -1, dtype=torch.int32, device=dev)
    step_t = torch.tensor([1], dtype=torch.int64, device=dev)
    # Warm up (compiles both kernels) with an all-padding selection, which advances the step
    # tensor and leaves the state unchanged; then capture one call.
    fetch_selected_blocks(
        static_sel, rows, layers, step=step_t, tables=tables, hot=hot, host_arena=arena
    )
    torch.cuda.synchronize()
    step_t.fill_(1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fetch_selected_blocks(
            static_sel, rows, layers, step=step_t, tables=tables, hot=hot, host_arena=arena
        )
    step_t.fill_(1)  # capture does not run the kernels
    pool = list(range(3 * S))
    modes = ["full", "mixed", "full", "mixed", "empty", "full", "mixed", "full"]
    for step, mode in enumerate(modes, start=1):
        chosen = [[_random_selection(K, pool, rng, mode) for _ in range(3)] for _ in range(3)]
        static_sel.copy_(torch.tensor(chosen, dtype=torch.int32))
        graph.replay()
        want = fetch_selected_blocks_reference(
            static_sel, rows, layers, step=step, tables=tables_ref, hot=hot_ref, host_arena=arena
        )
        assert torch.equal(static_out, want), (step, mode)
        assert int(step_t.item()) == step + 1
        for b, row in enumerate((3, 0, 2)):
            for j, layer in enumerate((2, 0, 1)):
                plan = plan_residency_step(states[layer, row], chosen[b][j], step, num_blocks=NB)
                states[layer, row] = plan.state
                assert tables.residency(layer, row) == plan.state.to_lists(), (step, b, j)
        assert torch.equal(hot.view(torch.uint8), hot_ref.view(torch.uint8)), (step, mode)
        _check_map_consistent(tables)
