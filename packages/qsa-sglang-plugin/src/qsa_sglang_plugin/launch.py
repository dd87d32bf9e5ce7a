"""Launcher: start an SGLang server with the plugin forced on, report ready only when verified.

Usage::

    python -m qsa_sglang_plugin.launch [options] -- <sglang server args>
    qsa-hisparse launch [options] -- <sglang server args>

Steps: parse the switches (at least one must be on); refuse, in milliseconds and naming the flag,
server flags the plugin would refuse after SGLang's minute-long start (a missing
``--model-path``, a KV dtype or page size the kernels do not store, a CUDA device on a machine
without an NVIDIA driver); make sure ``SGLANG_PLUGINS`` lets the
plugin load in every process (set it to ``qsa_hisparse`` when unset; refuse a list without it);
check that the entry point is installed and that the native libraries have the supported versions;
start the server in its own process group with ``SGLANG_QSA_HISPARSE_ACTIVATION_DIR`` pointing at
an empty directory; wait until the health endpoint answers 200 and the directory holds exactly one
verified scheduler record per TP rank (and PP rank); then print the address and supervise the
server, forwarding SIGTERM, SIGINT and SIGHUP to its process group. On any failure the launcher
stops the whole process group (SIGTERM, then SIGKILL after a grace period), removes the temporary
activation directory it made, and exits non-zero with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Final

from qsa_sglang_plugin._activation import ActivationRecord, read_records, write_atomic
from qsa_sglang_plugin._config_check import SUPPORTED_KV_CACHE_DTYPES, SUPPORTED_PAGE_SIZE
from qsa_sglang_plugin._errors import LaunchError, SwitchError
from qsa_sglang_plugin._switches import (
    ENV_ACTIVATION_DIR,
    ENV_SGLANG_PLUGINS,
    PLUGIN_NAME,
    Switches,
    parse_switches,
)
from qsa_sglang_plugin._versions import version_mismatches

__all__ = ("ENV_SERVER_COMMAND", "main")

logger = logging.getLogger(__name__)

#: Overrides the server command (a shell-quoted string); the default runs SGLang's server.
ENV_SERVER_COMMAND: Final = "QSA_HISPARSE_SERVER_COMMAND"
_ENTRY_POINT_VALUE: Final = "qsa_sglang_plugin:activate"
_FORWARDED: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True, slots=True)
class _Topology:
    host: str
    port: int
    tp_size: int
    pp_size: int
    dp_size: int
    nnodes: int

    @property
    def expected_ranks(self) -> frozenset[tuple[int, int]]:
        return frozenset((tp, pp) for tp in range(self.tp_size) for pp in range(self.pp_size))

    @property
    def address(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


def _server_topology(server_args: Sequence[str]) -> _Topology:
    """The few server flags the launcher needs, read the way SGLang's parser reads them."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tensor-parallel-size", "--tp", type=int, default=1)
    parser.add_argument("--pp-size", "--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--dp-size", "--data-parallel-size", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    try:
        known, _ = parser.parse_known_args(list(server_args))
    except SystemExit as exc:  # argparse exits on a malformed value
        msg = f"cannot read the server arguments {list(server_args)!r}"
        raise LaunchError(msg) from exc
    topo = _Topology(
        host=known.host,
        port=known.port,
        tp_size=known.tp_size,
        pp_size=known.pp_size,
        dp_size=known.dp_size,
        nnodes=known.nnodes,
    )
    for flag, value in (("--tp-size", topo.tp_size), ("--pp-size", topo.pp_size)):
        if value < 1:
            msg = f"{flag}={value!r} is not allowed; allowed: a positive integer"
            raise LaunchError(msg)
    if topo.nnodes != 1:
        msg = (
            f"--nnodes={topo.nnodes!r} is not supported by the launcher; supported: 1 "
            "(activation records are read from a local directory)"
        )
        raise LaunchError(msg)
    if topo.dp_size != 1:
        msg = (
            f"--dp-size={topo.dp_size!r} is not supported by the launcher; supported: 1 "
            "(one scheduler per TP rank)"
        )
        raise LaunchError(msg)
    return topo


#: Where an NVIDIA driver shows itself; without one, a CUDA server cannot start.
_NVIDIA_DRIVER_PATHS: Final = (Path("/dev/nvidiactl"), Path("/proc/driver/nvidia/version"))


def _check_serving_flags(server_args: Sequence[str]) -> None:
    """Refuse, before the slow start, server flags the plugin will refuse anyway."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model-path", "--model", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--page-size", type=int, default=None)
    parser.add_argument("--device", default=None)
    try:
        known, _ = parser.parse_known_args(list(server_args))
    except SystemExit as exc:  # argparse exits on a malformed value
        msg = f"cannot read the server arguments {list(server_args)!r}"
        raise LaunchError(msg) from exc
    if known.model_path is None:
        msg = "no --model-path in the server arguments"
        raise LaunchError(msg)
    model = Path(known.model_path).expanduser()
    local = known.model_path.startswith(("/", "./", "../", "~"))
    if (local or model.exists()) and not (model / "config.json").is_file():
        what = "does not exist" if not model.exists() else "has no config.json"
        msg = f"--model-path {known.model_path!r} {what}"
        raise LaunchError(msg)
    if known.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        msg = (
            f"--kv-cache-dtype={known.kv_cache_dtype!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )
        raise LaunchError(msg)
    if known.page_size != SUPPORTED_PAGE_SIZE:
        msg = (
            f"--page-size={known.page_size!r} is not supported; supported: {SUPPORTED_PAGE_SIZE} "
            "(give it explicitly: SGLang's default differs)"
        )
        raise LaunchError(msg)
    device = known.device or "cuda"
    if device.startswith("cuda") and not any(p.exists() for p in _NVIDIA_DRIVER_PATHS):
        msg = (
            f"--device={device!r} but this machine shows no NVIDIA driver "
            f"({', '.join(map(str, _NVIDIA_DRIVER_PATHS))} missing); pass --device cpu to serve "
            "on the CPU"
        )
        raise LaunchError(msg)


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        msg = f"{text!r} is not allowed; allowed: a positive number of seconds"
        raise argparse.ArgumentTypeError(msg)
    return value


def _server_env(base: dict[str, str], activation_dir: Path) -> dict[str, str]:
    env = dict(base)
    allowed = [x.strip() for x in env.get(ENV_SGLANG_PLUGINS, "").split(",") if x.strip()]
    if not allowed:
        env[ENV_SGLANG_PLUGINS] = PLUGIN_NAME
    elif PLUGIN_NAME not in allowed:
        msg = (
            f"{ENV_SGLANG_PLUGINS}={env[ENV_SGLANG_PLUGINS]!r} excludes {PLUGIN_NAME!r}; allowed: "
            f"unset, or a list that contains {PLUGIN_NAME!r}"
        )
        raise LaunchError(msg)
    env[ENV_ACTIVATION_DIR] = str(activation_dir)
    return env


def _check_installation() -> None:
    eps = [
        ep
        for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
        if ep.name == PLUGIN_NAME
    ]
    values = sorted(ep.value for ep in eps)
    if values != [_ENTRY_POINT_VALUE]:
        msg = (
            f"entry point {PLUGIN_NAME!r} of group 'sglang.srt.plugins' resolves to {values!r}; "
            f"expected exactly [{_ENTRY_POINT_VALUE!r}] (is qsa-sglang-plugin installed in this "
            "environment?)"
        )
        raise LaunchError(msg)
    mismatches = version_mismatches()
    if mismatches:
        msg = "native library versions differ from the supported set: " + "; ".join(
            str(m) for m in mismatches
        )
        raise LaunchError(msg)


def _assess(
    records: Sequence[ActivationRecord], topo: _Topology, switches: Switches
) -> tuple[set[tuple[int, int]], list[str]]:
    """Ranks with a valid scheduler record, and every problem found in the records."""
    seen: dict[tuple[int, int], int] = {}
    problems: list[str] = []
    want_features = tuple(f.value for f in switches.features)
    want_mode = None if switches.hisparse is None else switches.hisparse.value
    for rec in records:
        if rec.role != "scheduler":
            continue
        rank = (rec.tp_rank, rec.pp_rank)
        where = f"record of pid {rec.pid} (TP rank {rec.tp_rank}, PP rank {rec.pp_rank})"
        if rank not in topo.expected_ranks:
            problems.append(
                f"{where} is outside --tp-size {topo.tp_size} / --pp-size {topo.pp_size}"
            )
        if rank in seen:
            problems.append(f"{where} duplicates the record of pid {seen[rank]}")
        seen.setdefault(rank, rec.pid)
        if not rec.verified:
            problems.append(f"{where} is not verified")
        if rec.features != want_features or rec.hisparse_mode != want_mode:
            problems.append(
                f"{where} has features {list(rec.features)!r} mode {rec.hisparse_mode!r}; "
                f"requested {list(want_features)!r} mode {want_mode!r}"
            )
        if rec.prefix_cache_mb != switches.prefix_cache_mb:
            problems.append(
                f"{where} has prefix cache {rec.prefix_cache_mb} MiB; "
                f"requested {switches.prefix_cache_mb} MiB"
            )
        mismatches = version_mismatches(rec.versions)
        if mismatches:
            problems.append(
                f"{where} runs unsupported versions: " + "; ".join(map(str, mismatches))
            )
    return set(seen) & topo.expected_ranks, problems


def _healthy(address: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{address}/health", timeout=2.0) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _live_group_members(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group ``pgid`` (Linux ``/proc``)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


class _Server:
    """The server's process group.

    The leader stays unreaped until :meth:`reap`, so its pid (the group id) cannot be reused while
    the launcher may still signal the group.
    """

    def __init__(self, command: Sequence[str], env: dict[str, str]) -> None:
        import subprocess

        self._proc = subprocess.Popen(list(command), env=env, start_new_session=True)
        self.pid = self._proc.pid
        self._reaped: int | None = None

    def exit_code(self) -> int | None:
        """The leader's exit status (negative = killed by that signal) without reaping it."""
        if self._reaped is not None:
            return self._reaped
        info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return None
        if info.si_code == os.CLD_EXITED:
            return info.si_status
        return -info.si_status

    def signal_group(self, signum: int) -> None:
        if self._reaped is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signum)

    def stop(self, grace: float, first: int = signal.SIGTERM) -> int:
        """Signal the group, wait up to ``grace`` s for every member, then SIGKILL; reap."""
        if _live_group_members(self.pid):
            self.signal_group(first)
        if not self._wait_empty(grace):
            logger.warning("server group %d did not stop in %.1f s; killing it", self.pid, grace)
            self.signal_group(signal.SIGKILL)
            self._wait_empty(10.0)
        return self.reap()

    def _wait_empty(self, seconds: float) -> bool:
        """Poll until no live member of the group is left or ``seconds`` pass; True if empty."""
        deadline = time.monotonic() + seconds
        while _live_group_members(self.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def reap(self) -> int:
        if self._reaped is None:
            self._reaped = self._proc.wait()
        return self._reaped


def _write_ready(directory: Path, address: str, records: Sequence[ActivationRecord]) -> None:
    payload = {
        "address": address,
        "schedulers": [{"pid": r.pid, "tp_rank": r.tp_rank, "pp_rank": r.pp_rank} for r in records],
    }
    write_atomic(directory / "ready.json", json.dumps(payload, indent=2, sort_keys=True))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsa-hisparse launch",
        description=(
            "Start an SGLang server with QSA HiSparse forced on and report ready once every TP "
            "rank has written a verified activation record. Server arguments follow '--'."
        ),
    )
    parser.add_argument(
        "--activation-dir",
        type=Path,
        default=None,
        help="empty directory for activation records (default: a new temporary directory)",
    )
    parser.add_argument(
        "--timeout", type=_seconds, default=1800.0, help="seconds to wait for readiness"
    )
    parser.add_argument(
        "--poll-interval", type=_seconds, default=0.5, help="seconds between checks"
    )
    parser.add_argument(
        "--stop-grace",
        type=_seconds,
        default=30.0,
        help="seconds between SIGTERM and SIGKILL when stopping the server",
    )
    parser.add_argument(
        "--server-command",
        default=None,
        help=(
            "server command (shell-quoted) that the server arguments are appended to; default: "
            f"${ENV_SERVER_COMMAND}, else '<this python> -m sglang.launch_server'"
        ),
    )
    return parser


