"""The production command started on one CUDA GPU, serving the model-shaped tiny Qwen4Exp with an
INT8-row PLE table (issue 38).

``test_production_command.py`` checks the command's flags on the CPU; here SGLang 0.5.23 serves
them. The server's arguments are the production command's flags
(:data:`qsa_testing.PRODUCTION_FLAGS` and :data:`qsa_testing.PRODUCTION_PLUGIN_FLAGS`) as SGLang's
own parser reads them (:func:`qsa_testing.server_args_of_flags`), under its switches
(:data:`qsa_testing.PRODUCTION_SWITCHES`), with these changes for a test engine
(:data:`ADAPTATIONS`, :data:`PREFIX_CACHE_MB`):

- ``--tp-size 1`` instead of 2: one GPU.
- ``--mem-fraction-static 0.3`` (the harness's CUDA default) instead of 0.96: under
  ``nox -s gpu-engine -- --concurrent`` the other groups' engines share the card, and SGLang
  refuses to start when less than ``1 - fraction`` of the card would be left to them (4% at
  0.96). ``--max-total-tokens`` bounds the pool either way.
- ``SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB=1024`` instead of 32,768: the prefix cache's arena is
  pinned host memory allocated whole at start-up, and 32 GiB of it would hold a quarter of the
  GPU machine's 128 GiB beside the other engines; the checkpoint these tests take is a few MiB.
- ``disable_cuda_graph=False`` (SGLang's default; the command passes no such flag) set
  explicitly: the harness turns CUDA graphs off in ``gpu-engine``'s eager mode
  (``QSA_TESTING_CUDA_GRAPHS=0``), and the production command captures its decode graphs, so
  both graph modes start this same engine.

Every other flag is the command's, ``--context-length 262144`` and ``--max-total-tokens 2097152``
included (the host arena holds a row of 262,144 tokens per running request, about 2 GiB pinned
for this model's one QSA layer at fp8; the staging area one prompt of the context length).

What the harness owns: ``--model-path`` (the directory of the model's ``config.json`` and its
INT8-row PLE table, ``production_model_dir`` of conftest), ``--host`` and ``--port``, the
plugin's entry point (``SGLANG_PLUGINS``, set for every plugin engine), and the defaults of its
engines that the command leaves unset: ``load_format="dummy"`` (SGLang's seeded dummy weights: no
whole tiny checkpoint is written; the PLE table is then read from its checkpoint with
``/update_weights_from_disk``, ``load_format="auto"``, as ``test_engine_model_compat.py`` reads
it), ``skip_tokenizer_init`` (the tiny model has no tokenizer; requests go by token ids),
``enable_multimodal=False`` (the tiny model takes no images, so ``--image-processor-backend`` and
``--mm-preprocess-cache-size-mb`` have nothing to do), ``attention_backend="triton"`` (SGLang's
SM90 default, FA3, is not in the GPU machine's sglang-kernel), ``sampling_backend="pytorch"``,
``random_seed=0``, ``skip_server_warmup`` and ``log_level="info"``.

No comparison with upstream SGLang: upstream cannot read an ``int8_row`` table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import pytest

from qsa_sglang_plugin import PLUGIN_NAME, SWITCH_PREFIX
from qsa_testing import (
    BF16_LOGIT_STEP,
    PRODUCTION_FLAGS,
    PRODUCTION_PLUGIN_FLAGS,
    PRODUCTION_SWITCHES,
    Engine,
    EngineConfig,
    GenerateRequest,
    Generation,
    assert_same_generation,
    running_engine,
    server_args_of_flags,
    tiny_qwen4_exp,
)

MODEL = tiny_qwen4_exp(model_shaped=True, max_position_embeddings=262_144)
#: What a test engine changes of the command's server arguments (the module's docstring says why).
ADAPTATIONS: Final = {"tp_size": 1, "mem_fraction_static": 0.3, "disable_cuda_graph": False}
#: The host prefix cache's budget in MiB, instead of the command's 32,768.
PREFIX_CACHE_MB: Final = "1024"
#: ``--chunked-prefill-size``: a prompt longer than this is checkpointed where its first chunk
#: ends (a whole number of 64-token pages).
CHUNK: Final = 2048
#: ``--cuda-graph-bs-decode``.
DECODE_GRAPH_BATCHES: Final = list(range(1, 9))

SHORT = GenerateRequest(MODEL.prompt(300, seed=380), max_new_tokens=256, ignore_eos=True)
LONG = GenerateRequest(MODEL.prompt(2500, seed=381), max_new_tokens=64, ignore_eos=True)
REPEATED = GenerateRequest(MODEL.prompt(2500, seed=382), max_new_tokens=32, ignore_eos=True)

_TABLE_READ = re.compile(
    r"PLE: INT8-row table (?P<module>\S+) read: (?P<rows>\d+) rows from (?P<int8>\d+) int8 "
    r"shards and (?P<quantized>\d+) 16/32-bit shards, in (?P<where>[^\n]+)"
)
_OFFLOAD = re.compile(
    r"offload: host arena [^(\n]+\((?P<rows>\d+) rows x (?P<layers>\d+) attention layers x "
    r"\d+ blocks, [^,\n]+ records, (?P<dtype>[^,\n]+), (?P<memory>pinned|pageable)\); "
    r"on (?P<device>[^:\n]+):"
)
_DECODE_GRAPHS_BEGIN = re.compile(r"Capture target decode CUDA graph begin\. backend=(\w+)")
_DECODE_GRAPHS_END = re.compile(r"Capture target decode CUDA graph end\. bs=\[([\d, ]*)\]")


def production_config() -> EngineConfig:
    """The production command as a test engine's configuration, with :data:`ADAPTATIONS`."""
    flags = [*PRODUCTION_FLAGS, *(part for flag in PRODUCTION_PLUGIN_FLAGS for part in flag)]
    switches = {k: v for k, v in PRODUCTION_SWITCHES.items() if k.startswith(SWITCH_PREFIX)}
    assert {k: v for k, v in PRODUCTION_SWITCHES.items() if k not in switches} == {
        "SGLANG_PLUGINS": PLUGIN_NAME  # what the harness sets for a plugin engine
    }
    switches["SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB"] = PREFIX_CACHE_MB
    return EngineConfig(
        MODEL, switches=switches, server_args={**server_args_of_flags(flags), **ADAPTATIONS}
    )


