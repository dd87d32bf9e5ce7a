"""A model's PLE n-gram tables as INT8-row tables: the text config's options, checked.

A Qwen4Exp-style text config selects INT8-row PLE tables with ``ple_embedding_dtype:
"int8_row"``; ``ple_offload_embedding`` keeps them in host memory, which must be pinned
(``ple_offload_backend: "pinned"``, the default: :func:`~qsa_kernels.int8_rows.gather_int8_rows`
reads the rows where the table lives), and ``split_ngram_parts`` says how many row shards a
checkpoint stores each table in (:func:`~qsa_kernels.int8_rows.checkpoint_shard_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from qsa_kernels._errors import KernelInputError

__all__ = ("INT8_ROW", "Int8RowPLEOptions")

#: The text config's ``ple_embedding_dtype`` that selects INT8-row tables.
INT8_ROW: Final = "int8_row"
#: Checkpoint row shards of a PLE table when the config does not say (``split_ngram_parts``).
DEFAULT_SHARD_PARTS: Final = 512
#: The only host-table backend an INT8-row table supports (``ple_offload_backend``).
PINNED_BACKEND: Final = "pinned"


@dataclass(frozen=True, slots=True)
class Int8RowPLEOptions:
    """What a text config asks of its INT8-row PLE tables.

    Attributes:
        offload: the tables live in pinned host memory (else on the device).
    """

    offload: bool

    @classmethod
    def of_config(cls, config: Any) -> Int8RowPLEOptions | None:
        """The options of a config (attributes as an HF config has them); None unless INT8-row.

        Raises:
            KernelInputError: an offloaded INT8-row table with a host backend other than
                pinned memory (naming ``ple_offload_backend`` and its value).
        """
        if getattr(config, "ple_embedding_dtype", None) != INT8_ROW:
            return None
        offload = bool(config.ple_offload_embedding)
        backend = getattr(config, "ple_offload_backend", PINNED_BACKEND)
        if offload and backend != PINNED_BACKEND:
            msg = (
                f'ple_embedding_dtype="{INT8_ROW}" with ple_offload_backend={backend!r}; an '
                f"INT8-row table is held in {PINNED_BACKEND!r} host memory only"
            )
            raise KernelInputError(msg)
        return cls(offload)

    @staticmethod
    def shard_parts(config: Any) -> int:
        """Checkpoint row shards of each table (``split_ngram_parts``, default 512)."""
        return int(getattr(config, "split_ngram_parts", DEFAULT_SHARD_PARTS))
