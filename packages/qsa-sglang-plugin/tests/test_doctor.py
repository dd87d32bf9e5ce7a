"""The doctor's report and exit status on this machine."""

from __future__ import annotations

import resource
import shutil

import pytest

from qsa_sglang_plugin import doctor
from qsa_sglang_plugin._switches import MAX_PREFIX_CACHE_MB
from qsa_sglang_plugin.doctor import Status, run_checks

ON = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"}


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
