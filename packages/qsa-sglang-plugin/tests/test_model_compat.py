"""INT8-row PLE loading without an engine: the shards routed to the table, malformed ones refused.

``_route_ple_shards`` is what the BEFORE hook on ``load_weights`` hands SGLang instead of its
weights; here it runs over a table's vocabulary shard (what the hook takes from each table module)
and a checkpoint written as SGLang's loader would yield it (``model.language_model.`` names).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from qsa_kernels.int8_rows import (
    Int8RowTable,
    Int8RowVocabShard,
    checkpoint_shard_rows,
    quantize_int8_rows,
)
from qsa_sglang_plugin._adapters._model_compat import (
    _route_ple_shards,
    around_ngram_embedding_init,
)
from qsa_sglang_plugin._errors import ConfigurationError, ModelCompatError

MODULE = "model.layers.1.ple.ple_embedding.ngram_embedding"
STORED = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"
ROWS, USED, DIM, PARTS = 24, 21, 4, 4


def _fake() -> Int8RowVocabShard:
    return Int8RowVocabShard.zeros(
        rows=ROWS,
        dim=DIM,
        vocab_start=0,
        vocab_end=ROWS,
        total_rows=ROWS,
        used_rows=USED,
        device=torch.device("cpu"),
    )


def _checkpoint(table: Int8RowTable, *, drop: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    yield "model.language_model.layers.0.mlp.gate.weight", torch.ones(2)
    size = checkpoint_shard_rows(ROWS, PARTS)
    for shard, first in enumerate(range(0, ROWS, size)):
        names = {
            f"{STORED}.shard_{shard}.weight": table.values[first : first + size],
            f"{STORED}.shard_{shard}.weight_scale": table.scales[first : first + size],
        }
        for name, tensor in names.items():
            if name != drop:
                yield name, tensor


def _source() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)


def test_int8_shards_fill_the_table_and_every_other_tensor_goes_on() -> None:
    stored = quantize_int8_rows(_source())
    fake = _fake()
    passed = list(_route_ple_shards(_checkpoint(stored), {MODULE: fake}, PARTS))
    assert [name for name, _ in passed] == ["model.language_model.layers.0.mlp.gate.weight"]
    assert torch.equal(fake.table.values[:USED], stored.values[:USED])
    assert torch.equal(fake.table.scales[:USED], stored.scales[:USED])
    assert not fake.table.values[USED:].any()  # padding rows are never read


def test_each_table_read_logs_what_it_read_and_where_it_lives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stored = quantize_int8_rows(_source())
    with caplog.at_level(logging.INFO):
        list(_route_ple_shards(_checkpoint(stored), {MODULE: _fake()}, PARTS))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("PLE: ")]
    assert lines == [
        f"PLE: INT8-row table {MODULE} read: {USED} rows from {PARTS} int8 shards and 0 "
        "16/32-bit shards, in cpu"
    ]


def test_a_bf16_table_is_quantized_with_one_note(caplog: pytest.LogCaptureFixture) -> None:
    source = _source()
    fake = _fake()
    size = checkpoint_shard_rows(ROWS, PARTS)
    weights = [
        (f"{STORED}.shard_{shard}.weight", source[first : first + size])
        for shard, first in enumerate(range(0, ROWS, size))
    ]
    with caplog.at_level(logging.INFO):
        assert list(_route_ple_shards(iter(weights), {MODULE: fake}, PARTS)) == []
    notes = [r for r in caplog.records if "quantized to INT8 rows at load" in r.getMessage()]
    assert len(notes) == 1
    assert torch.equal(fake.table.values[:USED], quantize_int8_rows(source).values[:USED])


def test_missing_scales_are_refused_by_name() -> None:
    weights = _checkpoint(quantize_int8_rows(_source()), drop=f"{STORED}.shard_2.weight_scale")
    with pytest.raises(
        ModelCompatError, match=rf"{STORED}\.shard_2\.weight is int8 but its scales"
    ):
        list(_route_ple_shards(weights, {MODULE: _fake()}, PARTS))


def test_scales_of_the_wrong_shape_are_refused_with_the_values() -> None:
    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        yield f"{STORED}.shard_0.weight_scale", torch.ones(6, 2)

    with pytest.raises(
        ModelCompatError, match=r"shard_0\.weight_scale has shape \(6, 2\); allowed: \[rows\]"
    ):
        list(_route_ple_shards(weights(), {MODULE: _fake()}, PARTS))


def _never_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("SGLang's constructor must not run")


def test_int8_row_with_the_file_backend_is_refused_before_sglang_builds_a_table() -> None:
    config = SimpleNamespace(
        ple_embedding_dtype="int8_row", ple_offload_embedding=True, ple_offload_backend="file"
    )
    with pytest.raises(ConfigurationError, match="ple_offload_backend='file'"):
        around_ngram_embedding_init(_never_called, SimpleNamespace(), config, 64)


def test_other_dtypes_are_left_to_sglang() -> None:
    calls: list[tuple[object, ...]] = []
    module = SimpleNamespace()
    config = SimpleNamespace(ple_embedding_dtype="float8_e4m3fn", ple_offload_embedding=False)
    around_ngram_embedding_init(lambda *args, **kw: calls.append((*args, kw)), module, config, 64)
    assert calls == [(module, config, 64, {})]  # the same config object, nothing replaced
