"""The launcher's readiness and failure paths, against a stand-in server (no GPU, no SGLang)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from qsa_pytest.processes import hang_guard_s, wait_until
from qsa_sglang_plugin import launch
from qsa_sglang_plugin._activation import read_records
from qsa_sglang_plugin._errors import LaunchError
from qsa_sglang_plugin._readiness import _healthy, server_topology, wait_ready
from qsa_sglang_plugin._supervisor import ServerGroup
from qsa_sglang_plugin._switches import ENV_ACTIVATION_DIR, parse_switches

STANDIN = """
import http.server, os, subprocess, sys, threading, time
from pathlib import Path
from qsa_sglang_plugin._activation import ActivationRecord, write_record
from qsa_sglang_plugin._switches import current_switches
from qsa_sglang_plugin._versions import installed_versions

mode = os.environ["STANDIN_MODE"]
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
tp = int(args[args.index("--tp-size") + 1]) if "--tp-size" in args else 1
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
Path(os.environ["STANDIN_CHILD_PID"]).write_text(str(child.pid))
if mode == "exit-early":
    sys.exit(3)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass

if mode != "never-healthy":
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
switches = current_switches()
ranks = {"ok": range(tp), "missing-rank": range(tp - 1), "never-healthy": range(tp),
         "duplicate": [0, 0]}[mode]
for n, rank in enumerate(ranks):
    record = ActivationRecord(
        pid=os.getpid() + n, role="scheduler", tp_rank=rank, pp_rank=0,
        features=tuple(f.value for f in switches.features),
        hisparse_mode=switches.hisparse.value if switches.hisparse else None,
        prefix_cache_mb=switches.prefix_cache_mb,
        hooks=(), versions=installed_versions(), created_unix=time.time())
    write_record(record, Path(os.environ["SGLANG_QSA_HISPARSE_ACTIVATION_DIR"]))
time.sleep(600)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in server script; switches on, SGLANG_PLUGINS unset, child pid file set."""
    script = tmp_path / "standin.py"
    script.write_text(STANDIN, encoding="utf-8")
    for var in ("SGLANG_PLUGINS", "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SGLANG_QSA_MODEL_COMPAT", "1")
    monkeypatch.setenv("SGLANG_QSA_HISPARSE_V3", "p2-offload")
    monkeypatch.setenv("STANDIN_CHILD_PID", str(tmp_path / "child.pid"))
    return script


def _model(tmp_path: Path) -> Path:
    """A model directory the launcher's pre-flight accepts (the stand-in never reads it)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}", encoding="utf-8")
    return model


def _argv(script: Path, tmp_path: Path, *server: str, timeout: float = 20.0) -> list[str]:
    serving = ["--model-path", str(_model(tmp_path)), "--page-size", "64", "--device", "cpu"]
    return [
        "--server-command",
        f"{sys.executable} {script}",
        "--activation-dir",
        str(tmp_path / "activation"),
        "--timeout",
        str(timeout),
        "--poll-interval",
        "0.1",
        "--stop-grace",
        "3",
        "--",
        "--port",
        str(_free_port()),
        *serving,
        *server,
    ]


def _child_pid(tmp_path: Path) -> int:
    return int((tmp_path / "child.pid").read_text())


