"""W4A16 AutoRound checkpoints, and deterministic inference with the plugin, in CUDA engines.

AutoRound: :func:`qsa_testing.write_autoround_checkpoints` writes the Marlin-shaped tiny Qwen4Exp
(:func:`qsa_testing.marlin_qwen4_exp`) as an AutoRound export in the GPTQ packing and as its
dequantized bf16 twin (the same int4 values, power-of-two scales: one model). One engine reads the
export at start (``load_format="auto"``), another the twin; the same greedy requests give the same
token ids, with logprobs within the noise of the kernels' bf16 arithmetic, measured here as the
twin's engine against itself with another batch composition.

The export's engine runs with the plugin and ``SGLANG_QSA_MODEL_COMPAT=1``: upstream SGLang 0.5.23
alone loads the export and stops at the first request (its GPTQ Marlin MoE layer holds the
experts' scales in fp16, and the Marlin MoE GEMM refuses them beside bf16 activations; measured on
an H100), and the plugin's AFTER hook on ``GPTQMarlinMoEScheme.create_weights`` holds them in bf16
(``test_marlin_moe_scales.py`` pins that on the CPU). The twin's engine stays upstream, no plugin:
the twin has nothing quantized, so the plugin would change nothing in it, and the reference is
then SGLang's own bf16 model, not one the plugin also touched.

Which method each layer takes (``GPTQMarlinLinearMethod`` everywhere, ``GPTQMarlinMoEMethod`` for
the routed experts) is pinned on the CPU, on the model SGLang builds for an SM90 device
(``qsa-testing``'s ``test_autoround.py``): SGLang logs no method name at info level, and Qwen4Exp
has no ``get_weights_by_name`` to read a repacked ``qweight`` back. On the CPU SGLang refuses
the export (the same file).

Deterministic inference: ``--enable-deterministic-inference`` with ``p2-offload`` on the tiny
Qwen4Exp; the same batch twice gives bit-identical token ids and logprobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from qsa_testing import (
    BF16_LOGIT_STEP,
    AutoRoundCheckpoints,
    Engine,
    EngineConfig,
    GenerateRequest,
    Generation,
    assert_same_generation,
    logprob_gap,
    marlin_qwen4_exp,
    running_engine,
    tiny_qwen4_exp,
    write_autoround_checkpoints,
)

MARLIN = marlin_qwen4_exp()
REQUESTS = tuple(
    GenerateRequest(MARLIN.prompt(length, seed=seed), max_new_tokens=24, ignore_eos=True)
    for seed, length in ((38, 300), (39, 41), (40, 1000))
)
#: The tolerance is this many times the largest logprob gap of the twin's engine against itself
#: with another batch composition, and never below one bf16 step of a logit.
NOISE_MULTIPLE = 4
#: The export's engine: the plugin holds the routed experts' Marlin scales in the model's dtype.
MODEL_COMPAT = {"SGLANG_QSA_MODEL_COMPAT": "1"}


@dataclass(frozen=True, slots=True)
class Served:
    """What the two engines answered."""

    autoround: tuple[Generation, ...]
    dequantized: tuple[Generation, ...]
    dequantized_alone: tuple[Generation, ...]


def _together(engine: Engine, requests: tuple[GenerateRequest, ...]) -> tuple[Generation, ...]:
    """``requests`` sent at once, so that they decode in one batch."""
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return tuple(pool.map(engine.generate, requests))


@contextmanager
def _engine(
    checkpoints: AutoRoundCheckpoints, *, exported: bool, workdir: Path
) -> Iterator[Engine]:
    """An engine reading the export (the plugin's model compatibility on) or its twin (upstream)
    at start."""
    server_args = {"load_format": "auto"}
    if exported:
        config = EngineConfig(
            checkpoints.autoround_model, switches=MODEL_COMPAT, server_args=server_args
        )
    else:
        config = EngineConfig(checkpoints.dequantized_model, plugin=False, server_args=server_args)
    with running_engine(config, workdir, models=checkpoints.dequantized.parent) as engine:
        yield engine


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    """Both engines' answers, one engine at a time."""
    root = tmp_path_factory.mktemp("autoround")
    checkpoints = write_autoround_checkpoints(root / "checkpoints", MARLIN, seed=38)
    with _engine(checkpoints, exported=True, workdir=root / "export") as engine:
        autoround = _together(engine, REQUESTS)
    with _engine(checkpoints, exported=False, workdir=root / "twin") as engine:
        dequantized = _together(engine, REQUESTS)
        alone = tuple(engine.generate(request) for request in REQUESTS)
    return Served(autoround, dequantized, alone)


def _tolerance(served: Served) -> float:
    measured = max(
        logprob_gap(a, b) for a, b in zip(served.dequantized, served.dequantized_alone, strict=True)
    )
    return max(NOISE_MULTIPLE * measured, BF16_LOGIT_STEP)


@pytest.mark.gpu
def test_autoround_export_answers_as_its_dequantized_twin(served: Served) -> None:
    tolerance = _tolerance(served)
    for expected, actual in zip(served.dequantized, served.autoround, strict=True):
        assert_same_generation(expected, actual, atol=tolerance, what="AutoRound export")


QWEN = tiny_qwen4_exp()
DETERMINISTIC = EngineConfig(
    QWEN,
    switches={"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"},
    server_args={
        "radix_cache_backend": "qsa_hisparse",
        "disable_overlap_schedule": True,
        "max_running_requests": 4,
        "prefill_max_requests": 1,
        "context_length": 8192,
        "enable_deterministic_inference": True,
    },
)
BATCH = tuple(
    GenerateRequest(QWEN.prompt(length, seed=seed), max_new_tokens=32, ignore_eos=True)
    for seed, length in ((41, 3000), (42, 301), (43, 2100))
)


@pytest.mark.gpu
def test_deterministic_inference_with_p2_offload_repeats_a_batch_bit_for_bit(
    tmp_path: Path,
) -> None:
    with running_engine(DETERMINISTIC, tmp_path) as engine:
        first = _together(engine, BATCH)
        second = _together(engine, BATCH)
    for expected, actual in zip(first, second, strict=True):
        assert_same_generation(expected, actual, what="deterministic rerun")
