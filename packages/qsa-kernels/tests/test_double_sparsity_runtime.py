"""Double sparsity's decode runtime, driven as an engine's attention backend drives it.

On CPU (the torch references), over a pool like SGLang's: K and V in two ``[N, Hkv, D]`` buffers,
each request's tokens at scattered slots, a label cache by the same slots, and a token table of
request slots. DS-Offload runs over an :class:`OffloadRuntime` whose twin is driven directly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from qsa_kernels import KernelInputError, KernelPath
from qsa_kernels.double_sparsity import (
    DenseLayer,
    DSConfig,
    DSCounts,
    DSDecodeRuntime,
    DSStateError,
    LabelCache,
    StepKind,
    ds_decode_split_reference,
    ds_heavy_decode_split_reference,
    ds_positions,
    ds_positions_fixed,
    staging_slots,
    staging_token_table,
)
from qsa_kernels.offload import (
    OffloadGeometry,
    OffloadRuntime,
    OffloadStateError,
    PerHeadOffloadedKV,
)

HQ, HKV, D, C = 4, 2, 16, 4
LAYERS = 2
SCALE = D**-0.5
CONFIG = DSConfig(heavy_channel_num=C, heavy_token_num=8, sparse_decode_threshold=24)
SHORT, LONG = 10, 40  # dense (below the threshold), sparse


class _Pool:
    """An engine's pool of ``LAYERS`` layers: split K/V buffers, labels and a token table.

    Request slot ``r`` of the token table holds ``lengths[r]`` scattered token slots; the label
    cache is written through the runtime, as the engine's key writes do.
    """

    def __init__(self, lengths: list[int], *, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        total = sum(lengths)
        slots = 3 + total + 7  # padding slots before and after, as SGLang leaves them
        order = torch.randperm(total, generator=gen) + 3
        self.k = torch.zeros(LAYERS, slots, HKV, D, dtype=torch.bfloat16)
        self.v = torch.zeros(LAYERS, slots, HKV, D, dtype=torch.bfloat16)
        channels = torch.stack(
            [torch.stack([torch.randperm(D, generator=gen)[:C] for _ in range(HKV)])] * LAYERS
        ).to(torch.int32)
        self.labels = LabelCache(channels, rows=1, max_tokens=slots)
        width = max(lengths) + 5  # the table is wider than any row
        self.table = torch.zeros(len(lengths) + 1, width, dtype=torch.int32)  # slot 0 unused
        self.lengths = lengths
        self.gen = gen
        start = 0
        for r, n in enumerate(lengths, start=1):
            self.table[r, :n] = order[start : start + n].to(torch.int32)
            start += n
            for layer in range(LAYERS):
                self.k[layer, self.table[r, :n].long()] = self._values(n)
                self.v[layer, self.table[r, :n].long()] = self._values(n)
        self.slots = torch.arange(1, len(lengths) + 1)  # the batch's request slots

    def _values(self, *shape: int) -> torch.Tensor:
        """bf16 values in {-0.5, ..., 0.5}: label scores are exact, so no selection ties differ."""
        return (torch.randint(-2, 3, (*shape, HKV, D), generator=self.gen).float() / 4).to(
            torch.bfloat16
        )

    def runtime(
        self,
        *,
        offload: OffloadRuntime | None = None,
        on_counts: Callable[[DSCounts], None] | None = None,
    ) -> DSDecodeRuntime:
        """A runtime over the pool, its labels written from the pool's keys."""
        runtime = DSDecodeRuntime(self.labels, CONFIG, offload=offload, on_counts=on_counts)
        for layer in range(LAYERS):
            for r, n in enumerate(self.lengths, start=1):
                slots = self.table[r, :n]
                runtime.write_labels(layer, slots, self.k[layer, slots.long()].reshape(n, -1))
        return runtime

    def queries(self) -> torch.Tensor:
        return torch.randn(len(self.lengths), HQ, D, generator=self.gen)


