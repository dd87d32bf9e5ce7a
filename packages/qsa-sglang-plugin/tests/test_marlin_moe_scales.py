"""GPTQ / AutoRound routed experts on Marlin: their scales in the model's dtype.

SGLang 0.5.23 makes a GPTQ Marlin MoE layer's ``w13_scales`` and ``w2_scales`` fp16 whatever the
model's dtype, and its Marlin MoE GEMM refuses scales of another dtype than the activations'
(an H100 engine of the AutoRound export, ``--dtype bfloat16``, stopped at its first request). With
``SGLANG_QSA_MODEL_COMPAT=1`` the AFTER hook on ``GPTQMarlinMoEScheme.create_weights`` makes them
in the model's dtype. ``marlin_moe_scales_scenario.py`` builds, in a fresh process, the bf16
Qwen4Exp SGLang builds for an SM90 GPU from :func:`qsa_testing.write_autoround_checkpoints`'
export and loads it through SGLang's own ``load_weights``: with the switch the experts' scales are
bf16 and equal the checkpoint's fp16 scales cast to bf16 (exactly: the export's scales are powers
of two), and stay bf16 through Marlin's scale permutation; without it they stay fp16 (upstream).
The hook itself is pinned on a stand-in layer.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from qsa_pytest.processes import script_report
from qsa_sglang_plugin._adapters._gptq_moe import (
    after_gptq_marlin_moe_create_weights,
    marlin_moe_scales_dtype,
)
from qsa_testing import AutoRoundCheckpoints, marlin_qwen4_exp, write_autoround_checkpoints

SCENARIO = Path(__file__).with_name("marlin_moe_scales_scenario.py")
HOOK_LOGGER = "qsa_sglang_plugin._adapters._gptq_moe"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> AutoRoundCheckpoints:
    return write_autoround_checkpoints(tmp_path_factory.mktemp("autoround"), marlin_qwen4_exp())


def _report(written: AutoRoundCheckpoints, *, model_compat: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_QSA_")}
    env["SGLANG_PLUGINS"] = "qsa_hisparse"
    if model_compat:
        env["SGLANG_QSA_MODEL_COMPAT"] = "1"
    result: dict[str, Any] = script_report(SCENARIO, str(written.autoround), env=env)
    return result


def test_with_the_switch_the_experts_scales_load_as_bf16(written: AutoRoundCheckpoints) -> None:
    report = _report(written, model_compat=True)
    assert [m for m in report["missing"] if not m.endswith("_g_idx_sort_indices")] == []
    assert report["unexpected"] == []
    experts = report["experts"]
    assert len(experts) == 4
    for prefix, layer in experts.items():
        assert layer == {
            "stored": "torch.float16",
            "w13_scales": "torch.bfloat16",
            "w2_scales": "torch.bfloat16",
            "w13_equal": True,
            "w2_equal": True,
            "w13_permuted": "torch.bfloat16",
            "w2_permuted": "torch.bfloat16",
            "w2_load_full_w2": False,
        }, prefix
    (line,) = report["log"]  # one line for the model, not one per layer
    assert "model dtype bfloat16" in line
    assert "8-bit mantissa" in line


def test_without_the_switch_the_scales_stay_fp16(written: AutoRoundCheckpoints) -> None:
    report = _report(written, model_compat=False)
    experts = report["experts"]
    assert len(experts) == 4
    for prefix, layer in experts.items():
        assert (layer["w13_scales"], layer["w2_scales"]) == ("torch.float16",) * 2, prefix
        assert (layer["w13_equal"], layer["w2_equal"]) == (True, True), prefix
    assert report["log"] == []


@pytest.mark.parametrize(
    ("params_dtype", "expected"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),  # no Marlin kernel for fp32: upstream's fp16 stands
    ],
)
def test_the_scales_take_the_dtype_marlin_runs_in(
    params_dtype: torch.dtype, expected: torch.dtype
) -> None:
    assert marlin_moe_scales_dtype(params_dtype) == expected


class _Scheme:
    """A scheme whose ``create_weights`` has upstream 0.5.23's signature (the scenario above runs
    the hook on SGLang's own ``GPTQMarlinMoEScheme``); the hook reads its call by that signature."""

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: object,
    ) -> None:
        raise NotImplementedError


def _scheme() -> _Scheme:
    return _Scheme()


def _layer() -> torch.nn.Module:
    """The two scale parameters as upstream makes them, with their loader's attributes."""
    layer = torch.nn.Module()
    attributes = {"weight_loader": print, "quant_method": "group", "is_transposed": True}
    for name, shape, extra in (
        ("w13_scales", (2, 3, 8), {}),
        ("w2_scales", (2, 1, 4), {"load_full_w2": False}),
    ):
        scales = torch.nn.Parameter(torch.ones(shape, dtype=torch.half), requires_grad=False)
        for key, value in {**attributes, **extra}.items():
            setattr(scales, key, value)
        layer.register_parameter(name, scales)
    return layer


@pytest.mark.parametrize("positional", [False, True])
def test_the_hook_remakes_both_scales_with_their_attributes(positional: bool) -> None:
    layer = _layer()
    names = ("w13_scales", "w2_scales")
    before = {name: dict(vars(getattr(layer, name))) for name in names}
    shapes = {name: getattr(layer, name).shape for name in names}
    if positional:
        after_gptq_marlin_moe_create_weights(None, _scheme(), layer, 2, 16, 4, torch.bfloat16)
    else:
        after_gptq_marlin_moe_create_weights(
            None,
            _scheme(),
            layer=layer,
            num_experts=2,
            hidden_size=16,
            intermediate_size_per_partition=4,
            params_dtype=torch.bfloat16,
            weight_loader=print,
        )
    for name, attributes in before.items():
        scales = getattr(layer, name)
        assert isinstance(scales, torch.nn.Parameter)
        assert not scales.requires_grad
        assert scales.dtype == torch.bfloat16
        assert scales.shape == shapes[name]
        assert dict(vars(scales)) == attributes
    assert dict(layer.named_parameters()).keys() == before.keys()


def test_the_hook_leaves_an_fp16_model_to_upstream(caplog: pytest.LogCaptureFixture) -> None:
    layer = _layer()
    w13, w2 = layer.w13_scales, layer.w2_scales
    with caplog.at_level(logging.INFO, logger=HOOK_LOGGER):
        after_gptq_marlin_moe_create_weights(None, _scheme(), layer=layer, params_dtype=torch.half)
    assert layer.w13_scales is w13
    assert layer.w2_scales is w2
    assert caplog.records == []
