"""The production command through ``qsa-hisparse launch``'s checks, on a model-shaped model.

:data:`PRODUCTION_FLAGS` is the maintainer's production command (the seed, docs/plugin.md
"The production command") minus ``--model-path``, under its switches (:data:`SWITCHES`). The model
is the model-shaped tiny Qwen4Exp (real QSA geometry, 262,144 positions, one PLE layer) with an
INT8-row PLE table written beside its config. The checks: the launcher's own before it starts
anything (topology, serving flags; this process), then SGLang 0.5.23's parser and resolution with
the plugin's configuration check (its AFTER hook on ``resolve_once``), in a fresh process.

This machine has no accelerator, and SGLang's resolution of an unset ``--device`` asks for one;
:data:`DEVICE` names the device it picks on the GPU machine the command is for. The launcher's
own NVIDIA-driver check is pointed at a file that exists (a machine with a driver).

The seed as given is refused for two flags it does not pass, one at a time (the check stops at the
first): ``--radix-cache-backend`` (unset: SGLang's own tree cache), then
``--prefill-max-requests`` (unset: no limit); with both (:data:`PLUGIN_FLAGS`) it is accepted.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from qsa_kernels.int8_rows import quantize_int8_rows
from qsa_pytest.processes import script_report
from qsa_sglang_plugin import launch
from qsa_sglang_plugin._readiness import server_topology
from qsa_testing import ple_table_shape, tiny_qwen4_exp, write_ple_checkpoint

SCENARIO = Path(__file__).with_name("production_command_scenario.py")
SWITCHES = {
    "SGLANG_QSA_MODEL_COMPAT": "1",
    "SGLANG_QSA_HISPARSE_V3": "p2-offload",
    "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "32768",
    "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MAX_ENTRIES": "256",
    "SGLANG_PLUGINS": "qsa_hisparse",
}
PRODUCTION_FLAGS = shlex.split(
    """
    --model-impl sglang --dtype bfloat16 --tp-size 2
    --ple-offload-embedding
    --json-model-override-args '{"text_config":{"ple_embedding_dtype":"int8_row"}}'
    --kv-cache-dtype fp8_e4m3 --page-size 64 --context-length 262144
    --linear-attn-backend triton --mamba-ssm-dtype float32
    --mamba-radix-cache-strategy extra_buffer --mamba-track-interval 64 --max-mamba-cache-size 40
    --mem-fraction-static 0.96 --max-running-requests 8 --max-total-tokens 2097152
    --chunked-prefill-size 2048 --prefill-decode-interval 1
    --disable-radix-cache --disable-overlap-schedule
    --cuda-graph-backend-decode full --cuda-graph-backend-prefill disabled
    --disable-cuda-graph-padding --cuda-graph-max-bs-decode 8 --cuda-graph-bs-decode 1 2 3 4 5 6 7 8
    --image-processor-backend pil --mm-preprocess-cache-size-mb 2048
    --reasoning-parser qwen3 --tool-call-parser qwen3_coder --enable-cache-report
    """
)
DEVICE = ["--device", "cuda"]
#: What the plugin needs beside the seed's flags (docs/plugin.md says why).
RADIX_CACHE_BACKEND = ["--radix-cache-backend", "qsa_hisparse"]
PREFILL_MAX_REQUESTS = ["--prefill-max-requests", "1"]
PLUGIN_FLAGS = [*RADIX_CACHE_BACKEND, *PREFILL_MAX_REQUESTS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model-shaped tiny Qwen4Exp's config and an INT8-row PLE table beside it."""
    model = tiny_qwen4_exp(model_shaped=True, max_position_embeddings=262_144)
    shape = ple_table_shape(model)
    source = torch.randn(shape.rows, shape.dim, generator=torch.Generator().manual_seed(0))
    table = quantize_int8_rows(source.to(torch.bfloat16))
    return write_ple_checkpoint(tmp_path_factory.mktemp("production"), model, table)


@pytest.fixture(scope="module")
def resolved(model_dir: Path) -> list[dict[str, Any]]:
    """The seed's flags, with the radix-cache backend, and with both plugin flags (in order)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_QSA_")}
    env.update(SWITCHES)
    flags = [*PRODUCTION_FLAGS, *DEVICE]
    result: list[dict[str, Any]] = script_report(
        SCENARIO,
        str(model_dir),
        json.dumps(flags),
        json.dumps(RADIX_CACHE_BACKEND),
        json.dumps(PLUGIN_FLAGS),
        env=env,
    )
    return result


def test_the_launcher_accepts_the_seeds_flags_before_starting_anything(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = tmp_path / "nvidiactl"
    driver.touch()
    monkeypatch.setattr(launch, "_NVIDIA_DRIVER_PATHS", (driver,))
    command = ["--model-path", str(model_dir), *PRODUCTION_FLAGS]
    assert server_topology(command).tp_size == 2
    launch._check_serving_flags(command)  # raises LaunchError on a refused flag


def test_the_seed_alone_is_refused_for_its_unset_radix_cache_backend(
    resolved: list[dict[str, Any]],
) -> None:
    error = resolved[0]["error"]
    assert error is not None
    assert error["type"] == "ConfigurationError"
    assert error["message"].startswith("--radix-cache-backend=None is not supported")
    assert "supported: 'qsa_hisparse'" in error["message"]


def test_then_for_its_unset_prefill_max_requests(resolved: list[dict[str, Any]]) -> None:
    error = resolved[1]["error"]
    assert error is not None
    assert error["type"] == "ConfigurationError"
    assert error["message"].startswith("--prefill-max-requests=None is not supported")


def test_with_the_two_plugin_flags_the_production_command_is_accepted(
    resolved: list[dict[str, Any]],
) -> None:
    accepted = resolved[2]
    assert accepted["error"] is None
    assert accepted["facts"] == {
        "ple_embedding_dtype": "int8_row",
        "tp_size": 2,
        "kv_cache_dtype": "fp8_e4m3",
        "page_size": 64,
        "prefill_graph_backend": "disabled",
        "radix_cache_backend": "qsa_hisparse",
        "prefill_max_requests": 1,
        "ple_offload_embedding": True,
    }
