"""Real weights for a tiny model's PLE table, written at test time as a safetensors checkpoint.

The tiny models' other weights are SGLang's seeded dummy weights (``load_format="dummy"``); a
checkpoint written here holds only the PLE n-gram table, in the layout SGLang's Qwen4Exp loader
reads: ``split_ngram_parts`` row shards named
``model.language_model.layers.<l>.ple.ple_embedding.ngram_embedding.shard_<i>.weight``, and in
the INT8-row format a ``.weight_scale`` beside each (:mod:`qsa_kernels.int8_rows`). An engine
reads it with ``/update_weights_from_disk`` (``load_format="auto"``: SGLang's default loader and
the model's ``load_weights``), so two engines of the same seed differ in the table alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

import sympy  # type: ignore[import-untyped]
import torch
from safetensors.torch import save_file

from qsa_kernels.int8_rows import Int8RowTable, checkpoint_shard_rows
from qsa_testing._errors import ModelSpecError
from qsa_testing._models import TinyModel

__all__ = ("PleTableShape", "ple_table_shape", "write_ple_checkpoint")

#: SGLang's defaults for what a Qwen4Exp text config may leave out.
_DEFAULTS: Final = {
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 512,
}
_CHECKPOINT_FILE: Final = "ple.safetensors"


@dataclass(frozen=True, slots=True)
class PleTableShape:
    """The first PLE layer's n-gram table, as SGLang 0.5.23 sizes it.

    Attributes:
        prefix: the checkpoint's name of the table module, before ``.shard_<i>.weight``.
        rows: the table's rows (padded; the checkpoint's shards cover them).
        used_rows: rows an n-gram id can name (the rest is padding).
        dim: values per row (the PLE width over the n-gram heads).
        parts: checkpoint shards.
    """

    prefix: str
    rows: int
    used_rows: int
    dim: int
    parts: int


def ple_table_shape(model: TinyModel) -> PleTableShape:
    """The table of ``model``'s first PLE layer (SGLang's ``Qwen4ExpNGramEmbedding`` sizing).

    Raises:
        ModelSpecError: the model has no PLE layer.
    """
    text = dict(model.text_config)
    layers = sorted(text.get("ple_layer_ids") or ())
    if not layers:
        msg = f"{model.name!r} has no PLE layer"
        raise ModelSpecError(msg)
    get = {key: int(text.get(key, default)) for key, default in _DEFAULTS.items()}
    heads = (get["ngram_size"] - 1) * get["heads_per_ngram"]
    dim = int(text.get("ple_embed_dim") or text["hidden_size"]) // heads
    prime = int(text["ngram_vocab_size_base"]) - 1
    used = 0
    for _ in range(heads):  # the first PLE layer's heads: the first ``heads`` primes
        prime = int(sympy.nextprime(prime))
        used += prime
    step = get["make_ngram_vocab_size_divisible_by"]
    return PleTableShape(
        prefix=(f"model.language_model.layers.{layers[0] - 1}.ple.ple_embedding.ngram_embedding"),
        rows=-(-used // step) * step,
        used_rows=used,
        dim=dim,
        parts=get["split_ngram_parts"],
    )


def write_ple_checkpoint(
    directory: Path, model: TinyModel, table: torch.Tensor | Int8RowTable
) -> Path:
    """Write ``model``'s files and its PLE table's shards in ``<directory>/<name>/``; return it.

    Args:
        directory: created if absent.
        model: its files (:meth:`TinyModel.write`) are written beside the checkpoint.
        table: ``[rows, dim]`` as :func:`ple_table_shape` says: a bf16/fp16/fp32 tensor
            (``.weight`` shards), or an INT8-row table (``.weight`` int8 and ``.weight_scale``
            ``[rows]`` float32 shards).

    Raises:
        ModelSpecError: ``table`` of another shape.
    """
    shape = ple_table_shape(model)
    values = table.values if isinstance(table, Int8RowTable) else table
    if tuple(values.shape) != (shape.rows, shape.dim):
        msg = f"table is {tuple(values.shape)!r}; {model.name!r} needs ({shape.rows}, {shape.dim})"
        raise ModelSpecError(msg)
    size = checkpoint_shard_rows(shape.rows, shape.parts)
    tensors: dict[str, torch.Tensor] = {}
    for shard, first in enumerate(range(0, shape.rows, size)):
        rows = slice(first, first + size)
        tensors[f"{shape.prefix}.shard_{shard}.weight"] = values[rows].contiguous()
        if isinstance(table, Int8RowTable):
            tensors[f"{shape.prefix}.shard_{shard}.weight_scale"] = table.scales[rows].contiguous()
    path = model.write(directory)
    save_file(tensors, str(path / _CHECKPOINT_FILE))
    return path