def _fail(message: str) -> int:
    sys.stderr.write(f"qsa-hisparse launch: failed: {message}\n")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the process exit status (0 = served and stopped cleanly)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if "--" in args_list:
        split = args_list.index("--")
        own, server_args = args_list[:split], args_list[split + 1 :]
    else:
        own, server_args = args_list, []
    opts = _parser().parse_args(own)
    created: Path | None = None  # the temporary activation directory, if this launch made it
    if not server_args:
        return _fail("no server arguments; pass them after '--'")
    try:
        switches = parse_switches(os.environ)
    except SwitchError as exc:
        return _fail(str(exc))
    if not switches.any_on:
        return _fail(
            "no QSA HiSparse switch is set, so the plugin would stay off; set "
            "SGLANG_QSA_MODEL_COMPAT=1 (and SGLANG_QSA_HISPARSE_V3=p2-offload or p2-resident)"
        )
    try:
        topo = _server_topology(server_args)
        _check_serving_flags(server_args)
        _check_installation()
        if opts.activation_dir is None:
            activation_dir = Path(tempfile.mkdtemp(prefix="qsa-hisparse-activation-"))
            created = activation_dir
        else:
            activation_dir = opts.activation_dir
            activation_dir.mkdir(parents=True, exist_ok=True)
            if any(activation_dir.iterdir()):
                msg = f"--activation-dir {str(activation_dir)!r} is not empty"
                raise LaunchError(msg)
        env = _server_env(dict(os.environ), activation_dir)
    except LaunchError as exc:
        return _fail(str(exc))
    status = _serve(opts, server_args, env, topo, switches, activation_dir)
    if status != 0 and created is not None:  # a failed launch leaves no temporary directory
        shutil.rmtree(created, ignore_errors=True)
    return status


