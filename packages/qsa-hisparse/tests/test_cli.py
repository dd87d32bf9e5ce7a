"""The ``qsa-hisparse`` command dispatches each subcommand to the package that owns it."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

from qsa_core import QWEN38_FLASH_NEXT
from qsa_hisparse import main
from qsa_hisparse._demo import prefix_cache_demo, synthetic_selections, trace_decode
from qsa_pytest.refusals import refusal_in_fresh_interpreter


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` exits 0 and names demo, plan, launch, doctor and calibrate."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "plan", "launch", "doctor", "calibrate"):
        assert command in out


def test_unknown_command_is_refused_with_the_allowed_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A misspelt command exits 2 and the message lists the valid choices."""
    with pytest.raises(SystemExit) as excinfo:
        main(["lanuch"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "'lanuch'" in err
    assert "launch" in err


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """Running with nothing prints the usage and exits 2 (not a silent success)."""
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().out


def test_plan_is_qsa_cores_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan`` forwards its options to qsa-core's plan command."""
    assert main(["plan", "--requests", "3", "--context-len", "131072"]) == 0
    out = capsys.readouterr().out
    assert "3 requests × 131,072 tokens" in out
    assert "host K/V arena" in out


def test_demo_prints_the_plan_and_the_hot_cache_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo runs on CPU and prints both parts for the default 8 × 262,144-token setup."""
    assert main(["demo", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "most 262,144-token requests that fit: offloaded 8, resident 5" in out
    assert "Synthetic decode through the hot-cache residency contract" in out
    assert "2,048      4.00x" in out
    # The same picture behind the same placeholders hits; another picture never does.
    assert "bob    cached tokens     0" in out
    assert "carol  cached tokens   448" in out


def test_prefix_cache_demo_reuses_each_previous_turn() -> None:
    """Every turn after the first restores exactly the previous turn's full pages."""
    report = prefix_cache_demo(QWEN38_FLASH_NEXT, turns=3, turn_tokens=200, seed=3)
    rows = [line.split() for line in report.splitlines() if line.strip()[:1].isdigit()]
    prompt_tokens = [int(r[1].replace(",", "")) for r in rows[:3]]
    cached = [int(r[2].replace(",", "")) for r in rows[:3]]
    assert cached[0] == 0
    for previous, now in zip(prompt_tokens, cached[1:], strict=False):
        assert now == previous // 64 * 64


def test_trace_first_step_misses_every_block_then_reuses_the_cache() -> None:
    """An empty hot cache misses all K blocks once; a 4x cache then hits most of a stable set."""
    k = QWEN38_FLASH_NEXT.block_topk
    num_blocks, selections = synthetic_selections(
        QWEN38_FLASH_NEXT, context_len=16_384, steps=5, noise=0.0, seed=7
    )
    trace = trace_decode(selections, num_blocks, num_slots=4 * k, bytes_per_block=2048)
    assert trace.first_step_misses == k
    # Without noise only the recent window moves: at most one new block per step.
    assert all(m <= 1 for m in trace.steady_misses)


def test_console_script_is_installed() -> None:
    """The ``qsa-hisparse`` executable exists in the environment and answers ``--help``."""
    exe = shutil.which("qsa-hisparse", path=str(pathlib.Path(sys.executable).parent))
    assert exe is not None
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "doctor" in done.stdout


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--steps", "0"], "--steps: '0' is not allowed; allowed: an integer from 1 to 1,000"),
        (["--steps", "10001"], "--steps: '10001' is not allowed"),
        (["--context-len", "-1"], "'-1' is not allowed; allowed: an integer from 2,048 to 16,7"),
        (["--context-len", "1" + "0" * 20], f"--context-len: '1{'0' * 20}' is not allowed"),
        (["--context-len", "9" * 5000], "--context-len: '9999999999"),
        (["--context-len", "1e20"], "--context-len: '1e20' is not allowed"),
        (["--requests", "0"], "--requests: '0' is not allowed"),
        (["--noise", "nan"], "--noise nan is not allowed"),
        (["--noise", "1e300"], "--noise 1e+300 is not allowed; allowed: a number from 0 to 100"),
        (["--seed", "-1"], "--seed: '-1' is not allowed"),
    ],
)
def test_demo_refuses_values_it_cannot_run_naming_the_flag_before_torch_loads(
    argv: list[str], fragment: str
) -> None:
    """Exit status 2 and one line naming the flag and what is allowed, never a traceback, and
    before torch is imported (a refusal took 4.6 s; a 20-digit context ran out of memory)."""
    ended = refusal_in_fresh_interpreter("qsa_hisparse", ["demo", *argv])
    assert ended.returncode == 2, ended.stderr
    assert fragment in ended.stderr
    assert "Traceback" not in ended.stderr
    assert ended.stderr.splitlines()[-1].startswith("qsa-hisparse demo: error: ")
    assert ended.imported == frozenset(), "torch was imported before the refusal"


def test_plan_help_names_itself_and_shows_defaults_and_dtypes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: qsa-hisparse plan")
    assert "(default: 64)" in out
    assert "{bf16,fp8_e4m3}" in out
    assert "qsa-plan" not in out


def test_plan_with_a_missing_config_says_so(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.json"
    assert main(["plan", "--config", str(missing)]) == 2
    assert f"qsa-hisparse plan: error: --config {str(missing)!r}: no such file" in (
        capsys.readouterr().err
    )