@pytest.fixture(scope="module")
def engine(
    production_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """The production engine, its PLE table read from the INT8-row checkpoint beside its config."""
    workdir = tmp_path_factory.mktemp("production-engine")
    models = production_model_dir.parent  # the engine's --model-path is production_model_dir
    with running_engine(production_config(), workdir, models=models) as engine:
        reply = engine.post_json(
            "/update_weights_from_disk",
            {"model_path": str(production_model_dir), "load_format": "auto"},
        )
        assert reply["success"] is True, reply
        yield engine


def _log(engine: Engine) -> str:
    return engine.log_path.read_text(encoding="utf-8", errors="replace")


@pytest.mark.gpu
def test_the_production_command_answers_two_concurrent_greedy_requests(engine: Engine) -> None:
    """A 300-token prompt (256 greedy tokens) and a 2,500-token one (two prefill chunks; 64
    tokens), sent at once: each answers every token asked for, with finite logprobs."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(engine.generate, (SHORT, LONG)))
    for request, answer in zip((SHORT, LONG), answers, strict=True):
        assert answer.prompt_tokens == len(request.input_ids)
        assert answer.finish_reason == "length"
        assert len(answer.output_ids) == request.max_new_tokens
        assert all(math.isfinite(logprob) for logprob in answer.logprobs), answer.logprobs
    assert engine.running


@pytest.mark.gpu
def test_the_log_shows_the_int8_row_table_read_into_pinned_host_memory_and_the_offload_on(
    engine: Engine,
) -> None:
    log = _log(engine)
    tables = [m.groupdict() for m in _TABLE_READ.finditer(log)]
    assert len(tables) == 1, f"PLE tables read: {tables!r} in {engine.log_path}"
    (table,) = tables
    assert table["module"].endswith("ngram_embedding")
    assert int(table["rows"]) > 0
    assert int(table["int8"]) > 0
    assert int(table["quantized"]) == 0  # read as stored, nothing quantized at load
    assert table["where"] == "pinned host memory"  # --ple-offload-embedding
    assert "quantized to INT8 rows at load" not in log
    offload = _OFFLOAD.search(log)
    assert offload is not None, f"no offload line in {engine.log_path}"
    assert int(offload["rows"]) >= 8  # a row per running request: --max-running-requests 8
    assert int(offload["layers"]) == 1  # the model's one QSA layer
    assert offload["dtype"].startswith("float8")  # --kv-cache-dtype fp8_e4m3
    assert offload["memory"] == "pinned"
    assert offload["device"].startswith("cuda")


@pytest.mark.gpu
def test_decode_is_captured_in_full_cuda_graphs_of_batches_one_to_eight_and_prefill_in_none(
    engine: Engine,
) -> None:
    log = _log(engine)
    assert _DECODE_GRAPHS_BEGIN.findall(log) == ["full"], engine.log_path
    ends = _DECODE_GRAPHS_END.findall(log)
    assert len(ends) == 1, engine.log_path
    assert sorted(int(bs) for bs in ends[0].split(",")) == DECODE_GRAPH_BATCHES
    assert "prefill CUDA graph begin" not in log  # --cuda-graph-backend-prefill disabled


@pytest.mark.gpu
def test_a_repeated_prompt_is_restored_from_the_host_prefix_cache_and_answers_alike(
    engine: Engine,
) -> None:
    """The 2,500-token prompt is checkpointed where its first chunk ends; sent again, those 2,048
    tokens come from the host tier (``--enable-cache-report`` splits them by tier) and the same
    tokens are chosen, logprobs within one bf16 step (two runs of one prompt on the GPU differ
    that much, restored or not; ``test_engine_offload.py``)."""
    replies: list[dict[str, Any]] = [
        engine.post_json("/generate", REPEATED.body()) for _ in range(2)
    ]
    cold, warm = (Generation.from_reply(reply) for reply in replies)
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == CHUNK
    assert replies[1]["meta_info"]["cached_tokens_details"] == {"device": 0, "host": CHUNK}
    assert_same_generation(cold, warm, atol=BF16_LOGIT_STEP, what="restored against computed")
