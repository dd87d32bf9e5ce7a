"""Reading an INT8-row table from a checkpoint's row shards: as stored, quantized, and refused."""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import KernelInputError
from qsa_kernels.int8_rows import (
    Int8RowShardReader,
    Int8RowTable,
    checkpoint_shard_rows,
    quantize_int8_rows,
)

ROWS = 10
DIM = 6
PARTS = 4  # shards of 3, 3, 3 and 1 rows


def _source(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, DIM, generator=g).to(torch.bfloat16)


def _empty(rows: int = ROWS) -> Int8RowTable:
    return Int8RowTable(torch.zeros(rows, DIM, dtype=torch.int8), torch.zeros(rows))


def _reader(table: Int8RowTable, start: int = 0, end: int = ROWS) -> Int8RowShardReader:
    return Int8RowShardReader(table, total_rows=ROWS, parts=PARTS, vocab_start=start, vocab_end=end)


def _shards(table: Int8RowTable) -> list[tuple[torch.Tensor, torch.Tensor]]:
    size = checkpoint_shard_rows(ROWS, PARTS)
    return [(table.values[i : i + size], table.scales[i : i + size]) for i in range(0, ROWS, size)]


def test_shard_rows_round_up() -> None:
    assert checkpoint_shard_rows(ROWS, PARTS) == 3
    assert checkpoint_shard_rows(8, 4) == 2
    with pytest.raises(KernelInputError, match="parts=0"):
        checkpoint_shard_rows(ROWS, 0)


def test_int8_shards_in_any_order_load_as_stored() -> None:
    stored = quantize_int8_rows(_source())
    table = _empty()
    reader = _reader(table)
    for shard, (values, scales) in reversed(list(enumerate(_shards(stored)))):
        if shard % 2:
            reader.add_scales(shard, scales[:, None].clone(), name=f"s{shard}.weight_scale")
            reader.add_values(shard, values.clone(), name=f"s{shard}.weight")
        else:
            reader.add_values(shard, values.clone(), name=f"s{shard}.weight")
            reader.add_scales(shard, scales.clone(), name=f"s{shard}.weight_scale")
    summary = reader.finish()
    assert (summary.rows, summary.int8_shards, summary.quantized_shards) == (ROWS, PARTS, 0)
    assert torch.equal(table.values, stored.values)
    assert torch.equal(table.scales, stored.scales)


def test_a_16_bit_table_is_quantized_shard_by_shard_as_whole() -> None:
    source = _source(1)
    table = _empty()
    reader = _reader(table)
    size = checkpoint_shard_rows(ROWS, PARTS)
    for shard, first in enumerate(range(0, ROWS, size)):
        reader.add_values(shard, source[first : first + size], name=f"s{shard}.weight")
    assert reader.finish().quantized_shards == PARTS
    whole = quantize_int8_rows(source)
    assert torch.equal(table.values, whole.values)
    assert torch.equal(table.scales, whole.scales)


def test_a_rank_reads_only_its_vocabulary_shard() -> None:
    stored = quantize_int8_rows(_source(2))
    table = _empty(rows=6)  # rows [4, 9) of the vocabulary, one padding row
    reader = _reader(table, start=4, end=9)
    for shard, (values, scales) in enumerate(_shards(stored)):
        reader.add_values(shard, values, name="v")
        reader.add_scales(shard, scales, name="s")
    assert reader.finish().rows == 5
    assert torch.equal(table.values[:5], stored.values[4:9])
    assert torch.equal(table.scales[:5], stored.scales[4:9])
    assert not table.values[5].any()


def test_values_without_scales_are_refused_by_name() -> None:
    stored = quantize_int8_rows(_source())
    reader = _reader(_empty())
    for shard, (values, scales) in enumerate(_shards(stored)):
        reader.add_values(shard, values, name=f"m.shard_{shard}.weight")
        if shard != 2:
            reader.add_scales(shard, scales, name=f"m.shard_{shard}.weight_scale")
    with pytest.raises(KernelInputError, match=r"m\.shard_2\.weight is int8 but its scales"):
        reader.finish()


