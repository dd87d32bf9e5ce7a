"""Shared fixtures: a tiny QSA checkpoint config SGLang can resolve on CPU, the production
command's model made small, and real engines.

``engines`` (from :mod:`qsa_testing.pytest_plugin`) shares one SGLang server per configuration
across the session; see docs/testing.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from qsa_testing import ple_table_shape, tiny_qwen4_exp, write_ple_checkpoint

# Wall-clock deadlines are meaningless on a shared 2-core CI machine; examples must still pass.
settings.register_profile("qsa", deadline=None)
settings.load_profile("qsa")

pytest_plugins = ["qsa_testing.pytest_plugin"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``config.json`` of a tiny Qwen4Exp with the real QSA layer geometry and 262,144 positions."""
    model = tiny_qwen4_exp(model_shaped=True, max_position_embeddings=262_144)
    return model.write(tmp_path_factory.mktemp("tiny-qwen4-exp"))


@pytest.fixture(scope="session")
def production_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The production command's model made small: the model-shaped tiny Qwen4Exp (262,144
    positions, one PLE layer) with an INT8-row PLE table beside its ``config.json``.

    The table is a seeded random bf16 table quantized to INT8 rows (int8 values and float32
    scales, in SGLang's row shards; :func:`qsa_testing.write_ple_checkpoint`).
    """
    import torch

    from qsa_kernels.int8_rows import quantize_int8_rows

    model = tiny_qwen4_exp(model_shaped=True, max_position_embeddings=262_144)
    shape = ple_table_shape(model)
    source = torch.randn(shape.rows, shape.dim, generator=torch.Generator().manual_seed(0))
    table = quantize_int8_rows(source.to(torch.bfloat16))
    return write_ple_checkpoint(tmp_path_factory.mktemp("production"), model, table)
