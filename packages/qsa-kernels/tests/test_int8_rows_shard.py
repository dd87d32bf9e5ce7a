"""A rank's vocabulary shard of INT8 rows: allocated once, gathered, filled by the router."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from qsa_kernels import KernelInputError, KernelPath
from qsa_kernels.int8_rows import (
    Int8RowShardRouter,
    Int8RowTable,
    Int8RowVocabShard,
    checkpoint_shard_rows,
    dequantize_int8_rows_reference,
    quantize_int8_rows,
)

ROWS, USED, DIM, PARTS = 24, 21, 5, 4  # shards of 6 rows; rows 21..23 are padding
CPU = torch.device("cpu")
MODULE = "layers.1.ngram_embedding"


def _stored(seed: int = 0) -> Int8RowTable:
    source = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))
    return quantize_int8_rows(source.to(torch.bfloat16))


def _shard(start: int = 0, end: int = ROWS) -> Int8RowVocabShard:
    return Int8RowVocabShard.zeros(
        rows=end - start,
        dim=DIM,
        vocab_start=start,
        vocab_end=end,
        total_rows=ROWS,
        used_rows=USED,
        device=CPU,
    )


def _checkpoint(table: Int8RowTable, prefix: str = MODULE) -> Iterator[tuple[str, torch.Tensor]]:
    yield "layers.0.mlp.weight", torch.ones(3)
    size = checkpoint_shard_rows(ROWS, PARTS)
    for shard, first in enumerate(range(0, ROWS, size)):
        yield f"{prefix}.shard_{shard}.weight", table.values[first : first + size]
        yield f"{prefix}.shard_{shard}.weight_scale", table.scales[first : first + size]
    yield "layers.2.mlp.weight", torch.ones(4)


def test_zeros_allocates_the_int8_table_and_its_scales_only() -> None:
    shard = Int8RowVocabShard.zeros(
        rows=13,
        dim=DIM,
        vocab_start=12,
        vocab_end=24,
        total_rows=ROWS,
        used_rows=USED,
        device=CPU,
    )
    assert (shard.table.values.dtype, shard.table.scales.dtype) == (torch.int8, torch.float32)
    assert shard.table.rows == 13
    assert shard.nbytes == 13 * DIM + 13 * 4
    assert shard.read_end == USED
    assert not shard.table.values.any()


@pytest.mark.parametrize(
    ("start", "end", "used", "pinned_device"),
    [
        pytest.param(12, 12, USED, None, id="empty"),
        pytest.param(0, ROWS + 1, USED, None, id="past-total"),
        pytest.param(0, ROWS, ROWS + 1, None, id="used-past-total"),
        pytest.param(0, ROWS, USED, "meta", id="pinned-off-host"),
    ],
)
def test_bounds_outside_the_table_are_refused(
    start: int, end: int, used: int, pinned_device: str | None
) -> None:
    with pytest.raises(KernelInputError, match=r"vocab_start=|pinned=True"):
        Int8RowVocabShard.zeros(
            rows=max(end - start, 1),
            dim=DIM,
            vocab_start=start,
            vocab_end=end,
            total_rows=ROWS,
            used_rows=used,
            device=torch.device(pinned_device or "cpu"),
            pinned=pinned_device is not None,
        )


def test_gather_reads_this_ranks_rows_and_zeros_for_others() -> None:
    stored = _stored()
    shard = Int8RowVocabShard(
        Int8RowTable(stored.values[12:].clone(), stored.scales[12:].clone()), 12, 24, ROWS, USED
    )
    ids = torch.tensor([[3, 12, 20], [23, 0, 15]])
    out = torch.full((2, 3, DIM), float("nan"), dtype=torch.bfloat16)
    got = shard.gather(ids, out=out, path=KernelPath.REFERENCE)
    assert got is out
    full = dequantize_int8_rows_reference(stored)
    for (i, j), row in ((ij, int(ids[ij])) for ij in [(0, 0), (0, 2), (1, 0), (1, 1), (1, 2)]):
        expected = full[row] if 12 <= row < 24 else torch.zeros(DIM, dtype=torch.bfloat16)
        assert torch.equal(got[i, j], expected), (i, j, row)


def test_gather_into_an_output_of_another_shape_is_refused() -> None:
    with pytest.raises(KernelInputError, match=r"out is \(2, 5\)"):
        _shard().gather(torch.tensor([1]), out=torch.empty(2, DIM, dtype=torch.bfloat16))


def test_router_fills_each_rank_and_passes_every_other_tensor_on_in_order() -> None:
    stored = _stored()
    low, high = _shard(0, 12), _shard(12, ROWS)
    for shard in (low, high):
        router = Int8RowShardRouter({MODULE: shard}, parts=PARTS)
        passed = [name for name, _ in router.route(_checkpoint(stored))]
        assert passed == ["layers.0.mlp.weight", "layers.2.mlp.weight"]
        summary = router.finish()[MODULE]
        assert summary.rows == shard.read_end - shard.vocab_start
    assert torch.equal(low.table.values, stored.values[:12])
    assert torch.equal(high.table.values[: USED - 12], stored.values[12:USED])
    assert not high.table.values[USED - 12 :].any()  # padding rows are never read


def test_router_renames_checkpoint_names_before_matching() -> None:
    shard = _shard()
    router = Int8RowShardRouter(
        {MODULE: shard}, parts=PARTS, rename=lambda name: name.replace("model.", "")
    )
    assert [n for n, _ in router.route(_checkpoint(_stored(1), prefix=f"model.{MODULE}"))] == [
        "layers.0.mlp.weight",
        "layers.2.mlp.weight",
    ]
    router.finish()
    assert torch.equal(shard.table.values[:USED], _stored(1).values[:USED])


def test_a_rank_of_padding_rows_drops_its_shards() -> None:
    shard = Int8RowVocabShard.zeros(
        rows=3, dim=DIM, vocab_start=21, vocab_end=24, total_rows=ROWS, used_rows=USED, device=CPU
    )
    router = Int8RowShardRouter({MODULE: shard}, parts=PARTS)
    assert len(list(router.route(_checkpoint(_stored())))) == 2
    assert router.finish() == {}
    assert not shard.table.values.any()


def test_router_refuses_values_without_scales_at_finish() -> None:
    stored = _stored()
    router = Int8RowShardRouter({MODULE: _shard()}, parts=PARTS)
    list(router.route(p for p in _checkpoint(stored) if p[0] != f"{MODULE}.shard_1.weight_scale"))
    with pytest.raises(KernelInputError, match=r"shard_1\.weight is int8 but its scales"):
        router.finish()


def test_a_table_quantized_at_load_gets_one_note_naming_it() -> None:
    source = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(2))
    stored = _stored()
    size = checkpoint_shard_rows(ROWS, PARTS)
    weights = [
        (f"{MODULE}.shard_{i}.weight", source[f : f + size])
        for i, f in enumerate(range(0, ROWS, size))
    ]
    router = Int8RowShardRouter({MODULE: _shard()}, parts=PARTS)
    list(router.route(weights))
    note = router.finish()[MODULE].quantized_note(MODULE)
    assert note == (
        f"INT8-row table {MODULE} is stored as a 16/32-bit table in the checkpoint; 4 shards "
        f"quantized to INT8 rows at load ({USED} rows)"
    )
    router = Int8RowShardRouter({MODULE: _shard()}, parts=PARTS)
    list(router.route(_checkpoint(stored)))
    assert router.finish()[MODULE].quantized_note(MODULE) is None
