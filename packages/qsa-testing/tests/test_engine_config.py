"""Engine configurations: validated at once, hashable, and turned into the server's arguments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qsa_testing import (
    EngineConfig,
    EngineConfigError,
    GenerateRequest,
    Platform,
    platform_standins,
    tiny_llama,
    tiny_qwen4_exp,
)
from qsa_testing._engine import _cpu_environment, _environment, _server_args, sum_samples
from qsa_testing.standins import CPU_STANDINS, ENV_STANDINS, StandIn, boot_directory


def test_equal_configurations_are_one_engine_and_replicas_are_not() -> None:
    a = EngineConfig(tiny_qwen4_exp(), server_args={"chunked_prefill_size": 1024, "x": 1})
    b = EngineConfig(tiny_qwen4_exp(), server_args={"x": 1, "chunked_prefill_size": 1024})
    assert a == b
    assert hash(a) == hash(b)
    assert EngineConfig(tiny_llama(), replica=1) != EngineConfig(tiny_llama())
    assert len({a, b, EngineConfig(tiny_llama()), EngineConfig(tiny_llama(), replica=1)}) == 3


def test_switches_must_be_string_valued_qsa_variables() -> None:
    with pytest.raises(EngineConfigError, match="PATH='/x' is not allowed"):
        EngineConfig(tiny_llama(), switches={"PATH": "/x"})
    with pytest.raises(EngineConfigError, match="SGLANG_QSA_HISPARSE_V3=1"):
        EngineConfig(tiny_llama(), switches={"SGLANG_QSA_HISPARSE_V3": 1})  # type: ignore[dict-item]


def test_switches_without_the_plugin_are_refused() -> None:
    with pytest.raises(EngineConfigError, match="need plugin=True"):
        EngineConfig(tiny_llama(), plugin=False, switches={"SGLANG_QSA_HISPARSE_V3": "p2-offload"})


def test_harness_owned_server_args_are_refused() -> None:
    with pytest.raises(EngineConfigError, match=r"\['port'\] are set by the harness"):
        EngineConfig(tiny_llama(), server_args={"port": 1})
    with pytest.raises(EngineConfigError, match="not JSON-serialisable"):
        EngineConfig(tiny_llama(), server_args={"page_size": object()})


def test_unknown_standins_are_refused() -> None:
    with pytest.raises(ValueError, match="no_such"):
        EngineConfig(tiny_llama(), standins=frozenset({"no_such"}))  # type: ignore[arg-type]


def test_overrides_win_and_the_harness_sets_model_host_and_port(tmp_path: Path) -> None:
    config = EngineConfig(tiny_qwen4_exp(), server_args={"chunked_prefill_size": 1024})
    args = _server_args(config, Platform.CPU, tmp_path / "m", 4321)
    assert args["chunked_prefill_size"] == 1024
    assert (args["model_path"], args["host"], args["port"]) == (
        str(tmp_path / "m"),
        "127.0.0.1",
        4321,
    )
    assert (args["device"], args["load_format"], args["page_size"]) == ("cpu", "dummy", 64)
    assert args["enable_multimodal"] is False
    assert "page_size" not in _server_args(EngineConfig(tiny_llama()), Platform.CPU, tmp_path, 1)
    assert _server_args(config, Platform.CUDA, tmp_path, 1)["device"] == "cuda"


def test_a_cuda_engine_outlives_its_first_forwards_kernel_compiles(tmp_path: Path) -> None:
    """SGLang's watchdog kills a scheduler whose forward runs 300 s; a fresh GPU machine's first
    Qwen4Exp forward compiles the GDN kernels for longer than that."""
    cuda = _server_args(EngineConfig(tiny_qwen4_exp()), Platform.CUDA, tmp_path, 1)
    assert cuda["watchdog_timeout"] >= 1800
    assert "watchdog_timeout" not in _server_args(
        EngineConfig(tiny_qwen4_exp()), Platform.CPU, tmp_path, 1
    )


def test_a_request_body_asks_for_ignore_eos_only_when_the_request_does() -> None:
    plain = GenerateRequest((5, 6, 7), max_new_tokens=3)
    assert plain.body()["sampling_params"] == {"max_new_tokens": 3, "temperature": 0.0}
    ignoring = GenerateRequest((5, 6, 7), max_new_tokens=3, ignore_eos=True)
    assert ignoring.body()["sampling_params"] == {
        "max_new_tokens": 3,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    assert ignoring != plain  # the pool serves them apart


def test_environment_names_plugins_switches_and_standins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB", "7")  # must not leak in
    upstream = _environment(EngineConfig(tiny_llama(), plugin=False), Platform.CPU, tmp_path)
    assert upstream["SGLANG_PLUGINS"] != "qsa_hisparse"
    assert "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB" not in upstream
    assert upstream["SGLANG_USE_CPU_ENGINE"] == "1"
    standins = set(upstream[ENV_STANDINS].split(","))
    assert standins == {s.value for s in platform_standins(Platform.CPU)}
    assert {s.value for s in CPU_STANDINS | {StandIn.DUMMY_WEIGHT_RANGE}} == standins
    assert upstream["PYTHONPATH"].split(":")[0] == str(boot_directory())

    config = EngineConfig(
        tiny_llama(),
        switches={"SGLANG_QSA_HISPARSE_V3": "p2-offload"},
        standins={StandIn.PERTURB_DECODE_SELECTION},
    )
    env = _environment(config, Platform.CUDA, tmp_path)
    assert env["SGLANG_PLUGINS"] == "qsa_hisparse"
    assert env["SGLANG_QSA_HISPARSE_V3"] == "p2-offload"
    assert set(env[ENV_STANDINS].split(",")) == {
        s.value for s in platform_standins(Platform.CUDA) | {StandIn.PERTURB_DECODE_SELECTION}
    }
    assert Path(env["SGLANG_QSA_HISPARSE_ACTIVATION_DIR"]).is_dir()


def test_a_cpu_engine_of_several_tp_ranks_splits_the_cores_and_loads_no_nccl(
    tmp_path: Path,
) -> None:
    config = EngineConfig(tiny_qwen4_exp(), plugin=False, server_args={"tp_size": 2})
    env = _environment(config, Platform.CPU, tmp_path)
    library = Path(env["SGLANG_NCCL_SO_PATH"])
    assert library.is_relative_to(tmp_path)
    assert not library.exists()
    ranks = [
        {int(c) for c in run.split(",")} for run in env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")
    ]
    assert len(ranks) == 2
    assert set.union(*ranks) == os.sched_getaffinity(0)
    assert not ranks[0] & ranks[1]
    # Runs in core order, the first ranks one core longer where the cores do not divide.
    bind = _cpu_environment(3, tmp_path, cores={6, 0, 1, 2, 3, 4, 5})
    assert bind["SGLANG_CPU_OMP_THREADS_BIND"] == "0,1,2|3,4|5,6"
    # One rank on every core (SGLang's own default), or a CUDA engine, changes nothing.
    assert _cpu_environment(1, tmp_path) == {}
    cuda = _environment(config, Platform.CUDA, tmp_path)
    assert "SGLANG_NCCL_SO_PATH" not in cuda
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in cuda


def test_each_xdist_workers_engines_keep_to_its_own_cores(tmp_path: Path) -> None:
    """Two workers' engines never share a core for their OpenMP threads; an engine with more
    ranks than its worker's share spreads them over the machine instead."""
    two = {0, 1}
    bind = "SGLANG_CPU_OMP_THREADS_BIND"
    assert _cpu_environment(1, tmp_path, cores=two, worker=(0, 2))[bind] == "0"
    assert _cpu_environment(1, tmp_path, cores=two, worker=(1, 2))[bind] == "1"
    assert _cpu_environment(2, tmp_path, cores=two, worker=(1, 2))[bind] == "0|1"
    four = {0, 1, 2, 3}
    assert _cpu_environment(2, tmp_path, cores=four, worker=(1, 2))[bind] == "1|3"
    assert _cpu_environment(1, tmp_path, cores=four, worker=(0, 1)) == {}
    # More workers than cores: every worker's engines use every core.
    assert _cpu_environment(1, tmp_path, cores=two, worker=(2, 3)) == {}