def test_scales_without_values_and_missing_rows_are_refused() -> None:
    stored = quantize_int8_rows(_source())
    reader = _reader(_empty())
    reader.add_scales(0, stored.scales[:3], name="m.shard_0.weight_scale")
    with pytest.raises(KernelInputError, match=r"m\.shard_0\.weight_scale has no values"):
        reader.finish()
    reader = _reader(_empty())
    reader.add_values(0, _source()[:3], name="m.shard_0.weight")
    with pytest.raises(KernelInputError, match=r"7 rows of \[0, 10\) were in no shard"):
        reader.finish()


@pytest.mark.parametrize(
    ("kind", "tensor", "match"),
    [
        ("scales", torch.zeros(3, 2), r"shape \(3, 2\); allowed: \[rows\] or \[rows, 1\]"),
        ("scales", torch.zeros(3, dtype=torch.float16), "torch.float16; allowed: torch.float32"),
        ("scales", torch.zeros(4), r"shape \(4,\); allowed: \[rows <= 3\]"),
        ("values", torch.zeros(3, DIM + 1, dtype=torch.int8), r"allowed: \[rows <= 3, 6\]"),
        ("values", torch.zeros(3, DIM, dtype=torch.int16), "torch.int16; allowed: torch.int8"),
    ],
)
def test_a_tensor_of_the_wrong_shape_or_dtype_is_refused_by_name(
    kind: str, tensor: torch.Tensor, match: str
) -> None:
    reader = _reader(_empty())
    add = reader.add_scales if kind == "scales" else reader.add_values
    with pytest.raises(KernelInputError, match=rf"^m\.shard_0\.x .*{match}"):
        add(0, tensor, name="m.shard_0.x")


def test_scales_and_values_of_different_rows_and_a_bad_shard_index_are_refused() -> None:
    reader = _reader(_empty())
    reader.add_values(3, torch.zeros(1, DIM, dtype=torch.int8), name="v3")
    reader.add_values(0, torch.zeros(3, DIM, dtype=torch.int8), name="v0")
    with pytest.raises(KernelInputError, match="s0 has 2 rows; v0 has 3"):
        reader.add_scales(0, torch.zeros(2), name="s0")
    with pytest.raises(KernelInputError, match="names shard 4; the checkpoint has shards 0 to 3"):
        reader.add_values(4, torch.zeros(1, DIM, dtype=torch.int8), name="v4")
    reader.add_scales(1, torch.zeros(3), name="s1")
    with pytest.raises(KernelInputError, match="scales go with int8 values"):
        reader.add_values(1, torch.zeros(3, DIM, dtype=torch.bfloat16), name="v1")


def test_a_shard_read_twice_is_refused() -> None:
    reader = _reader(_empty())
    reader.add_values(0, _source()[:3], name="a")
    with pytest.raises(KernelInputError, match=r"b holds rows \[0, 3\) of which some were"):
        reader.add_values(0, _source()[:3], name="b")


def test_loading_a_stream_passes_other_tensors_and_notes_each_table_quantized_at_load() -> None:
    """``load``: the table's shards fill it, every other tensor goes on in order, and a table
    stored as bf16 gets one note once the stream ends (one stored as INT8 rows gets none)."""
    from qsa_kernels.int8_rows import Int8RowShardRouter, Int8RowVocabShard

    source = _source()
    notes: list[str] = []
    for module, stored in (("bf16", None), ("int8", quantize_int8_rows(source))):
        shard = Int8RowVocabShard.zeros(
            rows=ROWS, dim=DIM, vocab_start=0, vocab_end=ROWS, total_rows=ROWS, used_rows=ROWS,
            device=torch.device("cpu"),
        )  # fmt: skip
        size = checkpoint_shard_rows(ROWS, PARTS)
        weights: list[tuple[str, torch.Tensor]] = [("other.weight", torch.ones(2))]
        for i, first in enumerate(range(0, ROWS, size)):
            if stored is None:
                weights.append((f"{module}.shard_{i}.weight", source[first : first + size]))
            else:
                weights.append((f"{module}.shard_{i}.weight", stored.values[first : first + size]))
                weights.append(
                    (f"{module}.shard_{i}.weight_scale", stored.scales[first : first + size])
                )
        router = Int8RowShardRouter({module: shard}, parts=PARTS)
        passed = [name for name, _ in router.load(weights, note=notes.append)]
        assert passed == ["other.weight"]
        assert torch.equal(shard.table.values, quantize_int8_rows(source).values)
    assert len(notes) == 1
    assert notes[0].startswith("INT8-row table bf16 is stored as a 16/32-bit table")
