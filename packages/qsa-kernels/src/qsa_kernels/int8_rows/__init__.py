"""INT8-row embedding tables and their row gather (Triton kernel and torch reference).

The format (``int8`` values, one ``float32`` scale per row), its quantizer and the gather's
reference: :mod:`qsa_kernels.int8_rows.reference`; the kernel that reads the named rows where the
table lives, pinned host memory included: :mod:`qsa_kernels.int8_rows.triton`.
"""

from qsa_kernels.int8_rows.reference import (
    Int8RowTable,
    dequantize_int8_rows_reference,
    gather_int8_rows_reference,
    quantize_int8_rows,
)
from qsa_kernels.int8_rows.triton import gather_int8_rows

__all__ = (
    "Int8RowTable",
    "dequantize_int8_rows_reference",
    "gather_int8_rows",
    "gather_int8_rows_reference",
    "quantize_int8_rows",
)