def test_more_tp_ranks_than_cores_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(EngineConfigError, match=r"tp_size=3 is not allowed on this CPU: 2 cores"):
        _cpu_environment(3, tmp_path, cores={0, 1})


def test_labels_are_filesystem_safe_and_tell_configurations_apart() -> None:
    configs = [
        EngineConfig(tiny_qwen4_exp(), plugin=False),
        EngineConfig(tiny_qwen4_exp()),
        EngineConfig(tiny_qwen4_exp(), server_args={"chunked_prefill_size": 1024}),
        EngineConfig(tiny_qwen4_exp(), plugin=False, replica=1),
        EngineConfig(tiny_qwen4_exp(), switches={"SGLANG_QSA_HISPARSE_V3": "p2-offload"}),
    ]
    labels = [c.label for c in configs]
    assert len(set(labels)) == len(labels)
    assert all("/" not in label and " " not in label for label in labels)


def test_metric_sums_the_named_series_over_the_label_sets_asked_for() -> None:
    text = (
        "# HELP qsa_x_total x\n# TYPE qsa_x_total counter\n"
        'qsa_x_total{tp_rank="0",outcome="aborted"} 2.0\n'
        'qsa_x_total{tp_rank="1",outcome="aborted"} 3.0\n'
        'qsa_x_total{tp_rank="0",outcome="finished"} 7.0\n'
        "qsa_x_created 1.7e9\n"
        "qsa_y 5.0\n"
    )
    assert sum_samples(text, "qsa_x_total") == 12.0
    assert sum_samples(text, "qsa_x_total", outcome="aborted") == 5.0
    assert sum_samples(text, "qsa_x_total", outcome="aborted", tp_rank="1") == 3.0
    assert sum_samples(text, "qsa_x_total", outcome="retracted") == 0.0
    assert sum_samples(text, "qsa_y") == 5.0
    assert sum_samples(text, "qsa_z") == 0.0
