"""An engine host forks each child with its own environment, session, directory and log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from qsa_testing._forkhost import FORKED_MARKER, ForkHost, HostKey

PRELOADED = """
import os
IMPORTED_IN = os.getpid()
"""
CHILD = """
import json, os, sys, time
import preloaded_probe
print(json.dumps({
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "session_leader": os.getsid(0) == os.getpid(),
    "host_only": os.environ.get("HOST_ONLY"),
    "child_only": os.environ.get("CHILD_ONLY"),
    "imported_before_the_fork": preloaded_probe.IMPORTED_IN != os.getpid(),
}))
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def host(tmp_path: Path) -> Iterator[ForkHost]:
    code = tmp_path / "code"
    code.mkdir()
    (code / "preloaded_probe.py").write_text(textwrap.dedent(PRELOADED))
    (code / "child_probe.py").write_text(textwrap.dedent(CHILD))
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join([str(code), *sys.path])}
    host = ForkHost(HostKey.of(["preloaded_probe"], {**env, "HOST_ONLY": "1"}), tmp_path / "h")
    host.start()
    yield host
    host.close()


def test_a_child_runs_its_module_with_its_own_environment_directory_and_log(
    host: ForkHost, tmp_path: Path
) -> None:
    import json

    workdir = tmp_path / "work"
    workdir.mkdir()
    log = tmp_path / "child.log"
    env = {"PATH": os.environ["PATH"], "CHILD_ONLY": "yes"}
    child = host.spawn("child_probe", ["exit", "3"], env, workdir, log)
    assert child.wait(timeout=120) == 3
    assert child.poll() == 3
    lines = log.read_text().splitlines()
    assert lines[0].startswith(f"{FORKED_MARKER} ")
    report = json.loads(lines[-1])
    assert report == {
        "argv": ["exit", "3"],
        "cwd": str(workdir),
        "session_leader": True,
        "host_only": None,
        "child_only": "yes",
        "imported_before_the_fork": True,
    }


def test_a_child_that_raises_exits_1_with_its_traceback_in_its_log(
    host: ForkHost, tmp_path: Path
) -> None:
    log = tmp_path / "child.log"
    child = host.spawn("child_probe", ["exit", "not-a-number"], {}, tmp_path, log)
    assert child.wait(timeout=120) == 1
    assert "ValueError: invalid literal for int()" in log.read_text()


def test_closing_the_host_kills_every_child_it_started(host: ForkHost, tmp_path: Path) -> None:
    child = host.spawn("child_probe", ["sleep", "0"], {}, tmp_path, tmp_path / "child.log")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.5)
    host.close()
    with pytest.raises(ProcessLookupError):
        os.killpg(child.pid, 0)


def test_a_child_killed_by_a_signal_reports_it(host: ForkHost, tmp_path: Path) -> None:
    child = host.spawn("child_probe", ["sleep", "0"], {}, tmp_path, tmp_path / "child.log")
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=120) == -signal.SIGKILL
