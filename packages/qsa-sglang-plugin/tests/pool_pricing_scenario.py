"""SGLang's real pool configurator, repriced by the plugin's hook, beside qsa-core's figures.

Usage: ``python pool_pricing_scenario.py <directory>``. Runs in a fresh process (it publishes
SGLang's process-wide runtime context): for each feature configuration it resolves a real
``ServerArgs`` on CPU, builds SGLang's ``ModelConfig``, ``KVCacheConfigurator`` and
``DefaultPoolConfigurator`` as a model runner does, runs the plugin's AFTER hook on the
configurator, and reports the price SGLang will size its pools by (bytes per token, fixed bytes,
and the token slots SGLang's ``calculate_pool_sizes`` gives :data:`AVAILABLE` bytes) next to what
the capacity plan (QSA: the layout the switches run, ``capacity_plan_from_sglang``) or the doctor
and qsa-core (double sparsity) say for the same flags and switches. The last stdout line is a JSON
object: one entry per configuration, ``engine`` and ``plan`` side by side.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

CHANNELS = Path(__file__).with_name("data") / "tiny-llama-channels.json"
#: The double-sparsity switches of the engine tests (8 heavy channels of 16, 64 heavy tokens).
DS_SWITCHES = {
    "SGLANG_QSA_DS_CHANNEL_CONFIG": str(CHANNELS),
    "SGLANG_QSA_DS_HEAVY_CHANNELS": "8",
    "SGLANG_QSA_DS_HEAVY_TOKENS": "64",
    "SGLANG_QSA_DS_THRESHOLD": "1024",
}
ROWS, CONTEXT = 4, 4096
SIZING = ["--max-running-requests", str(ROWS), "--context-length", str(CONTEXT)]
#: Device bytes SGLang sizes each pool from (after the model's weights), per rank.
AVAILABLE = 1 << 30


def _priced(model_dir: Path, switches: dict[str, str], *flags: str) -> dict[str, Any]:
    """Build SGLang's configurator for ``flags``; price it with the plugin under ``switches``."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        SpecAuxHiddenStateConfig,
    )
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from qsa_sglang_plugin._adapters._namespace import resolved_args
    from qsa_sglang_plugin._adapters._pool_sizing import after_pool_configurator_init
    from qsa_sglang_plugin._switches import current_switches

    for name in [n for n in os.environ if n.startswith("SGLANG_QSA_")]:
        del os.environ[name]
    os.environ.update(switches)
    current_switches.cache_clear()
    args = ["--model-path", str(model_dir), "--device", "cpu", "--disable-radix-cache", *flags]
    server_args = prepare_server_args(args)
    server_args.resolve_once()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    model_config = ModelConfig.from_server_args(server_args)
    layers = int(model_config.num_hidden_layers)
    kvc = KVCacheConfigurator(
        device="cpu",
        gpu_id=0,
        attn_dp_size=1,
        pp_size=1,
        pp_group=None,
        model=None,
        model_config=model_config,
        server_args=server_args,
        kv_cache_dtype=torch.bfloat16,
        kv_cache_dtype_str="auto",
        model_dtype=torch.bfloat16,
        page_size=int(resolved_args(server_args).page_size or 1),
        sliding_window_size=None,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        is_draft_worker=False,
        post_capture_kv_active=False,
        spec_aux_config=SpecAuxHiddenStateConfig(),
        is_hybrid_swa=False,
        is_hybrid_swa_compress=False,
        use_mla_backend=False,
        layer_info=ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers),
        forward_stream=None,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        memory_pool_config=None,
    )
    configurator = DefaultPoolConfigurator(kvc)
    before = (int(configurator._cell_size), int(configurator._fixed_overhead_bytes))
    after_pool_configurator_init(None, configurator, kvc)
    page = int(resolved_args(server_args).page_size or 1)
    pool = configurator.calculate_pool_sizes(AVAILABLE, page)
    return {
        "server_args": server_args,
        "page_size": page,
        "sglang_fixed_bytes": before[1],
        "sglang_token_bytes": before[0],
        "token_bytes": int(configurator._cell_size),
        "fixed_bytes": int(configurator._fixed_overhead_bytes) - before[1],
        "pool_tokens": int(pool.max_total_num_tokens),
    }


