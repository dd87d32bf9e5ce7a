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
import importlib.metadata
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Final

from qsa_sglang_plugin._config_check import SUPPORTED_KV_CACHE_DTYPES, SUPPORTED_PAGE_SIZE
from qsa_sglang_plugin._errors import LaunchError, SwitchError
from qsa_sglang_plugin._readiness import Topology, server_topology, wait_ready
from qsa_sglang_plugin._supervisor import FORWARDED_SIGNALS, ServerGroup, supervise
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


def _empty_directory(path: Path) -> Path:
    """``path`` as an empty directory, made (with its parents) if missing.

    Raises:
        LaunchError: the path is a file, lies under one, cannot be made or read, or is not empty.
    """
    named = f"--activation-dir {str(path)!r}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        empty = not any(path.iterdir())
    except FileExistsError:
        msg = f"{named} is a file; give an empty or new directory"
        raise LaunchError(msg) from None
    except OSError as exc:
        msg = f"{named} cannot be used as a directory: {exc.strerror or exc}"
        raise LaunchError(msg) from None
    if not empty:
        msg = f"{named} is not empty"
        raise LaunchError(msg)
    return path


def _server_env(base: dict[str, str]) -> dict[str, str]:
    """The server's environment: ``SGLANG_PLUGINS`` lets the plugin load (set when unset).

    Raises:
        LaunchError: ``SGLANG_PLUGINS`` is a list without the plugin.
    """
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
        topo = server_topology(server_args)
        _check_serving_flags(server_args)
        _check_installation()
        env = _server_env(dict(os.environ))  # refuses before any directory is made
        if opts.activation_dir is None:
            activation_dir = Path(tempfile.mkdtemp(prefix="qsa-hisparse-activation-"))
            created = activation_dir
        else:
            activation_dir = _empty_directory(opts.activation_dir)
        env[ENV_ACTIVATION_DIR] = str(activation_dir)
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
    topo: Topology,
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

    previous = {s: signal.signal(s, _on_signal) for s in FORWARDED_SIGNALS}
    try:
        server = ServerGroup([*command, *server_args], env)
        sys.stderr.write(
            f"qsa-hisparse launch: started server pid {server.pid}; activation records in "
            f"{activation_dir}\n"
        )
        wait_ready(
            server,
            topo=topo,
            switches=switches,
            activation_dir=activation_dir,
            opts=opts,
            received=received,
        )
        return supervise(server, opts.stop_grace, opts.poll_interval, received)
    except LaunchError as exc:
        return _fail(str(exc))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    raise SystemExit(main())
