"""INT8-row PLE tables in a real SGLang 0.5.23 engine (``SGLANG_QSA_MODEL_COMPAT=1``).

The tiny Qwen4Exp carries one PLE layer. A random bf16 table is quantized to INT8 rows
(:func:`qsa_kernels.int8_rows.quantize_int8_rows`), and two checkpoints of its PLE table are
written at test time in SGLang's row-shard layout: the INT8-row one (``.weight`` int8 and
``.weight_scale`` float32 per shard) and the dequantized bf16 one. Two engines of the same seed
(the rest of the model is SGLang's seeded dummy weights) read them with
``/update_weights_from_disk`` (``load_format="auto"``: SGLang's default loader, the safetensors
reader and the model's ``load_weights``):

- the plugin engine with ``"ple_embedding_dtype": "int8_row"`` reads the INT8-row checkpoint as
  stored and answers as upstream SGLang serving the dequantized bf16 table (token ids equal,
  logprobs bit for bit: the gathered rows are the dequantized table's);
- the table matters: before it is read (zeros) the same engine answers otherwise;
- the bf16 checkpoint given to the INT8-row engine is quantized at load, with one logged note,
  and answers as upstream within one bf16 step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from qsa_kernels.int8_rows import dequantize_int8_rows_reference, quantize_int8_rows
from qsa_testing import (
    BF16_LOGIT_STEP,
    EngineConfig,
    EnginePool,
    GenerateRequest,
    Generation,
    assert_same_generation,
    ple_table_shape,
    tiny_qwen4_exp,
    write_ple_checkpoint,
)

QWEN = tiny_qwen4_exp()
SHAPE = ple_table_shape(QWEN)
INT8_ROW = EngineConfig(
    QWEN,
    switches={"SGLANG_QSA_MODEL_COMPAT": "1"},
    server_args={
        "json_model_override_args": json.dumps({"text_config": {"ple_embedding_dtype": "int8_row"}})
    },
)
#: Upstream serving the same model; a replica of its own, since its weights change here.
UPSTREAM = EngineConfig(QWEN, plugin=False, replica=38)
REQUESTS = (
    GenerateRequest(QWEN.prompt(300, seed=38)),
    GenerateRequest(QWEN.prompt(41, seed=39)),
)
QUANTIZED_NOTE = "quantized to INT8 rows at load"


@dataclass(frozen=True, slots=True)
class Served:
    """What the two engines answered (one generation per request of :data:`REQUESTS`)."""

    zero_table: tuple[Generation, ...]
    int8_rows: tuple[Generation, ...]
    quantized_at_load: tuple[Generation, ...]
    upstream: tuple[Generation, ...]
    int8_log: str


def _update(engine_pool: EnginePool, config: EngineConfig, checkpoint: Path) -> None:
    reply = engine_pool.engine(config).post_json(
        "/update_weights_from_disk", {"model_path": str(checkpoint), "load_format": "auto"}
    )
    assert reply["success"] is True, reply


def _answers(engine_pool: EnginePool, config: EngineConfig) -> tuple[Generation, ...]:
    engine = engine_pool.engine(config)
    return tuple(engine.generate(request) for request in REQUESTS)


@pytest.fixture(scope="module")
def served(engines: EnginePool, tmp_path_factory: pytest.TempPathFactory) -> Served:
    """Both engines' answers; each engine starts once."""
    root = tmp_path_factory.mktemp("ple-checkpoints")
    source = torch.randn(SHAPE.rows, SHAPE.dim, generator=torch.Generator().manual_seed(38))
    table = quantize_int8_rows(source.to(torch.bfloat16))
    dequantized = dequantize_int8_rows_reference(table)
    int8_dir = write_ple_checkpoint(root / "int8", QWEN, table)
    bf16_dir = write_ple_checkpoint(root / "bf16", QWEN, dequantized)

    zero_table = _answers(engines, INT8_ROW)
    _update(engines, INT8_ROW, int8_dir)
    int8_rows = _answers(engines, INT8_ROW)
    log_before = engines.log_path(INT8_ROW).read_text(encoding="utf-8", errors="replace")
    _update(engines, INT8_ROW, bf16_dir)
    quantized = _answers(engines, INT8_ROW)
    log = engines.log_path(INT8_ROW).read_text(encoding="utf-8", errors="replace")
    assert QUANTIZED_NOTE not in log_before  # the INT8-row checkpoint was read as stored

    _update(engines, UPSTREAM, bf16_dir)
    upstream = _answers(engines, UPSTREAM)
    return Served(zero_table, int8_rows, quantized, upstream, log)


def test_int8_rows_answer_as_the_dequantized_bf16_table(served: Served) -> None:
    for expected, actual in zip(served.upstream, served.int8_rows, strict=True):
        assert_same_generation(expected, actual)


def test_the_table_is_read_zeros_answer_otherwise(served: Served) -> None:
    assert any(
        zero.logprobs != loaded.logprobs
        for zero, loaded in zip(served.zero_table, served.int8_rows, strict=True)
    )


def test_a_bf16_table_is_quantized_at_load_with_one_note(served: Served) -> None:
    assert served.int8_log.count(QUANTIZED_NOTE) == 1
    for expected, actual in zip(served.upstream, served.quantized_at_load, strict=True):
        assert_same_generation(expected, actual, atol=BF16_LOGIT_STEP)