def _plan(
    priced: dict[str, Any], text_config: Any, switches: dict[str, str]
) -> dict[str, int | str]:
    """The price of the plan's layout that ``switches`` run, for the flags ``priced`` resolved.

    SGLang's own fixed bytes (the model's, before the hook adds the feature's) come off
    :data:`AVAILABLE` first, as SGLang's sizing takes them.
    """
    from qsa_sglang_plugin import capacity_plan_from_sglang
    from qsa_sglang_plugin._switches import HiSparseMode, parse_switches

    parsed = parse_switches(switches)
    plan = capacity_plan_from_sglang(
        priced["server_args"],
        text_config,
        1 << 40,
        1 << 40,
        sharding_size=parsed.cache_sharding,
        hot_slots=parsed.hot_blocks,
        index_sharded=parsed.index_sharding,
        verify=parsed.verify_offload,
    )
    offloaded = parsed.hisparse is HiSparseMode.P2_OFFLOAD
    price = plan.offloaded_price if offloaded else plan.resident_price
    return {
        "layout": "offloaded" if offloaded else "resident",
        "token_bytes": price.token_bytes,
        "fixed_bytes": price.fixed_bytes,
        "pool_tokens": price.pool_tokens(
            AVAILABLE - priced["sglang_fixed_bytes"], priced["page_size"]
        ),
    }


def _ds_plan(
    priced: dict[str, Any], text_config: Any, switches: dict[str, str]
) -> dict[str, int | str]:
    """Double sparsity's price from the model config (``ds_capacity``, what the doctor prints)."""
    from qsa_sglang_plugin._config_check import ds_capacity
    from qsa_sglang_plugin._switches import parse_switches

    parsed = parse_switches(switches)
    ds = parsed.double_sparsity
    assert ds is not None
    price = ds_capacity(
        text_config, ds, rows=ROWS, context_len=CONTEXT, verify=parsed.verify_offload
    ).price
    assert price is not None
    return {
        "layout": "offloaded" if ds.offload else "resident",
        "token_bytes": price.token_bytes,
        "fixed_bytes": price.fixed_bytes,
        "pool_tokens": price.pool_tokens(
            AVAILABLE - priced["sglang_fixed_bytes"], priced["page_size"]
        ),
    }


def _doctor_labels(model_dir: Path, switches: dict[str, str]) -> dict[str, int]:
    """The label, K/V and pool bytes per token the doctor's double-sparsity line prints."""
    from qsa_sglang_plugin._switches import parse_switches
    from qsa_sglang_plugin.doctor import _check_double_sparsity

    check = _check_double_sparsity(parse_switches(switches), str(model_dir), 1, ROWS, CONTEXT)
    assert check is not None
    found = re.search(r"labels add (\d+) B per token to (\d+) B", check.detail)
    charged = re.search(r"pool sizing charges (\d+) B per token", check.detail)
    assert found is not None, check.detail
    assert charged is not None, check.detail
    return {
        "labels": int(found.group(1)),
        "kv": int(found.group(2)),
        "token_bytes": int(charged.group(1)),
    }