def _dense_attention(pool: _Pool, layer: int, q: torch.Tensor, row: int) -> torch.Tensor:
    """fp32 attention of one batch row over every token of its context: ``[Hq, D]``."""
    slots = pool.table[row + 1, : pool.lengths[row]].long()
    k = pool.k[layer, slots].float().repeat_interleave(HQ // HKV, dim=1)  # [n, Hq, D]
    v = pool.v[layer, slots].float().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("hd,nhd->hn", q[row].to(torch.bfloat16).float(), k) * SCALE
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


# ---- eager steps ---------------------------------------------------------------------------------


def test_an_all_dense_step_leaves_its_layers_to_the_engines_dense_attention() -> None:
    """Every row below the threshold: the engine's dense attention decodes the step (the runtime
    refuses to), and each row is counted dense."""
    pool = _Pool([SHORT, SHORT + 3])
    runtime = pool.runtime()
    assert runtime.plan_step(pool.lengths, pool.table, pool.slots) is StepKind.DENSE
    assert runtime.step_kind is StepKind.DENSE
    assert runtime.counts == DSCounts(eager_steps=1, dense_rows=2)
    with pytest.raises(DSStateError, match=r"decode needs an eager resident step .* 'dense'"):
        runtime.decode(0, pool.queries(), pool.k[0], pool.v[0], SCALE)


def test_a_step_with_a_long_row_decodes_every_row_as_ds_decode_split() -> None:
    """One row above the threshold: every row goes through the split-buffer decode over the
    batch's slot table cut to its longest row, bit for bit, back in the queries' dtype; the short
    row attends every token of its context."""
    pool = _Pool([SHORT, LONG], seed=1)
    runtime = pool.runtime()
    assert runtime.plan_step(pool.lengths, pool.table, pool.slots) is StepKind.SPARSE
    assert runtime.counts == DSCounts(eager_steps=1, dense_rows=1, sparse_rows=1)
    for layer in range(LAYERS):
        q = pool.queries()  # fp32: attended in bf16
        got = runtime.decode(layer, q, pool.k[layer], pool.v[layer], SCALE)
        want = ds_decode_split_reference(
            q.to(torch.bfloat16),
            pool.k[layer],
            pool.v[layer],
            pool.labels.layer(layer),
            pool.labels.channels[layer],
            pool.table[pool.slots, :LONG],
            pool.lengths,
            config=CONFIG,
            scale=SCALE,
        )
        assert got.dtype == torch.float32
        assert torch.equal(got, want.out.to(torch.float32))
        torch.testing.assert_close(
            got[0], _dense_attention(pool, layer, q, 0), atol=2e-2, rtol=2e-2
        )


def test_labels_are_written_from_flat_or_per_head_keys_alike() -> None:
    pool = _Pool([SHORT])
    runtime = pool.runtime()
    twin = LabelCache(pool.labels.channels, rows=1, max_tokens=pool.labels.max_tokens)
    slots = pool.table[1, :SHORT]
    keys = pool.k[1, slots.long()]
    twin.write_slots(1, slots, keys)
    assert torch.equal(pool.labels.layer(1), twin.layer(1))
    runtime.write_labels(1, slots, torch.zeros_like(keys))  # [N, Hkv, D]
    assert not bool(pool.labels.layer(1)[slots.long()].any())


# ---- captured steps ------------------------------------------------------------------------------


def test_the_captured_step_picks_each_rows_output_by_the_refreshed_mask() -> None:
    """Captured at SGLang's fill length (every row dense), replayed with one sparse row: the
    replay's mask picks the heavy-token output for that row and the dense attention's for the
    others; the dense attention is given the sparse row at length 1; padding is not counted."""
    pool = _Pool([LONG, SHORT, 1], seed=2)  # the last row pads the batch
    runtime = pool.runtime()
    runtime.init_graph_state(8)
    fill = torch.ones(3, dtype=torch.int32)
    assert runtime.plan_graph_step(fill, capture=True) is None
    assert runtime.step_kind is StepKind.CAPTURED
    assert runtime.counts == DSCounts()  # a capture is not a step
    runtime.capture_tables(pool.table, pool.slots)

    seq_lens = torch.tensor(pool.lengths, dtype=torch.int32)
    dense = runtime.plan_graph_step(seq_lens, pool.lengths, padding=1)
    assert dense is not None
    assert dense.host == (1, SHORT, 1)
    assert dense.seq_lens.tolist() == [1, SHORT, 1]
    assert runtime.counts == DSCounts(graph_steps=1, dense_rows=1, sparse_rows=1)
    q = pool.queries().to(torch.bfloat16)
    dense_out = torch.full((3, HQ * D), 7.0, dtype=torch.bfloat16)  # the engine's dense output
    got = runtime.decode_captured(0, q, pool.k[0], pool.v[0], seq_lens, dense_out, SCALE)
    heavy = ds_heavy_decode_split_reference(
        q,
        pool.k[0],
        pool.v[0],
        pool.labels.layer(0),
        pool.labels.channels[0],
        pool.table[pool.slots],
        seq_lens,
        heavy_token_num=CONFIG.heavy_token_num,
        scale=SCALE,
    ).out.reshape(3, -1)
    assert got.shape == dense_out.shape
    assert torch.equal(got[0], heavy[0])
    assert torch.equal(got[1:], dense_out[1:])

    all_dense = torch.tensor([SHORT, SHORT, 1], dtype=torch.int32)
    assert runtime.plan_graph_step(all_dense, all_dense.tolist(), padding=1) is None
    assert runtime.counts == DSCounts(graph_steps=2, dense_rows=3, sparse_rows=1)
    got = runtime.decode_captured(0, q, pool.k[0], pool.v[0], all_dense, dense_out, SCALE)
    assert torch.equal(got, dense_out)  # the dense attention's own graph, bit for bit


# ---- DS-Offload ----------------------------------------------------------------------------------


def _offloads(pool: _Pool) -> list[OffloadRuntime]:
    """Two offload runtimes holding the pool's prompts at request slots 1.., rows 0.. (each
    prompt staged as a prefill stages it, handed off by the next prompt or the first step)."""
    blocks = math.ceil((max(pool.lengths) + 1) / 4) + 1
    geometry = OffloadGeometry(
        LAYERS,
        len(pool.lengths),
        CONFIG.hot_blocks(),
        blocks,
        HKV,
        D,
        torch.bfloat16,
        per_head=True,
    )
    offloads = []
    for _ in range(2):
        kv = PerHeadOffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
        offload = OffloadRuntime(kv, {layer: layer for layer in range(LAYERS)}, None)
        for row, n in enumerate(pool.lengths):
            assert offload.admit(f"r{row}", row + 1).slot == row
            slots = pool.table[row + 1, :n].long()
            for layer in range(LAYERS):
                k, v = pool.k[layer, slots], pool.v[layer, slots]
                offload.stage(layer, k, v, slot=row + 1, start=0, end=n)
        offloads.append(offload)
    return offloads


def test_an_offloaded_step_attends_the_tokens_ds_positions_chooses() -> None:
    """Eagerly every row, dense or sparse, attends the host-sized lists of ds_positions through
    the offload's decode_tokens, bit for bit as the offload driven directly."""
    pool = _Pool([SHORT, LONG], seed=3)
    mine, direct = _offloads(pool)
    runtime = pool.runtime(offload=mine)
    slots, lengths = pool.slots.tolist(), [n + 1 for n in pool.lengths]
    for offload in (mine, direct):
        offload.plan_decode(slots, lengths)
    new = [pool._values(2) for _ in range(LAYERS)]
    pool.table[pool.slots, torch.tensor(pool.lengths)] = torch.tensor([1, 2], dtype=torch.int32)
    for layer in range(LAYERS):  # the new token's label at its slot, as the engine writes it
        runtime.write_labels(layer, torch.tensor([1, 2]), new[layer])
    assert runtime.plan_step(lengths, pool.table, pool.slots) is StepKind.OFFLOADED
    assert runtime.counts == DSCounts(eager_steps=1, dense_rows=1, sparse_rows=1)
    for layer in range(LAYERS):
        q = pool.queries().to(torch.bfloat16)
        k = v = new[layer].reshape(2, -1)
        got = runtime.decode_offloaded(layer, q, k, v, SCALE)
        positions = ds_positions(
            q,
            pool.labels.layer(layer),
            pool.labels.channels[layer],
            pool.table[pool.slots, : max(lengths)],
            lengths,
            config=CONFIG,
            reference=True,
        )
        want = direct.decode_tokens(layer, q, k, v, positions, SCALE)
        assert torch.equal(got, want.reshape(2, HQ, D))


def test_a_captured_offloaded_step_chooses_fixed_lists_with_the_plans_lengths() -> None:
    """In a captured step the lists have the fixed width and the lengths are the offload plan's,
    read inside the step; the hot caches are not checked on the host."""
    pool = _Pool([SHORT, LONG], seed=4)
    mine, direct = _offloads(pool)
    runtime = pool.runtime(offload=mine)
    runtime.init_graph_state(4)
    slots, lengths = pool.slots.tolist(), [n + 1 for n in pool.lengths]
    for offload in (mine, direct):
        offload.plan_decode(slots, lengths, pad_to=2)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    assert runtime.plan_graph_step(seq_lens, capture=True) is None
    token = torch.zeros(2, HKV * D, dtype=torch.bfloat16)
    with pytest.raises(DSStateError, match=r"decode_offloaded before .* capture_tables"):
        runtime.decode_offloaded(0, pool.queries(), token, token, SCALE)
    pool.table[pool.slots, torch.tensor(pool.lengths)] = torch.tensor([1, 2], dtype=torch.int32)
    runtime.capture_tables(pool.table, pool.slots)  # the new token's slots in the table
    assert runtime.step_kind is StepKind.OFFLOADED
    new = [pool._values(2) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        runtime.write_labels(layer, torch.tensor([1, 2]), new[layer])
        q = pool.queries().to(torch.bfloat16)
        k = v = new[layer].reshape(2, -1)
        got = runtime.decode_offloaded(layer, q, k, v, SCALE)
        positions = ds_positions_fixed(
            q,
            pool.labels.layer(layer),
            pool.labels.channels[layer],
            pool.table[pool.slots],
            direct.kv.step_lengths,
            config=CONFIG,
            reference=True,
        )
        assert positions.shape[2] == CONFIG.fixed_width()
        want = direct.decode_tokens(layer, q, k, v, positions, SCALE, checked=False)
        assert torch.equal(got, want.reshape(2, HQ, D))
    dense = runtime.plan_graph_step(seq_lens, lengths)  # a replay: every row at 1
    assert dense is not None
    assert dense.host == (1, 1)
    assert dense.seq_lens.tolist() == [1, 1]


# ---- the order of calls and the counts -----------------------------------------------------------


def test_a_call_before_its_steps_plan_is_refused_naming_the_call() -> None:
    pool = _Pool([SHORT, LONG])
    runtime = pool.runtime()
    q = pool.queries()
    with pytest.raises(DSStateError, match=r"before its step's plan \(plan_step or plan_graph"):
        runtime.step_kind  # noqa: B018 (the property raises)
    with pytest.raises(DSStateError, match=r"decode needs .* not planned"):
        runtime.decode(0, q, pool.k[0], pool.v[0], SCALE)
    with pytest.raises(DSStateError, match=r"decode_captured outside a captured resident step"):
        runtime.decode_captured(0, q, pool.k[0], pool.v[0], torch.ones(2), q, SCALE)
    with pytest.raises(DSStateError, match=r"decode_offloaded needs DS-Offload's runtime"):
        runtime.decode_offloaded(0, q, q, q, SCALE)
    with pytest.raises(DSStateError, match=r"plan_graph_step before init_graph_state"):
        runtime.plan_graph_step(torch.ones(2, dtype=torch.int32), capture=True)
    runtime.init_graph_state(2)
    runtime.plan_graph_step(torch.ones(2, dtype=torch.int32), capture=True)
    with pytest.raises(DSStateError, match=r"decode_captured before capture_tables"):
        runtime.decode_captured(0, q, pool.k[0], pool.v[0], torch.ones(2), q, SCALE)
    runtime.plan_step(pool.lengths, pool.table, pool.slots)
    runtime.clear_step()  # an extend batch
    with pytest.raises(DSStateError, match=r"decode needs .* not planned"):
        runtime.decode(0, q, pool.k[0], pool.v[0], SCALE)


def test_every_change_of_the_counts_reaches_on_counts() -> None:
    pool = _Pool([SHORT, LONG])
    seen: list[DSCounts] = []
    runtime = pool.runtime(on_counts=seen.append)
    assert seen == [DSCounts()]
    runtime.plan_step(pool.lengths, pool.table, pool.slots)
    runtime.init_graph_state(4)
    padded = torch.tensor([LONG, 1], dtype=torch.int32)
    runtime.plan_graph_step(padded, capture=True)  # not counted
    runtime.plan_graph_step(padded, [LONG, 1], padding=2)  # only padding rows: not a step
    runtime.plan_graph_step(padded, [LONG, 1], padding=1)
    assert seen == [
        DSCounts(),
        DSCounts(eager_steps=1, dense_rows=1, sparse_rows=1),
        DSCounts(eager_steps=1, graph_steps=1, dense_rows=1, sparse_rows=2),
    ]
    assert runtime.counts == seen[-1]


def test_every_count_is_a_labelled_counter_of_two_families() -> None:
    """``DSCounts.series`` names every field once: steps by ``mode``, rows by ``path``."""
    import dataclasses

    series = DSCounts.series()
    assert sorted(s.field for s in series) == sorted(f.name for f in dataclasses.fields(DSCounts))
    assert all(s.counter for s in series)
    assert {(s.name, s.label) for s in series} == {
        ("decode_steps", ("mode", "eager")),
        ("decode_steps", ("mode", "graph")),
        ("decode_rows", ("path", "dense")),
        ("decode_rows", ("path", "sparse")),
    }
    assert len({s.help for s in series if s.name == "decode_rows"}) == 1


@pytest.mark.parametrize(
    ("kv_dtype", "label_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.bfloat16)],
)
def test_a_runtime_over_an_engines_slots_keeps_one_label_row_per_slot(
    kv_dtype: torch.dtype, label_dtype: torch.dtype
) -> None:
    """``over_slots``: one row of ``slots`` labels per layer, FP8 keys labelled in bf16; the
    start-up line names the options and the cache's size."""
    channels = torch.zeros(LAYERS, HKV, C, dtype=torch.int32)
    runtime = DSDecodeRuntime.over_slots(
        channels, CONFIG, slots=64, kv_dtype=kv_dtype, device="cpu"
    )
    labels = runtime.labels
    assert (labels.rows, labels.max_tokens, labels.layers) == (1, 64, LAYERS)
    assert labels.buffer.dtype == label_dtype
    mib = LAYERS * 64 * HKV * C * 2 / (1 << 20)
    assert runtime.describe(D) == (
        f"{C} heavy channels of {D}, 8 heavy tokens, dense below 24 tokens; label cache "
        f"{LAYERS} layers x 64 slots ({mib:.1f} MiB)"
    )


# ---- one layer as the engine calls it ------------------------------------------------------------


class _Engine:
    """The engine's side of one decode layer, recording which calls the runtime made."""

    def __init__(self, pool: _Pool, layer: int, rows: int) -> None:
        self.calls: list[str] = []
        self.out = torch.full((rows, HQ * D), 7.0)
        self.layer = DenseLayer(
            attend=lambda: self._call("attend", self.out),
            write_kv=lambda: self._call("write_kv", None),
            buffers=lambda: self._call("buffers", (pool.k[layer], pool.v[layer])),
        )

    def _call(self, name: str, value: Any) -> Any:
        self.calls.append(name)
        return value


def test_each_step_kind_takes_its_engine_calls_after_the_new_keys_labels() -> None:
    """DENSE: only the dense attention; SPARSE: the K/V write, the buffers, the split decode
    (flattened to ``[B, Hq * D]``); CAPTURED: the dense attention, then the buffers. Every kind
    writes the new keys' labels first."""
    pool = _Pool([SHORT, LONG], seed=5)
    runtime = pool.runtime()
    loc = pool.table[pool.slots, 0]
    key = torch.ones(2, HKV * D, dtype=torch.bfloat16)
    lens = torch.tensor(pool.lengths)

    runtime.plan_step([SHORT, SHORT], pool.table, pool.slots)
    engine = _Engine(pool, 0, 2)
    assert runtime.decode_layer(0, pool.queries(), key, key, loc, lens, SCALE, engine.layer) is (
        engine.out
    )
    assert engine.calls == ["attend"]
    assert bool((pool.labels.layer(0)[loc.long()] == 1).all())

    runtime.plan_step(pool.lengths, pool.table, pool.slots)
    engine, q = _Engine(pool, 1, 2), pool.queries()
    got = runtime.decode_layer(1, q, key, key, loc, lens, SCALE, engine.layer)
    assert engine.calls == ["write_kv", "buffers"]
    want = runtime.decode(1, q, pool.k[1], pool.v[1], SCALE)
    assert torch.equal(got, want.reshape(2, HQ * D))
    engine = _Engine(pool, 1, 2)
    runtime.decode_layer(1, q, None, None, loc, lens, SCALE, engine.layer)
    assert engine.calls == ["buffers"]  # no new K/V given: nothing to write

    runtime.init_graph_state(2)
    runtime.plan_graph_step(lens, capture=True)
    runtime.capture_tables(pool.table, pool.slots)
    engine = _Engine(pool, 0, 2)
    got = runtime.decode_layer(0, q, key, key, loc, lens, SCALE, engine.layer)
    assert engine.calls == ["attend", "buffers"]
    assert got.shape == engine.out.shape


def test_an_offloaded_layer_without_the_new_kv_is_refused_naming_the_layer() -> None:
    pool = _Pool([SHORT, LONG], seed=6)
    mine, _ = _offloads(pool)
    runtime = pool.runtime(offload=mine)
    mine.plan_decode(pool.slots.tolist(), [n + 1 for n in pool.lengths])
    runtime.plan_step([n + 1 for n in pool.lengths], pool.table, pool.slots)
    engine, loc = _Engine(pool, 0, 2), pool.table[pool.slots, 0]
    with pytest.raises(KernelInputError, match=r"offloaded decode .* layer 1 gave none"):
        runtime.decode_layer(1, pool.queries(), None, None, loc, loc, SCALE, engine.layer)
    assert engine.calls == []
    with pytest.raises(KernelInputError, match=r"every prefill chunk's K/V; layer 0 gave none"):
        runtime.extend_layer(0, loc, None, None, lambda: engine.out)


def test_a_prefill_layer_returns_the_engines_attention_and_writes_the_chunks_labels() -> None:
    """Resident K/V: the engine's prefill, then the labels (none without keys)."""
    pool = _Pool([SHORT])
    runtime = pool.runtime()
    slots = pool.table[1, :SHORT]
    out = torch.zeros(SHORT, HQ * D)
    keys = torch.ones(SHORT, HKV * D, dtype=torch.bfloat16)
    assert runtime.extend_layer(0, slots, keys, keys, lambda: out) is out
    assert bool((pool.labels.layer(0)[slots.long()] == 1).all())
    assert runtime.extend_layer(1, slots, None, None, lambda: out) is out


def test_the_staging_area_is_read_by_position() -> None:
    """DS-Offload's prefill reads the staged prompt's token ``t`` at staging row ``t``."""
    table = staging_token_table(6, "cpu")
    assert table.dtype == torch.int32
    assert table.tolist() == [[0, 1, 2, 3, 4, 5]]
    like = torch.tensor([9, 8], dtype=torch.int64)
    slots = staging_slots(3, like)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [0, 1, 2]


# ---- DS-Offload's prefill: a windowed staging area against the whole prompt ----------------------

_WINDOW_LAYERS = 3  # more layers than the window holds


def _staging_runtime(windowed: bool, prompts: list[int], *, verify: bool = False) -> OffloadRuntime:
    """An offload runtime of per-head records whose staging area is windowed or whole."""
    geometry = OffloadGeometry.per_head_for_context(
        layers=_WINDOW_LAYERS,
        rows=len(prompts),
        context_len=max(prompts) + 8,
        hot_blocks=CONFIG.hot_blocks(),
        kv_heads=HKV,
        head_dim=D,
        dtype=torch.bfloat16,
        windowed_staging=windowed,
    )
    assert geometry.windowed_staging is windowed
    kv = PerHeadOffloadedKV(geometry, torch.device("cpu"), path=KernelPath.REFERENCE)
    return OffloadRuntime(
        kv, {layer: layer for layer in range(_WINDOW_LAYERS)}, None, verify=verify
    )


def _staged_attention(
    offload: OffloadRuntime, layer: int, q: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """A dense prefill as the engine's: the chunk's rows over the staging area, read through the
    one-row token table (causal, fp32): ``[end - start, Hq * D]``."""
    table = staging_token_table(offload.kv.geometry.max_tokens, "cpu")
    k_pool, v_pool = offload.staging_layer(layer)
    slots = table[0, :end].long()
    k = k_pool[slots].float().repeat_interleave(HQ // HKV, dim=1)
    v = v_pool[slots].float().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("thd,nhd->htn", q.float(), k) * SCALE
    causal = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    scores = scores.masked_fill(causal, float("-inf"))
    return torch.einsum("htn,nhd->thd", scores.softmax(-1), v).reshape(end - start, -1)


def _stage_and_attend(  # noqa: PLR0917 (stage's order, then the queries)
    offload: OffloadRuntime,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: int,
    start: int,
    end: int,
    q: torch.Tensor,
) -> torch.Tensor:
    """DS-Offload's prefill of one layer's chunk: staged, then attended over the staging area."""
    offload.stage(layer, k, v, slot=slot, start=start, end=end)
    return _staged_attention(offload, layer, q, start, end)


def _prefill(
    offload: OffloadRuntime,
    runtime: DSDecodeRuntime,
    prompts: list[tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor, torch.Tensor]],
) -> list[torch.Tensor]:
    """Each prompt (its chunks, ``[L, n, Hkv * D]`` K and V, ``[L, n, Hq, D]`` queries) prefilled
    as DS-Offload's backend does, one prompt at a time: each layer's chunk staged, then attended
    over the staging area; the prompt's token slots follow the previous prompt's."""
    outs, first_slot = [], 0
    for row, (spans, k, v, q) in enumerate(prompts):
        handle = offload.admit(f"r{row}", row + 1)
        for start, end in spans:
            for layer in range(_WINDOW_LAYERS):
                ck, cv, cq = k[layer, start:end], v[layer, start:end], q[layer, start:end]
                attend = functools.partial(
                    _stage_and_attend, offload, layer, ck, cv, row + 1, start, end, cq
                )
                slots = torch.arange(start, end) + first_slot
                outs.append(runtime.extend_layer(layer, slots, ck, cv, attend))
        n = int(k.shape[1])
        offload.prompt_written(handle, n, n)
        first_slot += n
    return outs


@pytest.mark.parametrize("chunks", [(10, 23, 37), (4, 8, 30), (1, 2, 3, 35)], ids=str)
def test_a_windowed_staging_area_prefills_and_hands_off_as_the_whole_prompt(
    chunks: tuple[int, ...],
) -> None:
    """DS-Offload's prefill with the prompt staged by a window of layers (each chunk written
    through to the host arena, a layer's prefix read back) attends the same bytes as with the
    whole prompt of every layer staged: two prompts, one at a time, in chunks whose ends fall
    inside blocks and on their edges; every chunk's output bit for bit, the rows after the
    hand-off byte for byte (the second prompt hands the first off; verification compares the
    windowed rows with every staged chunk), and a decode step of both rows bit for bit."""
    gen = torch.Generator().manual_seed(11)

    def values(*shape: int) -> torch.Tensor:
        return (torch.randint(-8, 9, shape, generator=gen).float() / 8).to(torch.bfloat16)

    lengths = [chunks[-1], 26]
    spans = [list(zip((0, *chunks[:-1]), chunks, strict=True)), [(0, 13), (13, 26)]]
    prompts = [
        (span, values(_WINDOW_LAYERS, n, HKV * D), values(_WINDOW_LAYERS, n, HKV * D),
         values(_WINDOW_LAYERS, n, HQ, D))
        for span, n in zip(spans, lengths, strict=True)
    ]  # fmt: skip
    channels = torch.stack([torch.randperm(D, generator=gen)[:C].repeat(HKV, 1)] * _WINDOW_LAYERS)
    new_k = values(_WINDOW_LAYERS, 2, HKV * D)
    decode_q = values(_WINDOW_LAYERS, 2, HQ, D)
    table = torch.zeros(3, sum(lengths) + 2, dtype=torch.int32)
    table[1, : lengths[0] + 1] = torch.arange(lengths[0] + 1)
    table[1, lengths[0]] = sum(lengths)  # each row's new token after both prompts
    table[2, : lengths[1]] = torch.arange(lengths[1]) + lengths[0]
    table[2, lengths[1]] = sum(lengths) + 1
    results = []
    for windowed in (False, True):
        offload = _staging_runtime(windowed, lengths, verify=windowed)
        assert offload.staging_k.shape[0] == (1 if windowed else _WINDOW_LAYERS)
        labels = LabelCache(channels.to(torch.int32), rows=1, max_tokens=sum(lengths) + 2)
        runtime = DSDecodeRuntime(labels, CONFIG, offload=offload)
        outs = _prefill(offload, runtime, prompts)
        seq_lens = [n + 1 for n in lengths]
        offload.plan_decode([1, 2], seq_lens)  # hands the second prompt off
        assert runtime.plan_step(seq_lens, table, torch.tensor([1, 2])) is StepKind.OFFLOADED
        for layer in range(_WINDOW_LAYERS):
            runtime.write_labels(layer, table[[1, 2], lengths].to(torch.int64), new_k[layer])
            outs.append(
                runtime.decode_offloaded(layer, decode_q[layer], new_k[layer], new_k[layer], SCALE)
            )
        results.append((offload, outs))
    (whole, want), (window, got) = results
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for row, (_, k, v, _) in enumerate(prompts):
        full_k = torch.cat((k, new_k[:, row : row + 1]), dim=1).view(_WINDOW_LAYERS, -1, HKV, D)
        full_v = torch.cat((v, new_k[:, row : row + 1]), dim=1).view(_WINDOW_LAYERS, -1, HKV, D)
        for offload in (whole, window):
            assert offload.kv.compare(row, full_k, full_v).bytes_differing == 0
        handle = window.leases.at_engine_slot(row + 1)
        assert handle is not None
        window.release(handle)
    counts = window.counts
    assert counts.verified_bytes > 0
    assert counts.differing_bytes == 0


def test_a_windowed_staging_area_refuses_the_calls_that_read_every_layer() -> None:
    """A prefix restore and a checkpoint read every layer of the staged prompt: refused, named."""
    offload = _staging_runtime(True, [12])
    offload.admit("r", 1)
    keys = torch.ones(12, HKV * D, dtype=torch.bfloat16)
    offload.stage(0, keys, keys, slot=1, start=0, end=12)
    with pytest.raises(OffloadStateError, match=r"staged_layers reads every layer .* window"):
        offload.staged_layers(0, 12)
    with pytest.raises(OffloadStateError, match=r"stage_prefix reads every layer"):
        offload.stage_prefix(0, 4)
