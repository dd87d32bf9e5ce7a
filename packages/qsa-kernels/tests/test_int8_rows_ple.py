"""What a model's text config asks of its INT8-row PLE tables: the dtype, host memory, shards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from qsa_kernels import KernelInputError
from qsa_kernels.int8_rows import Int8RowPLEOptions


@pytest.mark.parametrize(
    ("fields", "offload"),
    [
        ({"ple_offload_embedding": False}, False),
        ({"ple_offload_embedding": True}, True),  # the backend defaults to pinned memory
        ({"ple_offload_embedding": True, "ple_offload_backend": "pinned"}, True),
        ({"ple_offload_embedding": False, "ple_offload_backend": "file"}, False),  # not read
    ],
)
def test_an_int8_row_config_gives_its_tables_place(
    fields: dict[str, object], offload: bool
) -> None:
    """``int8_row``: on the device, or in pinned host memory when offloaded."""
    config = SimpleNamespace(ple_embedding_dtype="int8_row", **fields)
    assert Int8RowPLEOptions.of_config(config) == Int8RowPLEOptions(offload=offload)


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float8_e4m3fn", "INT8_ROW"])
def test_other_dtypes_ask_nothing(dtype: str | None) -> None:
    """Any other ``ple_embedding_dtype`` (or none) is not an INT8-row table."""
    config = SimpleNamespace(ple_offload_embedding=True, ple_offload_backend="file")
    if dtype is not None:
        config.ple_embedding_dtype = dtype
    assert Int8RowPLEOptions.of_config(config) is None


def test_an_offloaded_table_on_another_host_backend_is_refused_by_name() -> None:
    """Only pinned memory holds an offloaded INT8-row table: the backend is named."""
    config = SimpleNamespace(
        ple_embedding_dtype="int8_row", ple_offload_embedding=True, ple_offload_backend="file"
    )
    with pytest.raises(KernelInputError, match=r"ple_offload_backend='file'.*'pinned'"):
        Int8RowPLEOptions.of_config(config)


def test_shard_parts_default_to_512() -> None:
    """``split_ngram_parts`` when given, else 512."""
    assert Int8RowPLEOptions.shard_parts(SimpleNamespace()) == 512
    assert Int8RowPLEOptions.shard_parts(SimpleNamespace(split_ngram_parts=4)) == 4