def _qsa_cases(hot_blocks: int) -> tuple[tuple[str, dict[str, str], tuple[str, ...]], ...]:
    """Every QSA configuration that prices the pool: (name, switches, extra flags).

    The tiny Qwen model has two K/V heads: on four TP ranks each head's two copies form a shard
    group. ``hot_blocks`` sets the hot caches of one offload case.
    """
    compat = {"SGLANG_QSA_MODEL_COMPAT": "1"}
    offload = {**compat, "SGLANG_QSA_HISPARSE_V3": "p2-offload"}
    tp4 = ("--tp-size", "4")
    one = ("--prefill-max-requests", "1")  # the offload refuses no limit at start-up
    # Two prompts staged at once: the staging area the plan prints is the one pool sizing charges.
    staged = ("--prefill-max-requests", "2")
    sharded = {**compat, "SGLANG_QSA_CACHE_SHARDING": "2"}
    return (
        ("p2-resident", {**compat, "SGLANG_QSA_HISPARSE_V3": "p2-resident"}, ()),
        ("p2-offload", offload, staged),
        (
            "p2-offload, hot blocks",
            {**offload, "SGLANG_QSA_HISPARSE_HOT_BLOCKS": str(hot_blocks)},
            one,
        ),
        (
            "p2-offload, host arena sharded (D1)",
            {**offload, "SGLANG_QSA_CACHE_SHARDING": "2"},
            (*tp4, *one),
        ),
        (
            "p2-offload, host arena and index sharded (D1 + D2)",
            {**offload, "SGLANG_QSA_CACHE_SHARDING": "2", "SGLANG_QSA_INDEX_SHARDING": "1"},
            (*tp4, *one),
        ),
        ("p2-offload, verify", {**offload, "SGLANG_QSA_HISPARSE_VERIFY": "1"}, one),
        (
            "p2-offload, prefix cache",
            {**offload, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64"},
            staged,
        ),
        ("resident sharding (D1)", sharded, tp4),
        (
            "resident sharding, index sharded (D2)",
            {**sharded, "SGLANG_QSA_INDEX_SHARDING": "1"},
            tp4,
        ),
        (
            "index sharded alone (D2 without D1)",
            {**compat, "SGLANG_QSA_INDEX_SHARDING": "1"},
            ("--tp-size", "2"),
        ),
        (
            "p2-offload, index sharded alone (D2 without D1)",
            {**offload, "SGLANG_QSA_INDEX_SHARDING": "1"},
            ("--tp-size", "2", *one),
        ),
    )


def main(directory: str) -> dict[str, Any]:
    """Every configuration's price beside the figures printed for it."""
    from qsa_testing.standins import install_cpu_engine_standins

    install_cpu_engine_standins()
    from qsa_core import QSAProfile
    from qsa_testing import tiny_llama, tiny_qwen4_exp

    qwen, llama = tiny_qwen4_exp(), tiny_llama()
    qwen_dir, llama_dir = qwen.write(Path(directory)), llama.write(Path(directory))
    report: dict[str, Any] = {}

    # Twice one step's selection: more hot slots than the default and fewer than a context holds.
    hot = 2 * QSAProfile.from_text_config(qwen.text_config).block_topk
    for name, switches, flags in _qsa_cases(hot):
        priced = _priced(qwen_dir, switches, *SIZING, *flags)
        plan = _plan(priced, qwen.text_config, switches)
        del priced["server_args"]
        report[name] = {"engine": priced, "plan": plan}

    ds_offload_switches = {**DS_SWITCHES, "SGLANG_QSA_DS_OFFLOAD": "1"}
    for name, switches in (
        ("qsa_ds", DS_SWITCHES),
        ("DS-Offload", ds_offload_switches),
        ("DS-Offload, verify", {**ds_offload_switches, "SGLANG_QSA_HISPARSE_VERIFY": "1"}),
        (
            "DS-Offload, whole staging",
            {**ds_offload_switches, "SGLANG_QSA_DS_OFFLOAD_STAGING": "whole"},
        ),
    ):
        priced = _priced(llama_dir, switches, *SIZING)
        del priced["server_args"]
        report[name] = {
            "engine": priced,
            "plan": _ds_plan(priced, llama.text_config, switches),
            "doctor": _doctor_labels(llama_dir, switches),
        }
    return report


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1])) + "\n")
