"""The doctor's report and exit status on this machine."""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from qsa_pytest.refusals import malformed_json
from qsa_sglang_plugin import doctor
from qsa_sglang_plugin._switches import MAX_PREFIX_CACHE_MB
from qsa_sglang_plugin.doctor import Status, run_checks
from qsa_testing import tiny_llama

ON = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"}
CHANNELS = Path(__file__).with_name("data") / "tiny-llama-channels.json"


def _by_name(env: dict[str, str], tp_size: int = 1) -> dict[str, doctor.Check]:
    return {c.name: c for c in run_checks(env, tp_size=tp_size)}


def test_installed_stack_and_fingerprints_pass() -> None:
    """Versions, entry point and fingerprints pass in this environment."""
    checks = _by_name(ON)
    for name in ("versions", "plugin", "fingerprints", "switches", "numa"):
        assert checks[name].status is Status.OK, checks[name]
    assert "sglang 0.5.23" in checks["versions"].detail


def test_gpu_check_fails_without_a_driver() -> None:
    """Without nvidia-smi the GPU check fails; with it, it lists the devices."""
    gpu = _by_name(ON)["gpu"]
    if shutil.which("nvidia-smi") is None:
        assert gpu.status is Status.FAIL
        assert "nvidia-smi" in gpu.detail
    else:
        assert "sm " in gpu.detail or gpu.status is Status.FAIL


