"""The tiny Qwen4Exp's PLE table: its shape as SGLang sizes it, and its checkpoint's shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qsa_kernels.int8_rows import quantize_int8_rows
from qsa_testing import (
    ModelSpecError,
    ple_table_shape,
    tiny_llama,
    tiny_qwen4_exp,
    write_ple_checkpoint,
)

QWEN = tiny_qwen4_exp()


def test_the_tiny_table_is_sixteen_heads_of_primes_after_1000() -> None:
    shape = ple_table_shape(QWEN)
    # 2 n-gram orders x 8 heads; the first 16 primes after 999 (1009 ... 1097) sum to 16,826.
    assert (shape.used_rows, shape.rows, shape.dim, shape.parts) == (16_826, 16_896, 4, 512)
    assert shape.prefix == "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"


def test_a_model_without_ple_is_refused() -> None:
    with pytest.raises(ModelSpecError, match="has no PLE layer"):
        ple_table_shape(tiny_llama())


def test_an_int8_row_checkpoint_holds_every_row_in_its_shards(tmp_path: Path) -> None:
    shape = ple_table_shape(QWEN)
    source = torch.randn(shape.rows, shape.dim, generator=torch.Generator().manual_seed(0))
    table = quantize_int8_rows(source)
    path = write_ple_checkpoint(tmp_path, QWEN, table)
    assert (path / "config.json").exists()
    tensors = load_file(str(path / "ple.safetensors"))
    assert len(tensors) == 2 * shape.parts
    values = torch.cat([tensors[f"{shape.prefix}.shard_{i}.weight"] for i in range(shape.parts)])
    scales = torch.cat(
        [tensors[f"{shape.prefix}.shard_{i}.weight_scale"] for i in range(shape.parts)]
    )
    assert torch.equal(values, table.values)
    assert torch.equal(scales, table.scales)


def test_a_table_of_another_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match=r"table is \(3, 4\)"):
        write_ple_checkpoint(tmp_path, QWEN, torch.zeros(3, 4))
