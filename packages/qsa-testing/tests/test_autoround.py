"""The AutoRound W4A16 export of a tiny Qwen4Exp and its dequantized bf16 twin.

The packing round-trips, the twin is the export's ``(q - 8) * scale`` exactly, the names match,
and SGLang 0.5.23's own ``load_weights`` (``autoround_load_scenario.py``, a fresh process) reads
every parameter of its model from each: the bf16 twin on the CPU model, the export on the model
SGLang builds for an SM90 GPU, whose every quantized layer takes Marlin. A CPU engine serves the
twin from ``load_format="auto"`` at start, and refuses the export for want of Intel AMX.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from qsa_pytest.processes import script_report
from qsa_testing import (
    AutoRoundCheckpoints,
    EngineConfig,
    EngineStartError,
    GenerateRequest,
    ModelSpecError,
    autoround_quantization_config,
    current_platform,
    marlin_qwen4_exp,
    running_engine,
    start_engine,
    tiny_qwen4_exp,
    write_autoround_checkpoints,
)
from qsa_testing._autoround import (
    AUTOROUND_GROUP_SIZE,
    SYMMETRIC_QZEROS_WORD,
    dequantize_int4,
    pack_int4_columns,
    pack_int4_rows,
    quantize_int4,
    unpack_int4_columns,
    unpack_int4_rows,
)
from qsa_testing._engine import Platform
from qsa_testing._models import MARLIN_MIN_K, MARLIN_MIN_N

SCENARIO = Path(__file__).with_name("autoround_load_scenario.py")
MODEL = marlin_qwen4_exp()
PARTS = ("qweight", "scales", "qzeros", "g_idx")
#: What the Marlin MoE method fills after loading (``process_weights_after_loading``), never read
#: from a checkpoint.
DERIVED_SUFFIXES = ("w13_g_idx_sort_indices", "w2_g_idx_sort_indices")
needs_cpu = pytest.mark.skipif(
    current_platform() is not Platform.CPU, reason="a CPU engine (SGLANG_USE_CPU_ENGINE)"
)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> AutoRoundCheckpoints:
    return write_autoround_checkpoints(tmp_path_factory.mktemp("autoround"), MODEL, seed=38)


@pytest.fixture(scope="module")
def tensors(written: AutoRoundCheckpoints) -> tuple[dict[str, Any], dict[str, Any]]:
    """The export's and the twin's tensors."""
    return (
        load_file(str(written.autoround / "model.safetensors")),
        load_file(str(written.dequantized / "model.safetensors")),
    )


def test_qweight_packing_round_trips() -> None:
    q = torch.randint(0, 16, (256, 24), generator=torch.Generator().manual_seed(1))
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.int32
    assert tuple(packed.shape) == (32, 24)
    assert torch.equal(unpack_int4_rows(packed), q.to(torch.int32))


def test_qweight_words_hold_eight_inputs_low_bits_first() -> None:
    q = torch.arange(8, dtype=torch.int32).reshape(8, 1) + 8  # inputs 0..7 hold 8..15
    assert pack_int4_rows(q).item() == int.from_bytes(bytes.fromhex("fedcba98"), "big") - 2**32


def test_qzeros_packing_round_trips() -> None:
    z = torch.randint(0, 16, (3, 64), generator=torch.Generator().manual_seed(2))
    packed = pack_int4_columns(z)
    assert tuple(packed.shape) == (3, 8)
    assert torch.equal(unpack_int4_columns(packed), z.to(torch.int32))


def test_quantized_values_reproduce_the_weight_within_half_a_step() -> None:
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.1
    q, scales = quantize_int4(weight, AUTOROUND_GROUP_SIZE)
    assert int(q.min()) >= 0
    assert int(q.max()) <= 15
    step = scales.float().repeat_interleave(AUTOROUND_GROUP_SIZE, dim=0).t()
    error = (dequantize_int4(q, scales).float() - weight).abs()
    assert bool((error <= step / 2 + 1e-7).all())
    assert bool((torch.log2(scales.float()) == torch.log2(scales.float()).round()).all())


def test_an_input_outside_the_groups_is_refused() -> None:
    with pytest.raises(ModelSpecError, match=r"\(8, 100\).*multiple of 128"):
        quantize_int4(torch.ones(8, 100), AUTOROUND_GROUP_SIZE)


def test_a_model_with_a_quantization_config_is_refused(tmp_path: Path) -> None:
    first = write_autoround_checkpoints(tmp_path, MODEL)
    with pytest.raises(ModelSpecError, match="has a quantization_config already"):
        write_autoround_checkpoints(tmp_path, first.autoround_model)


def test_the_tiny_models_64_wide_layers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match=r"\(128, 64\).*multiple of 128"):
        write_autoround_checkpoints(tmp_path, tiny_qwen4_exp())


def test_the_config_carries_autorounds_gptq_packing(written: AutoRoundCheckpoints) -> None:
    config = json.loads((written.autoround / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "auto-round",
        "packing_format": "auto_round:auto_gptq",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "data_type": "int",
    }
    assert config["quantization_config"] == autoround_quantization_config()
    twin = json.loads((written.dequantized / "config.json").read_text())
    assert "quantization_config" not in twin
    assert {k: v for k, v in config.items() if k != "quantization_config"} == twin


def test_the_exports_names_are_the_twins_with_weight_replaced(
    written: AutoRoundCheckpoints, tensors: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    export, twin = tensors
    quantized = set(written.quantized)
    expected = {n for n in twin if n not in quantized}
    expected |= {f"{n.removesuffix('.weight')}.{part}" for n in quantized for part in PARTS}
    assert set(export) == expected
    for name in twin.keys() - quantized:
        assert torch.equal(export[name], twin[name]), name
    routers = {n for n in twin if n.endswith((".mlp.gate.weight", ".shared_expert_gate.weight"))}
    assert routers
    assert not routers & quantized
    assert not any(n.startswith(("model.visual.", "lm_head")) for n in quantized)
    # 4 layers: 4 experts x 3 + 3 shared-expert projections; 3 GDN layers x 5; 1 attention
    # layer x 5 (q, k, v, o, the indexer's index_qk_proj); 1 PLE layer x 2.
    assert len(quantized) == 4 * 15 + 3 * 5 + 5 + 2


def test_the_twin_is_the_exports_int4_values_times_their_scales(
    written: AutoRoundCheckpoints, tensors: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    export, twin = tensors
    for name in written.quantized:
        prefix = name.removesuffix(".weight")
        out_features, in_features = twin[name].shape
        qweight, scales = export[f"{prefix}.qweight"], export[f"{prefix}.scales"]
        assert (qweight.dtype, tuple(qweight.shape)) == (
            torch.int32,
            (in_features // 8, out_features),
        )
        groups = in_features // AUTOROUND_GROUP_SIZE
        assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (groups, out_features))
        qzeros = export[f"{prefix}.qzeros"]
        assert tuple(qzeros.shape) == (groups, out_features // 8)
        assert bool((qzeros == SYMMETRIC_QZEROS_WORD).all()), prefix
        g_idx = export[f"{prefix}.g_idx"]
        assert torch.equal(g_idx, torch.arange(in_features, dtype=torch.int32) // 128), prefix
        q = unpack_int4_rows(qweight).float()
        per_input = scales.float().repeat_interleave(AUTOROUND_GROUP_SIZE, dim=0)
        expected = ((q - 8) * per_input).t()
        assert twin[name].dtype == torch.bfloat16
        assert torch.equal(twin[name].float(), expected), prefix


def test_every_quantized_input_fits_the_groups_and_marlins_k(
    written: AutoRoundCheckpoints, tensors: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    _, twin = tensors
    for name in written.quantized:
        out_features, in_features = twin[name].shape
        assert in_features % MARLIN_MIN_K == 0, name
        if ".experts." not in name and not name.endswith(("in_proj_b.weight", "in_proj_a.weight")):
            assert out_features % MARLIN_MIN_N == 0, name  # b and a merge to 2 x 32


def test_sglangs_cpu_model_loads_every_parameter_from_the_twin(
    written: AutoRoundCheckpoints,
) -> None:
    report = script_report(SCENARIO, str(written.dequantized), "bf16")
    assert report["missing"] == []
    assert report["unexpected"] == []


def test_the_sm90_model_loads_the_export_and_takes_marlin_everywhere(
    written: AutoRoundCheckpoints,
) -> None:
    report = script_report(SCENARIO, str(written.autoround), "cuda-choice")
    assert [m for m in report["missing"] if not m.endswith(DERIVED_SUFFIXES)] == []
    assert report["unexpected"] == []
    methods = report["methods"]
    assert methods.pop("lm_head") == "UnquantizedLinearMethod"
    experts = {p for p in methods if p.endswith(".mlp.experts")}
    assert len(experts) == 4
    assert {methods[p] for p in experts} == {"GPTQMarlinMoEMethod"}
    assert {methods[p] for p in methods.keys() - experts} == {"GPTQMarlinLinearMethod"}
    # every quantized tensor's layer is there (merged: q/k/v, gate/up, qkv/z, b/a)
    assert len(methods) == 4 * 2 + 3 * 3 + 3 + 2 + 4


@needs_cpu
def test_a_cpu_engine_serves_the_twin_loaded_at_start(
    written: AutoRoundCheckpoints, tmp_path: Path
) -> None:
    config = EngineConfig(
        written.dequantized_model, plugin=False, server_args={"load_format": "auto"}
    )
    with running_engine(config, tmp_path, models=written.dequantized.parent) as engine:
        generation = engine.generate(GenerateRequest(MODEL.prompt(40, seed=38)))
        log = engine.log_tail(200_000)
    assert len(generation.output_ids) == 8
    assert "not found while loading" not in log


@needs_cpu
def test_sglangs_cpu_path_refuses_the_export_without_its_amx_kernels(
    written: AutoRoundCheckpoints, tmp_path: Path
) -> None:
    """SGLang's CPU AutoRound path needs AMX and its CPU kernel build (``cpu_has_amx_support``:
    ``torch.ops.sgl_kernel.convert_weight_packed``), which no engine here has: the CPU stand-ins
    register only the ops these models' bf16 path calls, whatever the CPU's ``amx`` flags."""
    config = EngineConfig(
        written.autoround_model, plugin=False, server_args={"load_format": "auto"}
    )
    with pytest.raises(EngineStartError, match="requires the Intel AMX CPU backend"):
        start_engine(config, tmp_path, models=written.autoround.parent)