def test_prefix_cache_budget_beyond_host_fails() -> None:
    """A budget larger than the host's memory fails host memory, and memlock unless unlimited."""
    env = {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": str(MAX_PREFIX_CACHE_MB)}  # 16 TiB
    checks = _by_name(env, tp_size=2)
    assert checks["host memory"].status is Status.FAIL
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    expected = Status.OK if soft == resource.RLIM_INFINITY else Status.FAIL
    assert checks["memlock"].status is expected
    if expected is Status.FAIL:
        assert "ulimit -l" in checks["memlock"].detail


def test_excluding_allow_list_fails_plugin_check() -> None:
    """SGLANG_PLUGINS without qsa_hisparse makes the plugin check fail, naming the value."""
    plugin = _by_name({**ON, "SGLANG_PLUGINS": "other"})["plugin"]
    assert plugin.status is Status.FAIL
    assert "SGLANG_PLUGINS='other'" in plugin.detail


def test_main_exits_nonzero_on_malformed_switch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A malformed switch is a failing line of the report and a non-zero exit."""
    monkeypatch.setenv("SGLANG_QSA_MODEL_COMPAT", "2")
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] switches: SGLANG_QSA_MODEL_COMPAT='2'" in out
    assert "serving would fail" in out


def _ds_env(channels: Path) -> dict[str, str]:
    return {"SGLANG_QSA_DS_CHANNEL_CONFIG": str(channels), "SGLANG_QSA_DS_HEAVY_CHANNELS": "8"}


def test_double_sparsity_channel_file_is_loaded_against_the_model(tmp_path: Path) -> None:
    """The file fits the tiny Llama: its label bytes per token are priced as start-up prices
    them (2 layers x 2 KV heads x 8 channels x 2 B = 64 B beside 256 B of K/V)."""
    model = tiny_llama().write(tmp_path)
    checks = {c.name: c for c in run_checks(_ds_env(CHANNELS), model_path=str(model))}
    ds = checks["double sparsity"]
    assert ds.status is Status.OK, ds
    assert "8 of 16 channels per KV head for 2 layers x 2 KV heads" in ds.detail
    assert "labels add 64 B per token to 256 B of bf16 K/V (25.0%)" in ds.detail
    assert "pool sizing charges 320 B per token plus 0 B fixed" in ds.detail


def test_double_sparsity_prices_a_token_per_tp_rank_and_refuses_a_tp_size_by_name(
    tmp_path: Path,
) -> None:
    """At TP2 each rank holds one of the two KV heads: half the K/V and labels per token; TP3
    splits them neither way."""
    model = tiny_llama().write(tmp_path)
    ds = {c.name: c for c in run_checks(_ds_env(CHANNELS), tp_size=2, model_path=str(model))}
    assert ds["double sparsity"].status is Status.OK, ds
    assert "2 KV heads (each of 2 TP ranks holds 1)" in ds["double sparsity"].detail
    assert "labels add 32 B per token to 128 B of bf16 K/V" in ds["double sparsity"].detail
    refused = run_checks(_ds_env(CHANNELS), tp_size=3, model_path=str(model))
    check = {c.name: c for c in refused}["double sparsity"]
    assert check.status is Status.FAIL
    assert "is refused at --tp-size=3: tp_size=3 does not split 2 K/V heads" in check.detail


def test_ds_offload_shows_what_the_gpu_and_the_host_hold_per_token(tmp_path: Path) -> None:
    model = tiny_llama().write(tmp_path)
    env = {**_ds_env(CHANNELS), "SGLANG_QSA_DS_OFFLOAD": "1"}
    ds = {c.name: c for c in run_checks(env, model_path=str(model))}["double sparsity"]
    assert ds.status is Status.OK, ds
    assert "DS-Offload: the GPU keeps the 64 B of labels per token (4.0x fewer" in ds.detail
    assert "the pinned host arena the 256 B of K/V per token" in ds.detail
    assert "give --max-running-requests to price DS-Offload's buffers" in ds.detail
    priced = run_checks(env, model_path=str(model), max_running_requests=4, context_length=4096)
    ds = {c.name: c for c in priced}["double sparsity"]
    assert re.search(r"pool sizing charges 64 B per token plus \d+\.\d{3} MiB fixed", ds.detail)


def test_a_malformed_channel_file_fails_the_doctor_naming_the_field(tmp_path: Path) -> None:
    rows = json.loads(CHANNELS.read_text(encoding="utf-8"))
    rows["model.layers.1.self_attn.qk_proj"][0][3] = 16  # past head_dim 16
    bad = tmp_path / "channels.json"
    bad.write_text(json.dumps(rows), encoding="utf-8")
    model = tiny_llama().write(tmp_path / "model")
    ds = {c.name: c for c in run_checks(_ds_env(bad), model_path=str(model))}["double sparsity"]
    assert ds.status is Status.FAIL
    for fragment in (str(bad), "model.layers.1.self_attn.qk_proj", "channel 16"):
        assert fragment in ds.detail, ds.detail


def test_double_sparsity_without_a_model_path_is_a_warning() -> None:
    ds = {c.name: c for c in run_checks(_ds_env(CHANNELS))}["double sparsity"]
    assert ds.status is Status.WARN
    assert "give --model-path" in ds.detail


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=malformed_json())
def test_a_malformed_model_config_is_a_warning_naming_it_in_each_check(
    tmp_path: Path, content: bytes
) -> None:
    """Non-UTF-8 bytes, 6,000-digit integers or deep nesting in config.json (a traceback, or
    CPython's words) is one warning line per check that reads it, naming the file."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_bytes(content)
    budgets = ["--gpu-budget-gib", "1", "--host-budget-gib", "1", "--max-running-requests", "2"]
    flags = doctor.build_parser().parse_args(["--model-path", str(model), *budgets])
    plan, table = doctor.plan_check(flags, {})
    checks = {c.name: c for c in run_checks(_ds_env(CHANNELS), model_path=str(model))}
    for check in (plan, checks["double sparsity"]):
        assert check.status is Status.WARN, check
        assert check.detail.startswith(f"--model-path config {str(model / 'config.json')!r}")
    assert table is None


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=malformed_json())
def test_a_malformed_channel_file_fails_the_doctor_naming_it(
    tmp_path: Path, content: bytes
) -> None:
    model = tiny_llama().write(tmp_path / "model")
    bad = tmp_path / "channels.json"
    bad.write_bytes(content)
    ds = {c.name: c for c in run_checks(_ds_env(bad), model_path=str(model))}["double sparsity"]
    assert ds.status is Status.FAIL
    assert f"channel config {str(bad)!r}" in ds.detail, ds.detail


def test_a_model_config_without_head_counts_fails_the_double_sparsity_check_by_name(
    tmp_path: Path,
) -> None:
    model = tiny_llama().write(tmp_path / "model")
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    del config["num_attention_heads"]
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    ds = {c.name: c for c in run_checks(_ds_env(CHANNELS), model_path=str(model))}[
        "double sparsity"
    ]
    assert ds.status is Status.FAIL
    assert "--model-path num_attention_heads is missing" in ds.detail


def test_a_kv_cache_dtype_outside_the_supported_ones_is_refused_without_a_model_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was ignored unless --model-path was given."""
    with pytest.raises(SystemExit) as exited:
        doctor.main(["--kv-cache-dtype", "bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-cache-dtype: invalid choice: 'bogus'" in err
    assert "'fp8_e4m3'" in err


def _flagship_tp8_flags(tmp_path: Path) -> argparse.Namespace:
    """The doctor's flags for Qwen3.8-Flash-Next at TP8, 256K context, 8 requests."""
    from qsa_core import QWEN38_FLASH_NEXT_TEXT_CONFIG

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(QWEN38_FLASH_NEXT_TEXT_CONFIG)))
    args = ["--model-path", str(model), "--tp-size", "8", "--context-length", "262144"]
    budgets = ["--gpu-budget-gib", "64", "--host-budget-gib", "12", "--max-running-requests", "8"]
    return doctor.build_parser().parse_args([*args, *budgets])