def _serve(  # noqa: PLR0917 (main's state, passed on once)
    opts: argparse.Namespace,
    server_args: Sequence[str],
    env: dict[str, str],
    topo: _Topology,
    switches: Switches,
    activation_dir: Path,
) -> int:
    """Start the server, wait until it is verified ready, then supervise it."""
    raw_command = opts.server_command or os.environ.get(ENV_SERVER_COMMAND, "")
    command = (
        shlex.split(raw_command) if raw_command else [sys.executable, "-m", "sglang.launch_server"]
    )

    received: list[int] = []

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        del frame
        received.append(signum)

    previous = {s: signal.signal(s, _on_signal) for s in _FORWARDED}
    try:
        server = _Server([*command, *server_args], env)
        sys.stderr.write(
            f"qsa-hisparse launch: started server pid {server.pid}; activation records in "
            f"{activation_dir}\n"
        )
        status = _wait_ready(
            server,
            topo=topo,
            switches=switches,
            activation_dir=activation_dir,
            opts=opts,
            received=received,
        )
        if status is not None:
            return status
        return _supervise(server, opts.stop_grace, opts.poll_interval, received)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait_ready(
    server: _Server,
    *,
    topo: _Topology,
    switches: Switches,
    activation_dir: Path,
    opts: argparse.Namespace,
    received: list[int],
) -> int | None:
    """Block until ready (returns None) or fail, stopping the server (returns the status)."""
    deadline = time.monotonic() + float(opts.timeout)
    expected = sorted(topo.expected_ranks)
    while True:
        if received:
            server.stop(opts.stop_grace, first=received[0])
            return _fail(f"interrupted by signal {received[0]} before the server was ready")
        code = server.exit_code()
        if code is not None:
            server.stop(opts.stop_grace)
            return _fail(f"the server exited with status {code} before it was ready")
        records, unreadable = read_records(activation_dir)
        ready, problems = _assess(records, topo, switches)
        problems = unreadable + problems
        if problems:
            server.stop(opts.stop_grace)
            return _fail("activation records rejected: " + "; ".join(problems))
        healthy = _healthy(topo.address)
        if healthy and ready == topo.expected_ranks:
            break
        if time.monotonic() >= deadline:
            missing = sorted(topo.expected_ranks - ready)
            waiting = []
            if not healthy:
                waiting.append(f"{topo.address}/health to answer 200")
            if missing:
                waiting.append(
                    "a verified scheduler record from (TP rank, PP rank) "
                    + ", ".join(str(m) for m in missing)
                )
            server.stop(opts.stop_grace)
            return _fail(f"timed out after {opts.timeout:g} s waiting for " + " and ".join(waiting))
        time.sleep(float(opts.poll_interval))
    schedulers = sorted(
        (r for r in records if r.role == "scheduler"), key=lambda r: (r.pp_rank, r.tp_rank)
    )
    _write_ready(activation_dir, topo.address, schedulers)
    sys.stdout.write(
        f"qsa-hisparse launch: ready at {topo.address}; {len(schedulers)} scheduler activation "
        f"record(s) verified for (TP rank, PP rank) {expected}\n"
    )
    sys.stdout.flush()
    return None


def _supervise(server: _Server, grace: float, poll: float, received: list[int]) -> int:
    """Wait for the server; forward a received signal to its group. Returns the exit status."""
    while True:
        if received:
            signum = received[0]
            sys.stderr.write(f"qsa-hisparse launch: forwarding signal {signum} to the server\n")
            stopped = server.stop(grace, first=signum)
            if stopped in (0, -signum):
                return 0
            return stopped if stopped > 0 else 128 - stopped
        code = server.exit_code()
        if code is not None:
            server.stop(grace)
            return _fail(f"the server exited with status {code}") if code != 0 else 0
        time.sleep(poll)


if __name__ == "__main__":
    raise SystemExit(main())
