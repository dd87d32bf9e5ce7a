"""The routed experts' Marlin scales after SGLang's own ``load_weights``; prints a JSON report.

Usage: ``python marlin_moe_scales_scenario.py <autoround_checkpoint_dir>``, with ``SGLANG_PLUGINS``
and the plugin's switches in the environment. Runs in a fresh process: ``load_plugins()``, then
:func:`qsa_testing.load_into_sglang_qwen4_exp` builds on the CPU the bf16 Qwen4Exp SGLang builds
for an SM90 GPU from the export (the routed experts take ``GPTQMarlinMoEMethod``) and loads every
tensor. For each experts layer the report gives the dtype of ``w13_scales`` and ``w2_scales``,
whether each equals the checkpoint's fp16 scales (gate and up side by side for ``w13``) cast to
that dtype, and the dtype of each after Marlin's scale permutation (``marlin_moe_permute_scales``
with the arguments of ``GPTQMarlinMoEKernel.process_weights_after_loading``; the weights' repack
beside it is a CUDA kernel). ``log`` holds the plugin's messages about the scales. The last stdout
line is the JSON report.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
from typing import Any

import torch

#: The logger of the plugin's hook on ``GPTQMarlinMoEScheme.create_weights``.
HOOK_LOGGER = "qsa_sglang_plugin._adapters._gptq_moe"


def _stored(
    weights: dict[str, torch.Tensor], prefix: str, experts: int, projections: tuple[str, ...]
) -> torch.Tensor:
    """The checkpoint's scales of ``projections`` side by side, stacked over the experts."""
    stored = prefix.replace("model.", "model.language_model.", 1)  # SGLang's rename undone
    return torch.stack(
        [
            torch.cat([weights[f"{stored}.{e}.{p}.scales"] for p in projections], dim=1)
            for e in range(experts)
        ]
    )


def main(checkpoint: str) -> dict[str, Any]:
    from qsa_testing.standins import install_cpu_engine_standins

    install_cpu_engine_standins()  # before the plugin imports its targets
    records = logging.handlers.BufferingHandler(capacity=1 << 16)
    logger = logging.getLogger(HOOK_LOGGER)
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.layers.quantization.marlin_utils import marlin_moe_permute_scales

    from qsa_testing import load_into_sglang_qwen4_exp

    loaded = load_into_sglang_qwen4_exp(checkpoint, "cuda-choice")
    experts: dict[str, Any] = {}
    for prefix, layer in loaded.model.named_modules():
        if not hasattr(layer, "w13_scales"):
            continue
        group = layer.scheme.quant_config.group_size
        experts_here = layer.w13_scales.shape[0]
        w13 = _stored(loaded.weights, prefix, experts_here, ("gate_proj", "up_proj"))
        w2 = _stored(loaded.weights, prefix, experts_here, ("down_proj",))
        permuted13 = marlin_moe_permute_scales(
            s=layer.w13_scales,
            size_k=layer.intermediate_size_per_partition,
            size_n=layer.w13_scales.shape[2],
            group_size=group,
        )
        permuted2 = marlin_moe_permute_scales(
            s=layer.w2_scales,
            size_k=layer.w2_scales.shape[1] * group,
            size_n=layer.w2_scales.shape[2],
            group_size=group,
        )
        experts[prefix] = {
            "stored": str(w13.dtype),
            "w13_scales": str(layer.w13_scales.dtype),
            "w2_scales": str(layer.w2_scales.dtype),
            "w13_equal": torch.equal(layer.w13_scales, w13.to(layer.w13_scales.dtype)),
            "w2_equal": torch.equal(layer.w2_scales, w2.to(layer.w2_scales.dtype)),
            "w13_permuted": str(permuted13.dtype),
            "w2_permuted": str(permuted2.dtype),
            "w2_load_full_w2": getattr(layer.w2_scales, "load_full_w2", None),
        }
    report = loaded.report()
    return {
        "missing": report["missing"],
        "unexpected": report["unexpected"],
        "experts": experts,
        "log": [record.getMessage() for record in records.buffer],
    }


if __name__ == "__main__":
    result = main(sys.argv[1])
    sys.stdout.write("\n" + json.dumps(result) + "\n")
