"""INT8-row PLE tables in SGLang's Qwen4Exp (``ple_embedding_dtype: "int8_row"``).

SGLang 0.5.23 keeps the PLE n-gram table in bf16 or fp8. With ``SGLANG_QSA_MODEL_COMPAT=1`` and
``"ple_embedding_dtype": "int8_row"`` in the text config, two hooks hold it as a
:class:`qsa_kernels.int8_rows.Int8RowTable` instead:

* AFTER ``Qwen4ExpNGramEmbedding.__init__``: the table module SGLang built (a
  ``VocabParallelEmbedding``, or with ``--ple-offload-embedding`` its pinned-host one) is replaced
  by :class:`Int8RowPLEEmbedding` of the same vocabulary shard: ``int8`` rows and ``float32``
  scales on the model's device, or in pinned host memory when offloaded, its rows gathered by
  :func:`qsa_kernels.int8_rows.gather_int8_rows` (its torch reference on CPU).
* BEFORE ``Qwen4ExpForConditionalGeneration.load_weights``: the PLE shards of such a table are
  taken out of the weights SGLang reads (their scales have no SGLang parameter to load into) and
  given to :class:`qsa_kernels.int8_rows.Int8RowShardReader`; every other tensor goes on to
  SGLang. The tensor names (after SGLang's ``model.language_model.`` to ``model.``):
  ``<module>.ngram_embedding.shard_<i>.weight`` (``[rows, D]`` int8, or a bf16/fp16/fp32 table,
  quantized at load with one logged note) and ``<module>.ngram_embedding.shard_<i>.weight_scale``
  (``[rows]`` or ``[rows, 1]`` float32, beside int8 values only).

Translation only: the format, its reader and its gather are in :mod:`qsa_kernels.int8_rows`.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any, Final

import torch

from qsa_kernels import KernelInputError, KernelPath
from qsa_kernels.int8_rows import (
    Int8RowShardReader,
    Int8RowTable,
    gather_int8_rows,
    gather_int8_rows_reference,
)
from qsa_sglang_plugin._errors import ConfigurationError, ModelCompatError

__all__ = (
    "INT8_ROW",
    "after_ngram_embedding_init",
    "before_load_weights",
    "int8_row_embedding_class",
)

logger = logging.getLogger(__name__)

#: The text config's ``ple_embedding_dtype`` that selects INT8-row tables.
INT8_ROW: Final = "int8_row"
#: SGLang's default number of checkpoint row shards of a PLE table (``split_ngram_parts``).
_DEFAULT_SHARD_PARTS: Final = 512
#: The only host-table backend an INT8-row table supports (upstream's ``ple_offload_backend``).
_PINNED_BACKEND: Final = "pinned"
_SHARD_NAME: Final = re.compile(
    r"^(?P<module>.+\.ngram_embedding)\.shard_(?P<shard>\d+)\.(?P<kind>weight|weight_scale)$"
)
_VALUES_KIND: Final = "weight"


@functools.cache
def int8_row_embedding_class() -> type:
    """The table module class (a subclass of SGLang's ``Qwen4ExpPinnedHostEmbedding``).

    Defined on first use, so importing this module imports no SGLang model.
    """
    from sglang.srt.models.qwen4_exp import Qwen4ExpPinnedHostEmbedding
    from torch import nn

    class Int8RowPLEEmbedding(Qwen4ExpPinnedHostEmbedding):  # type: ignore[misc]
        """One vocabulary shard of a PLE table as INT8 rows.

        Takes the metadata of the module SGLang built (``shard_indices``, ``tp_size``,
        ``embedding_dim``...), never its weight; keeps upstream's ``reduce``,
        ``allocate_output`` and ``forward``, and gathers bf16 rows from :attr:`table`.

        Attributes:
            table: ``values [num_embeddings_per_partition, D]`` int8 and ``scales [..]`` float32,
                zero until loaded; on the model's device, or pinned host memory when offloaded.
            total_rows: rows of the whole table across ranks (the checkpoint's shards cover them).
            used_rows: rows an n-gram id can name (the rest is padding).
        """

        def __init__(self, embedding: Any, *, offload: bool, used_rows: int) -> None:
            nn.Module.__init__(self)
            for name in self._COPIED_ATTRIBUTES:
                setattr(self, name, getattr(embedding, name))
            self.quant_method = None  # no SGLang post-load step applies to this table
            self._file_prefetcher = None
            self._file_rss_trimmer = None
            self.register_buffer("weight_scale", embedding.weight_scale, persistent=True)
            rows, dim = int(self.num_embeddings_per_partition), int(self.embedding_dim)
            device = torch.device("cpu") if offload else embedding.weight.device
            table = Int8RowTable(
                torch.zeros(rows, dim, dtype=torch.int8, device=device),
                torch.zeros(rows, dtype=torch.float32, device=device),
            )
            self.table = table.pin() if offload and torch.cuda.is_available() else table
            self.total_rows = int(self.org_vocab_size)
            self.used_rows = used_rows

        @property
        def vocab_start(self) -> int:
            """The first global row this rank holds."""
            return int(self.shard_indices.org_vocab_start_index)

        @property
        def vocab_end(self) -> int:
            """One past the last global row this rank holds."""
            return int(self.shard_indices.org_vocab_end_index)

        def gather(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            """``[*input_ids.shape, D]`` bf16: this rank's rows, zeros for other ranks' ids."""
            if out is None:
                out = self.allocate_output((*input_ids.shape, self.embedding_dim), input_ids.device)
            if input_ids.numel() == 0:
                return out
            bounds = {"vocab_start": self.vocab_start, "vocab_end": self.vocab_end}
            if KernelPath.AUTO.resolve(input_ids.device) is KernelPath.TRITON:
                return gather_int8_rows(self.table, input_ids, out=out, **bounds)
            out.copy_(gather_int8_rows_reference(self.table, input_ids, **bounds))
            return out

        def extra_repr(self) -> str:
            return f"int8_row, {super().extra_repr()}, pinned={self.table.values.is_pinned()}"

    return Int8RowPLEEmbedding


def after_ngram_embedding_init(
    result: None, module: Any, config: Any, *args: Any, **kwargs: Any
) -> None:
    """AFTER hook on ``Qwen4ExpNGramEmbedding.__init__``: an INT8-row table for ``int8_row``.

    Raises:
        ConfigurationError: ``int8_row`` with a host-table backend other than pinned memory.
    """
    del result, args, kwargs
    if getattr(config, "ple_embedding_dtype", None) != INT8_ROW:
        return
    offload = bool(config.ple_offload_embedding)
    backend = getattr(config, "ple_offload_backend", _PINNED_BACKEND)
    if offload and backend != _PINNED_BACKEND:
        msg = (
            f'ple_embedding_dtype="{INT8_ROW}" with ple_offload_backend={backend!r}; an INT8-row '
            f"table is held in {_PINNED_BACKEND!r} host memory only"
        )
        raise ConfigurationError(msg)
    sizes = module.ngram_heads_vocab_sizes
    used_rows = int(sizes.sum()) if sizes.numel() else 0
    module.ngram_embedding = int8_row_embedding_class()(
        module.ngram_embedding, offload=offload, used_rows=used_rows
    )


def before_load_weights(
    model: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """BEFORE hook on ``Qwen4ExpForConditionalGeneration.load_weights(weights)``.

    Returns None (SGLang's call unchanged) when the model holds no INT8-row table; else the call
    with ``weights`` replaced by :func:`_route_ple_shards` over them.
    """
    embedding_class = int8_row_embedding_class()
    tables = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, embedding_class)
    }
    if not tables:
        return None
    text_config = getattr(model.config, "text_config", model.config)
    parts = int(getattr(text_config, "split_ngram_parts", _DEFAULT_SHARD_PARTS))
    if "weights" in kwargs:
        kwargs = {**kwargs, "weights": _route_ple_shards(kwargs["weights"], tables, parts)}
    else:
        args = (_route_ple_shards(args[0], tables, parts), *args[1:])
    return (model, *args), kwargs


def _route_ple_shards(
    weights: Iterable[tuple[str, torch.Tensor]], tables: dict[str, Any], parts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor but the INT8-row tables' shards, in order; those fill the tables.

    Raises:
        ModelCompatError: a malformed shard (the reader's message, with the tensor's name).
    """
    readers: dict[str, Int8RowShardReader] = {}
    for name, tensor in weights:
        match = _SHARD_NAME.match(name.replace("model.language_model.", "model."))
        module = tables.get(match["module"]) if match else None
        if match is None or module is None:
            yield name, tensor
            continue
        # Rows past the n-gram ids' range are padding, never named by an id: they stay zero.
        needed_end = min(module.vocab_end, module.used_rows)
        if needed_end <= module.vocab_start:
            continue  # this rank holds padding rows only
        try:
            reader = readers.get(match["module"])
            if reader is None:
                reader = readers[match["module"]] = Int8RowShardReader(
                    module.table,
                    total_rows=module.total_rows,
                    parts=parts,
                    vocab_start=module.vocab_start,
                    vocab_end=needed_end,
                )
            if match["kind"] == _VALUES_KIND:
                reader.add_values(int(match["shard"]), tensor, name=name)
            else:
                reader.add_scales(int(match["shard"]), tensor, name=name)
        except KernelInputError as error:
            raise ModelCompatError(f"INT8-row PLE checkpoint: {error}") from error
    for module_name, reader in readers.items():
        try:
            summary = reader.finish()
        except KernelInputError as error:
            raise ModelCompatError(f"INT8-row PLE checkpoint: {error}") from error
        if summary.quantized_shards:
            logger.info(
                "INT8-row PLE: %s is stored as a 16/32-bit table in the checkpoint; %d shards "
                "quantized to INT8 rows at load (%d rows)",
                module_name,
                summary.quantized_shards,
                summary.rows,
            )
