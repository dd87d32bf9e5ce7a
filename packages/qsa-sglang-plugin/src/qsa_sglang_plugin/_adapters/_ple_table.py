"""The INT8-row PLE table module: SGLang's ``Qwen4ExpPinnedHostEmbedding`` over an INT8-row shard.

Imported only when SGLang builds or loads a Qwen4Exp model (the hooks of :mod:`._model_compat`),
so importing the plugin never imports SGLang.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.models.qwen4_exp import Qwen4ExpPinnedHostEmbedding
from torch import nn

from qsa_kernels.int8_rows import Int8RowVocabShard

__all__ = ("Int8RowPLEEmbedding",)


class Int8RowPLEEmbedding(Qwen4ExpPinnedHostEmbedding):
    """:attr:`shard` (zero until loaded), the built module's metadata, upstream's forward.

    ``built`` is the ``Qwen4ExpPinnedHostEmbedding`` SGLang built with its table on the meta
    device; ``offload`` puts the shard in pinned host memory; ``used_rows`` are the vocabulary
    rows the n-gram heads read (the rest of the shard is padding).
    """

    def __init__(self, built: Any, *, offload: bool, used_rows: int) -> None:
        nn.Module.__init__(self)
        for name in self._COPIED_ATTRIBUTES:
            setattr(self, name, getattr(built, name))
        self.quant_method = None  # no SGLang post-load step applies to this table
        self._file_prefetcher = None
        self._file_rss_trimmer = None
        self.register_buffer("weight_scale", built.weight_scale, persistent=True)
        self.shard = Int8RowVocabShard.zeros(
            rows=int(self.num_embeddings_per_partition),
            dim=int(self.embedding_dim),
            vocab_start=int(self.shard_indices.org_vocab_start_index),
            vocab_end=int(self.shard_indices.org_vocab_end_index),
            total_rows=int(self.org_vocab_size),
            used_rows=used_rows,
            device=torch.device("cpu") if offload else built.weight_scale.device,
            pinned=offload,
        )

    def gather(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[*input_ids.shape, D]`` bf16: this rank's rows, zeros for other ranks' ids."""
        if out is None:
            out = self.allocate_output((*input_ids.shape, self.embedding_dim), input_ids.device)
        return self.shard.gather(input_ids, out=out) if input_ids.numel() else out

    def extra_repr(self) -> str:
        pinned = self.shard.table.values.is_pinned()
        return f"int8_row, {super().extra_repr()}, pinned={pinned}"