def _launch_fails(
    mode: str,
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """Run the launcher on the stand-in in ``mode``; check it fails and stops the server's child.

    Returns:
        The launcher's stderr.
    """
    monkeypatch.setenv("STANDIN_MODE", mode)
    assert launch.main(argv) == 1
    assert not _alive(_child_pid(tmp_path))
    return capsys.readouterr().err


def test_server_exiting_early_fails_and_leaves_no_orphan(
    standin: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The server's early exit status is reported, and its still-running child is stopped."""
    err = _launch_fails("exit-early", _argv(standin, tmp_path), tmp_path, monkeypatch, capsys)
    assert "exited with status 3 before it was ready" in err


def _times_out(
    mode: str,
    standin: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *server: str,
    records: int,
    healthy: bool,
) -> str:
    """Start the stand-in in ``mode``; once it has written ``records`` records (and, if
    ``healthy``, answers /health), let the readiness wait time out; check it stops the server's
    child.

    The wait starts only after the stand-in has done everything it will do, so what the timeout
    names does not depend on how fast a busy machine runs the stand-in.

    Returns:
        The readiness error's message.
    """
    monkeypatch.setenv("STANDIN_MODE", mode)
    activation = tmp_path / "activation"
    activation.mkdir()
    server_args = ["--port", str(_free_port()), *server]
    topo = server_topology(server_args)
    group = ServerGroup(
        [sys.executable, str(standin), *server_args],
        dict(os.environ, **{ENV_ACTIVATION_DIR: str(activation)}),
    )
    try:
        wait_until(
            f"the stand-in's {records} records",
            lambda: len(read_records(activation)[0]) == records,
        )
        if healthy:
            wait_until("the stand-in's /health", lambda: _healthy(topo.address))
        opts = argparse.Namespace(timeout=1.0, poll_interval=0.1, stop_grace=3.0)
        with pytest.raises(LaunchError) as excinfo:
            wait_ready(
                group,
                topo=topo,
                switches=parse_switches(os.environ),
                activation_dir=activation,
                opts=opts,
                received=[],
            )
        assert not _alive(_child_pid(tmp_path))  # the readiness wait stopped the group
    finally:
        group.stop(3.0)  # a failed check above leaves no stand-in behind
    return str(excinfo.value)


def test_rank_that_never_reports_times_out_naming_it(
    standin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --tp-size 3 and records from ranks 0 and 1 only, the timeout names rank (2, 0)."""
    err = _times_out(
        "missing-rank", standin, tmp_path, monkeypatch, "--tp-size", "3", records=2, healthy=True
    )
    assert "timed out after 1 s" in err
    assert err.endswith("a verified scheduler record from (TP rank, PP rank) (2, 0)")
    assert "/health" not in err


def test_health_that_never_answers_times_out(
    standin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records alone are not readiness: without /health the launcher times out and says so."""
    err = _times_out("never-healthy", standin, tmp_path, monkeypatch, records=1, healthy=False)
    assert "/health to answer 200" in err
    assert "(TP rank, PP rank)" not in err


def test_duplicate_rank_record_is_rejected(
    standin: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two scheduler records for one TP rank fail readiness and stop the server's process group."""
    argv = _argv(standin, tmp_path, "--tp-size", "2")
    err = _launch_fails("duplicate", argv, tmp_path, monkeypatch, capsys)
    assert "duplicates the record of pid" in err


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        (
            {"SGLANG_PLUGINS": "other_plugin"},
            "SGLANG_PLUGINS='other_plugin' excludes 'qsa_hisparse'",
        ),
        ({"SGLANG_QSA_MODEL_COMPAT": "", "SGLANG_QSA_HISPARSE_V3": ""}, "no QSA HiSparse switch"),
        ({"SGLANG_QSA_HISPARSE_V3": "fast"}, "SGLANG_QSA_HISPARSE_V3='fast'"),
    ],
)
def test_refuses_to_start_without_the_plugin_on(
    *,
    standin: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    fragment: str,
) -> None:
    """An allow-list without the plugin, no switch, or a bad switch: no server is started."""
    monkeypatch.setenv("STANDIN_MODE", "ok")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch.main(_argv(standin, tmp_path)) == 1
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "child.pid").exists()


@pytest.mark.parametrize("flag", [("--nnodes", "2"), ("--dp-size", "2")])
def test_refuses_topologies_it_cannot_verify(
    standin: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: tuple[str, str]
) -> None:
    """Several nodes or DP replicas are refused before starting, naming the flag."""
    assert launch.main(_argv(standin, tmp_path, *flag)) == 1
    assert f"{flag[0]}={flag[1]} is not supported" in capsys.readouterr().err


def test_ready_then_sigterm_is_forwarded_and_group_stops(standin: Path, tmp_path: Path) -> None:
    """All ranks plus health print the ready line; SIGTERM stops the server group; exit 0."""
    port = _free_port()
    argv = _argv(standin, tmp_path, "--tp-size", "2")
    argv[argv.index("--port") + 1] = str(port)
    env = dict(os.environ, STANDIN_MODE="ok")
    proc = subprocess.Popen(
        [sys.executable, "-m", "qsa_sglang_plugin.launch", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"ready at http://127.0.0.1:{port}" in line
        assert "(TP rank, PP rank) [(0, 0), (1, 0)]" in line
        assert (tmp_path / "activation" / "ready.json").is_file()
        child = _child_pid(tmp_path)
        assert _alive(child)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=hang_guard_s()) == 0
        wait_until("the launcher's server to stop", lambda: not _alive(child))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=hang_guard_s())


@pytest.mark.parametrize(
    ("server", "fragment"),
    [
        (["--model-path", "/no/such/model"], "--model-path '/no/such/model' does not exist"),
        (
            ["--kv-cache-dtype", "fp8_e5m2"],
            "--kv-cache-dtype='fp8_e5m2' is not supported; supported",
        ),
        (["--page-size", "16"], "--page-size=16 is not supported; supported: 64"),
        (["--device", "cuda"], "--device='cuda' but this machine shows no NVIDIA driver"),
    ],
)
def test_refuses_server_flags_the_plugin_would_refuse_before_starting_anything(
    *,
    standin: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    server: list[str],
    fragment: str,
) -> None:
    """Refused in well under a second of work, naming the flag and the allowed values; nothing
    starts. (This process's CPU time, which a busy machine does not stretch as it does the wall
    clock.)"""
    monkeypatch.setenv("STANDIN_MODE", "ok")
    monkeypatch.setattr(launch, "_NVIDIA_DRIVER_PATHS", (tmp_path / "no-driver",))
    started = time.process_time()
    assert launch.main(_argv(standin, tmp_path, *server)) == 1  # the last flag given wins
    assert time.process_time() - started < 1.0
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "child.pid").exists()