def test_the_plan_shows_the_compressed_index_per_rank_with_index_sharding(tmp_path: Path) -> None:
    """``SGLANG_QSA_INDEX_SHARDING=1``: the plan line names the shard group and the index bytes
    one rank holds (a quarter at TP8 in groups of 4), and the table says so."""
    from qsa_core import format_bytes

    flags = _flagship_tp8_flags(tmp_path)
    env = {"SGLANG_QSA_CACHE_SHARDING": "4"}
    d1, _ = doctor.plan_check(flags, env)
    d2, table = doctor.plan_check(flags, {**env, "SGLANG_QSA_INDEX_SHARDING": "1"})
    assert "compressed index" not in d1.detail
    assert "compressed index sharded over 4 ranks" in d2.detail
    quarter = (8 * 262144 + 64) * 768 // 4
    assert f"({format_bytes(quarter)} per rank" in d2.detail
    assert table is not None
    assert "(192 B on this rank)" in table


def test_the_plan_prices_the_offload_with_the_index_sharded_alone(tmp_path: Path) -> None:
    """``p2-offload`` with ``SGLANG_QSA_INDEX_SHARDING=1`` and no cache sharding at TP8: the
    offloaded layout's token is an eighth of the index (96 B), so more requests fit it."""
    flags = _flagship_tp8_flags(tmp_path)
    offload = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"}
    plain, plain_table = doctor.plan_check(flags, offload)
    alone, table = doctor.plan_check(flags, {**offload, "SGLANG_QSA_INDEX_SHARDING": "1"})
    assert "compressed index sharded over 8 ranks" in alone.detail
    assert plain_table is not None
    assert table is not None
    assert "offloaded 768 B per token" in plain_table
    assert "offloaded 96 B per token" in table

    def fits(check: doctor.Check) -> int:
        found = re.search(r"offload fits (\d+)", check.detail)
        assert found is not None, check.detail
        return int(found.group(1))

    assert fits(alone) >= fits(plain)


def test_the_plan_shows_the_index_sharded_alone_over_every_tp_rank(tmp_path: Path) -> None:
    """``SGLANG_QSA_INDEX_SHARDING=1`` without cache sharding: the index over all 8 TP ranks (an
    eighth per rank), the resident layout's raw K/V whole."""
    from qsa_core import format_bytes

    flags = _flagship_tp8_flags(tmp_path)
    check, table = doctor.plan_check(flags, {"SGLANG_QSA_INDEX_SHARDING": "1"})
    assert "compressed index sharded over 8 ranks" in check.detail
    assert "host K/V sharded" not in check.detail
    assert f"({format_bytes((8 * 262144 + 64) * 768 // 8)} per rank" in check.detail
    assert table is not None
    assert "(96 B on this rank)" in table
