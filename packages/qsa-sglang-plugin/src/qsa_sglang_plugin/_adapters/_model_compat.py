"""INT8-row PLE tables in SGLang's Qwen4Exp (``ple_embedding_dtype: "int8_row"``).

Three hooks (docs/model-compat.md) hold each PLE n-gram table as a
:class:`qsa_kernels.int8_rows.Int8RowVocabShard`, the only allocation of its size, in the table
module :class:`._ple_table.Int8RowPLEEmbedding` (imported when a hook needs it: it imports SGLang).
"""

from __future__ import annotations

import contextvars
import copy
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from qsa_kernels import KernelInputError
from qsa_kernels.int8_rows import Int8RowPLEOptions, Int8RowShardRouter, Int8RowVocabShard
from qsa_kernels.int8_rows.ple import PINNED_BACKEND
from qsa_sglang_plugin._errors import ConfigurationError, ModelCompatError

__all__ = (
    "around_allocate_ple_host_table",
    "around_ngram_embedding_init",
    "before_load_weights",
)

logger = logging.getLogger(__name__)

#: On while SGLang builds the module an INT8-row table replaces: its host table is metadata only.
_BUILDING_INT8_ROW: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qsa_building_int8_row_ple", default=False
)


def around_ngram_embedding_init(
    original: Callable[..., None], module: Any, config: Any, *args: Any, **kwargs: Any
) -> None:
    """AROUND ``Qwen4ExpNGramEmbedding.__init__``: an INT8-row table for ``int8_row``.

    Upstream builds from a config copy that says offloaded (its table on meta), then the INT8-row
    table replaces it.

    Raises:
        ConfigurationError: ``int8_row`` with a host-table backend other than pinned memory
            (:meth:`Int8RowPLEOptions.of_config`).
    """
    try:
        options = Int8RowPLEOptions.of_config(config)
    except KernelInputError as error:
        raise ConfigurationError(str(error)) from error
    if options is None:
        original(module, config, *args, **kwargs)
        return
    metadata_only = copy.copy(config)
    metadata_only.ple_offload_embedding = True  # upstream then builds its table on meta
    metadata_only.ple_offload_backend = PINNED_BACKEND
    token = _BUILDING_INT8_ROW.set(True)
    try:
        original(module, metadata_only, *args, **kwargs)
    finally:
        _BUILDING_INT8_ROW.reset(token)
    from qsa_sglang_plugin._adapters._ple_table import Int8RowPLEEmbedding

    module.config = config
    sizes = module.ngram_heads_vocab_sizes
    module.ngram_embedding = Int8RowPLEEmbedding(
        module.ngram_embedding,
        offload=options.offload,
        used_rows=int(sizes.sum()) if sizes.numel() else 0,
    )


def around_allocate_ple_host_table(
    original: Callable[..., torch.Tensor], shape: Any, dtype: torch.dtype, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """AROUND ``allocate_ple_host_table``: a meta tensor while an INT8-row table is built."""
    if _BUILDING_INT8_ROW.get():
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    return original(shape, dtype, *args, **kwargs)


def before_load_weights(
    model: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """BEFORE ``Qwen4ExpForConditionalGeneration.load_weights``: shards to INT8-row tables.

    None (SGLang's call unchanged) without an INT8-row table.
    """
    from qsa_sglang_plugin._adapters._ple_table import Int8RowPLEEmbedding

    tables: dict[str, Int8RowVocabShard] = {
        name: module.shard
        for name, module in model.named_modules()
        if isinstance(module, Int8RowPLEEmbedding)
    }
    if not tables:
        return None
    text_config = getattr(model.config, "text_config", model.config)
    parts = Int8RowPLEOptions.shard_parts(text_config)
    if "weights" in kwargs:
        kwargs = {**kwargs, "weights": _route_ple_shards(kwargs["weights"], tables, parts)}
    else:
        args = (_route_ple_shards(args[0], tables, parts), *args[1:])
    return (model, *args), kwargs


def _sglang_name(name: str) -> str:
    return name.replace("model.language_model.", "model.")  # as Qwen4Exp's load_weights does


def _route_ple_shards(
    weights: Iterable[tuple[str, torch.Tensor]], tables: dict[str, Int8RowVocabShard], parts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """:meth:`Int8RowShardRouter.route` under SGLang's names, then its ``finish``.

    Once the weights are read, one line per table that read shards says what it read and where
    the table lives (an operator's proof that the INT8-row table was loaded, and offloaded), and a
    table stored as a 16/32-bit table gets the library's note that it was quantized at load.

    Raises:
        ModelCompatError: a malformed shard (the library's message, with the tensor's name).
    """
    router = Int8RowShardRouter(tables, parts=parts, rename=_sglang_name)
    try:
        yield from router.route(weights)
        summaries = router.finish()
    except KernelInputError as error:
        raise ModelCompatError(f"INT8-row PLE checkpoint: {error}") from error
    for module, summary in summaries.items():
        values = tables[module].table.values
        where = "pinned host memory" if values.is_pinned() else str(values.device)
        logger.info(
            "PLE: INT8-row table %s read: %d rows from %d int8 shards and %d 16/32-bit shards, "
            "in %s",
            module,
            summary.rows,
            summary.int8_shards,
            summary.quantized_shards,
            where,
        )
        note = summary.quantized_note(module)
        if note is not None:
            logger.info("PLE: %s", note)