@pytest.mark.parametrize("flag", ["--timeout", "--poll-interval", "--stop-grace"])
def test_refuses_a_negative_or_endless_wait_by_name(
    standin: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    for bad in ("-1", "inf", "soon"):
        argv = _argv(standin, tmp_path)
        argv[argv.index(flag) + 1] = bad
        with pytest.raises(SystemExit) as excinfo:
            launch.main(argv)
        assert excinfo.value.code == 2
        assert f"argument {flag}: {bad!r} is not allowed" in capsys.readouterr().err
    assert not (tmp_path / "child.pid").exists()


def _own_temporary_directory(
    standin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[str], Path]:
    """Launcher arguments without ``--activation-dir`` (it makes its own temporary directory),
    and the empty directory it will make it in."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    argv = _argv(standin, tmp_path)
    at = argv.index("--activation-dir")
    del argv[at : at + 2]
    return argv, temp


def test_a_failed_launch_leaves_no_temporary_activation_directory(
    standin: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv, temp = _own_temporary_directory(standin, tmp_path, monkeypatch)
    _launch_fails("exit-early", argv, tmp_path, monkeypatch, capsys)
    assert list(temp.iterdir()) == []


def test_a_refused_sglang_plugins_list_makes_no_temporary_activation_directory(
    standin: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The refusal came after the directory was made, and left it behind."""
    argv, temp = _own_temporary_directory(standin, tmp_path, monkeypatch)
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert launch.main(argv) == 1
    assert "SGLANG_PLUGINS='someone_else' excludes 'qsa_hisparse'" in capsys.readouterr().err
    assert list(temp.iterdir()) == []
    assert not (tmp_path / "child.pid").exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_text("x"), "is a file; give an empty or new directory"),
        (lambda p: (p.write_text("x"), p.joinpath("sub"))[1], "cannot be used as a directory"),
        (lambda p: (p.mkdir(), p.joinpath("record").write_text("{}")), "is not empty"),
    ],
    ids=["a-file", "under-a-file", "not-empty"],
)
def test_an_activation_dir_that_cannot_be_an_empty_directory_is_refused_by_name(
    standin: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], object],
    message: str,
) -> None:
    """A file there raised FileExistsError with a traceback."""
    target = tmp_path / "activation"
    made = make(target)
    given = made if isinstance(made, Path) else target
    argv = _argv(standin, tmp_path)
    argv[argv.index("--activation-dir") + 1] = str(given)
    assert launch.main(argv) == 1
    assert f"failed: --activation-dir {str(given)!r} {message}" in capsys.readouterr().err
    assert not (tmp_path / "child.pid").exists()
