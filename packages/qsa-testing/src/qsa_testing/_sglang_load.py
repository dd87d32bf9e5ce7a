"""A checkpoint loaded into SGLang 0.5.23's own Qwen4Exp model on the CPU, by its ``load_weights``.

For a fresh process only (a scenario script): it publishes SGLang's process-wide runtime context
and a one-rank gloo group, and in ``cuda-choice`` mode edits two of SGLang's module globals.
"""

from __future__ import annotations

import enum
import json
import logging
import logging.handlers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ("LoadMode", "SGLangLoad", "load_into_sglang_qwen4_exp")


class LoadMode(enum.StrEnum):
    """Which model SGLang builds for the checkpoint."""

    #: SGLang's CPU model, without a quantization config (a bf16 checkpoint).
    BF16 = "bf16"
    #: The model SGLang builds for an SM90 GPU from the checkpoint's ``quantization_config``
    #: (``auto_round._is_cpu`` false, ``get_device_capability`` (9, 0) in ``marlin_utils``): the
    #: layers, parameters and methods an H100/H200 engine builds, loaded on the CPU without the
    #: Marlin repack that follows (``process_weights_after_loading`` does not run). SGLang's
    #: AutoRound CPU path refuses a machine without Intel AMX before building anything.
    CUDA_CHOICE = "cuda-choice"


@dataclass(frozen=True, slots=True)
class SGLangLoad:
    """SGLang's model after ``load_weights``, and what the load said.

    Attributes:
        model: ``Qwen4ExpForConditionalGeneration`` as loaded.
        weights: every tensor of the checkpoint's safetensors files, by name.
        missing: the model's parameters ``load_weights`` did not load.
        unexpected: the checkpoint tensors it found no parameter for (its ``not found``
            warnings).
        methods: the quantization method each layer got (prefix to class name).
    """

    model: torch.nn.Module
    weights: dict[str, torch.Tensor]
    missing: list[str]
    unexpected: list[str]
    methods: dict[str, str]

    def report(self) -> dict[str, Any]:
        """``missing``, ``unexpected``, ``methods`` and the number of tensors, JSON-ready."""
        return {
            "missing": self.missing,
            "unexpected": self.unexpected,
            "methods": self.methods,
            "tensors": len(self.weights),
        }


def load_into_sglang_qwen4_exp(checkpoint: str | Path, mode: LoadMode | str) -> SGLangLoad:
    """Build SGLang's ``Qwen4ExpForConditionalGeneration`` for ``checkpoint`` and load it.

    As SGLang's loader does: its ``ModelConfig``, the CPU head adjustment, the quantization config
    of ``config.json`` (``cuda-choice``), real CPU tensors in bf16; every tensor of the
    checkpoint's safetensors files goes to the model's own ``load_weights``. Installs the CPU
    engine's stand-ins first. Plugins loaded in this process (``load_plugins()`` before this call)
    take part as in an engine.

    Raises:
        ValueError: a mode that is not a :class:`LoadMode`.
    """
    mode = LoadMode(mode)
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

    checkpoint = Path(checkpoint)
    args = ["--model-path", str(checkpoint), "--device", "cpu", "--disable-radix-cache"]
    server_args = prepare_server_args(args)
    server_args.resolve_once()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"file://{checkpoint.resolve()}/.gloo-init",
        backend="gloo",
    )
    initialize_model_parallel(backend="gloo")
    model_config = adjust_config_with_unaligned_cpu_tp(
        ModelConfig.from_server_args(server_args), LoadConfig(), 1
    )
    quant_config = None
    if mode is LoadMode.CUDA_CHOICE:
        auto_round._is_cpu = False
        marlin_utils.get_device_capability = lambda *_a, **_k: (9, 0)
        raw = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
        quant_config = auto_round.AutoRoundConfig.from_config(raw)
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

    warnings = logging.handlers.BufferingHandler(capacity=1 << 16)
    warnings.setLevel(logging.WARNING)
    qwen4_exp.logger.addHandler(warnings)
    torch.set_default_dtype(torch.bfloat16)
    model = qwen4_exp.Qwen4ExpForConditionalGeneration(
        model_config.hf_config, quant_config=quant_config
    )
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    loaded = model.load_weights(iter(weights.items()))
    parameters = {name for name, _ in model.named_parameters()}
    return SGLangLoad(
        model=model,
        weights=weights,
        missing=sorted(parameters - set(loaded)),
        unexpected=[r.getMessage() for r in warnings.buffer if "not found" in r.getMessage()],
        methods=methods,
    )
