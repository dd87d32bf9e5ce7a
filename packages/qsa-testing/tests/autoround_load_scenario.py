"""Loads a checkpoint into SGLang 0.5.23's own Qwen4Exp model on the CPU; prints a JSON report.

Usage: ``python autoround_load_scenario.py <checkpoint_dir> <bf16|cuda-choice>``. Runs in a fresh
process (it publishes SGLang's process-wide runtime context and a one-rank gloo group). It builds
``Qwen4ExpForConditionalGeneration`` from the checkpoint's ``config.json`` as SGLang's loader does
(its ``ModelConfig``, the CPU head adjustment, the quantization config of ``config.json``), with
real CPU tensors, and feeds every tensor of the checkpoint's safetensors files to the model's own
``load_weights``. The report names the parameters ``load_weights`` did not load (``missing``),
the checkpoint tensors it found no parameter for (its ``not found`` warnings: ``unexpected``),
and the quantization method each layer got (``methods``: prefix to class name).

``cuda-choice``: SGLang's AutoRound CPU path refuses a machine without Intel AMX before building
anything, so this mode makes ``auto_round.py`` take its CUDA branch on an SM90 device
(``_is_cpu`` false, ``get_device_capability`` (9, 0) in ``marlin_utils``): the layers, parameters
and methods an H100/H200 engine builds, loaded on the CPU without the Marlin repack that follows
(``process_weights_after_loading`` does not run). The last stdout line is the JSON report.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch


class _Warnings(logging.Handler):
    """The messages of the warnings a logger emits."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(checkpoint: str, mode: str) -> dict[str, Any]:
    from qsa_testing.standins import install_cpu_engine_standins

    install_cpu_engine_standins()
    from safetensors.torch import load_file
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.quantization import auto_round, marlin_utils
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    args = ["--model-path", checkpoint, "--device", "cpu", "--disable-radix-cache"]
    server_args = prepare_server_args(args)
    server_args.resolve_once()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"file://{Path(checkpoint).resolve()}/.gloo-init",
        backend="gloo",
    )
    initialize_model_parallel(backend="gloo")
    model_config = adjust_config_with_unaligned_cpu_tp(
        ModelConfig.from_server_args(server_args), LoadConfig(), 1
    )
    quant_config = None
    if mode == "cuda-choice":
        auto_round._is_cpu = False
        marlin_utils.get_device_capability = lambda *_a, **_k: (9, 0)
        raw = json.loads((Path(checkpoint) / "config.json").read_text())["quantization_config"]
        quant_config = auto_round.AutoRoundConfig.from_config(raw)
    elif mode != "bf16":
        msg = f"mode {mode!r} is not known; allowed: bf16, cuda-choice"
        raise ValueError(msg)
    methods: dict[str, str] = {}
    if quant_config is not None:
        choose = type(quant_config).get_quant_method

        def recorded(self: Any, layer: torch.nn.Module, prefix: str) -> Any:
            method = choose(self, layer, prefix)
            if method is not None:
                methods[prefix] = type(method).__name__
            return method

        type(quant_config).get_quant_method = recorded
    from sglang.srt.models import qwen4_exp

    warnings = _Warnings()
    qwen4_exp.logger.addHandler(warnings)
    torch.set_default_dtype(torch.bfloat16)
    model = qwen4_exp.Qwen4ExpForConditionalGeneration(
        model_config.hf_config, quant_config=quant_config
    )
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    loaded = model.load_weights(iter(weights.items()))
    parameters = {name for name, _ in model.named_parameters()}
    return {
        "missing": sorted(parameters - set(loaded)),
        "unexpected": [m for m in warnings.messages if "not found" in m],
        "methods": methods,
        "tensors": len(weights),
    }


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2])
    sys.stdout.write("\n" + json.dumps(result) + "\n")
