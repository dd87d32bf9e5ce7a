"""INT8-row embedding tables and their row gather (Triton kernel and torch reference).

The format (``int8`` values, one ``float32`` scale per row), its quantizer and the gather's
reference: :mod:`qsa_kernels.int8_rows.reference`; the kernel that reads the named rows where the
table lives, pinned host memory included: :mod:`qsa_kernels.int8_rows.triton`; reading a table
from a checkpoint's row shards (int8 values and scales as stored, or a 16/32-bit table quantized
as it is read, and routing a model's weight stream into its tables):
:mod:`qsa_kernels.int8_rows.checkpoint`; one tensor-parallel rank's vocabulary shard of a table,
allocated once and gathered on its device's path: :mod:`qsa_kernels.int8_rows.shard`; what a
model's text config asks of its INT8-row PLE tables: :mod:`qsa_kernels.int8_rows.ple`.
"""

from qsa_kernels.int8_rows.checkpoint import (
    Int8RowShardReader,
    Int8RowShardRouter,
    Int8RowShardSummary,
    checkpoint_shard_rows,
)
from qsa_kernels.int8_rows.ple import Int8RowPLEOptions
from qsa_kernels.int8_rows.reference import (
    Int8RowTable,
    dequantize_int8_rows_reference,
    gather_int8_rows_reference,
    quantize_int8_rows,
)
from qsa_kernels.int8_rows.shard import Int8RowVocabShard
from qsa_kernels.int8_rows.triton import gather_int8_rows

__all__ = (
    "Int8RowPLEOptions",
    "Int8RowShardReader",
    "Int8RowShardRouter",
    "Int8RowShardSummary",
    "Int8RowTable",
    "Int8RowVocabShard",
    "checkpoint_shard_rows",
    "dequantize_int8_rows_reference",
    "gather_int8_rows",
    "gather_int8_rows_reference",
    "quantize_int8_rows",
)
