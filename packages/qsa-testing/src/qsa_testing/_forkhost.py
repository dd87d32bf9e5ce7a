"""A process that imports SGLang once and forks every CPU engine's server from itself.

Importing SGLang costs 25 to 35 s of CPU on the two-core machine, and a fresh server pays it
twice: in its own process and in the processes that run its scheduler and detokenizer. Once
imported, the server is up some 5 s later. A :class:`ForkHost` is a Python process that has
imported every module those processes import, once, and then forks on request: each child takes
the environment, log and working directory it is given, starts a new session (so its process
group holds the whole engine), and runs ``python -m MODULE ARGS`` as a fresh interpreter would,
without the imports. The engine harness runs :mod:`qsa_testing._host` there, which serves SGLang
as ``sglang.launch_server`` does and starts SGLang's own processes by forking itself.

What a fork does not redo is what the imports did: anything a module reads from the environment
at import time is the host's. A host is therefore started with the environment that every engine
it serves shares (the platform's settings, the stand-ins, the model modules SGLang may import),
and one host serves only engines whose import-time environment is that one
(:func:`fork_host` keeps one host per :class:`HostKey`). What differs from engine to engine (the
plugin's entry point and switches, its activation directory, the cores of each rank, the metrics
directory) SGLang and the plugin read when the server starts, after the fork.

The protocol is JSON, one object per line: the harness writes ``{"module", "args", "env", "cwd",
"log"}`` to the host's stdin and reads ``{"pid": N}`` (or ``{"error": TEXT}``) from its stdout;
the host reaps its children and writes ``{"exited": N, "status": CODE}`` for each. When its
stdin closes, the host kills every process group it started and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, NoReturn

from qsa_pytest.processes import hang_guard_s
from qsa_testing._errors import EngineStartError

__all__ = ("ForkHost", "HostKey", "HostedProcess", "close_fork_hosts", "fork_host")

#: The host's log, in its directory (which is also its working directory).
HOST_LOG: Final = "host.log"
#: Printed first in each child's log; the line names the host and its log.
FORKED_MARKER: Final = "[qsa-testing] forked from engine host"


@dataclass(frozen=True, slots=True)
class HostKey:
    """What a host imported with: the modules, and the environment its imports could read.

    Attributes:
        preload: dotted names of the modules the host imports before it serves.
        env: the host's whole environment (every engine of the host shares it at import time).
    """

    preload: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, preload: Sequence[str], env: Mapping[str, str]) -> HostKey:
        return cls(tuple(preload), tuple(sorted(env.items())))


class HostedProcess:
    """A process forked by a :class:`ForkHost`: the part of ``subprocess.Popen`` the harness uses.

    It is the host's child, not this process's: its status comes from the host's reports.
    """

    def __init__(self, host: ForkHost, pid: int) -> None:
        self._host = host
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status once the process has exited and the host has reaped it, else None."""
        if self.returncode is None:
            self.returncode = self._host.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        code = self._host.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        self.returncode = code
        return code


class ForkHost:
    """One host process (see the module's docstring); start it with :meth:`start`."""

    def __init__(self, key: HostKey, directory: Path) -> None:
        self.key = key
        self.directory = directory
        self.log_path = directory / HOST_LOG
        self._process: subprocess.Popen[str] | None = None
        self._replies: list[dict[str, Any]] = []
        self._exited: dict[int, int] = {}
        self._changed = threading.Condition()
        self._request_lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Start the host and wait until its imports are done.

        Raises:
            EngineStartError: the host exited before it was ready (the message holds its log).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "qsa_testing._forkhost", *self.key.preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=dict(self.key.env),
                cwd=self.directory,
                text=True,
                start_new_session=True,
            )
        self._reader = threading.Thread(target=self._read, name="qsa-fork-host", daemon=True)
        self._reader.start()
        ready = self._next_reply(hang_guard_s())
        if "ready" not in ready:
            self._fail(f"the engine host did not start: {ready}")

    def spawn(
        self, module: str, args: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path
    ) -> HostedProcess:
        """Fork a child that runs ``python -m module *args`` with ``env``, in ``cwd``, into ``log``.

        Raises:
            EngineStartError: the host is gone or could not fork.
        """
        request = {"module": module, "args": list(args), "env": dict(env), "cwd": str(cwd)}
        request["log"] = str(log)
        with self._request_lock:
            process = self._process
            if process is None or process.stdin is None or process.poll() is not None:
                self._fail("the engine host is not running")
            try:
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                self._fail(f"the engine host did not take the request ({exc})")
            reply = self._next_reply(hang_guard_s())
        if "pid" not in reply:
            self._fail(f"the engine host could not fork: {reply}")
        return HostedProcess(self, int(reply["pid"]))

    def status(self, pid: int) -> int | None:
        """The exit status of child ``pid`` once reaped, else None."""
        with self._changed:
            return self._exited.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The exit status of child ``pid``, waiting up to ``timeout`` seconds (None: forever)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exited or not self._reading(), timeout)
            return self._exited.get(pid)

    def close(self) -> None:
        """Stop the host; it kills the process group of every child still running."""
        process = self._process
        if process is None:
            return
        with contextlib.suppress(OSError):
            if process.stdin is not None:
                process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if self._reader is not None:
            self._reader.join(timeout=30)
        if process.stdout is not None:
            process.stdout.close()
        self._process = None

    # ---- the harness's side ---------------------------------------------------------------------

    def _reading(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def _read(self) -> None:
        process = self._process
        assert process is not None
        assert process.stdout is not None
        for line in process.stdout:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._exited[int(message["exited"])] = int(message["status"])
                else:
                    self._replies.append(message)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _next_reply(self, timeout: float) -> dict[str, Any]:
        with self._changed:
            if not self._changed.wait_for(
                lambda: bool(self._replies) or not self._reading(), timeout
            ):
                self._fail(f"the engine host did not answer in {timeout:.0f} s")
            if not self._replies:
                self._fail("the engine host exited")
            return self._replies.pop(0)

    def _fail(self, what: str) -> NoReturn:
        tail = self.log_path.read_text(encoding="utf-8", errors="replace")[-4000:]
        msg = f"{what}; host log {self.log_path}, tail:\n{tail}"
        raise EngineStartError(msg)


_HOSTS: dict[HostKey, ForkHost] = {}
_HOSTS_LOCK = threading.Lock()


def fork_host(key: HostKey) -> ForkHost:
    """This process's host for ``key``, started (imports and all) on first use."""
    with _HOSTS_LOCK:
        host = _HOSTS.get(key)
        if host is None:
            directory = Path(tempfile.mkdtemp(prefix="qsa-engine-host-"))
            host = ForkHost(key, directory)
            host.start()
            if not _HOSTS:
                atexit.register(close_fork_hosts)
            _HOSTS[key] = host
        return host


def close_fork_hosts() -> None:
    """Stop every host this process started (their engines' process groups go with them)."""
    with _HOSTS_LOCK:
        hosts = list(_HOSTS.values())
        _HOSTS.clear()
    for host in hosts:
        host.close()


# ---- the host's side ----------------------------------------------------------------------------


def _write(out: IO[str], message: Mapping[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _child(
    request: Mapping[str, Any], channel: Sequence[int], host_log: Path, session_w: int
) -> None:
    """In the forked child: become the engine's process, run its module and exit.

    ``session_w`` is closed once the child leads its own session, so that the host replies with
    the pid only when the pid names the child's process group.
    """
    code = 1
    try:
        for fd in channel:
            os.close(fd)
        os.setsid()
        os.close(session_w)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.stdout.write(f"{FORKED_MARKER} {os.getppid()} (its log: {host_log})\n")
        _replay_host_standins()
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _replay_host_standins() -> None:
    """Log the stand-ins the host applied at import, and install any the host did not.

    The host's stand-ins edited modules before the fork; this child's log names them as a
    fresh server's would.
    """
    from qsa_testing import standins

    for line in standins.announced():
        sys.stderr.write(f"{line} (in the engine host, at import)\n")
    sys.stderr.flush()
    standins.install_from_environment()


def serve(preload: Sequence[str]) -> None:
    """The host's main loop: import ``preload``, then fork a child per request on stdin."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to the host's log
    started = time.monotonic()
    for module in preload:
        importlib.import_module(module)
    # What the imports made stays out of the collector's sight, so that a collection in a child
    # does not write to (and so copy) every page of it.
    gc.freeze()
    host_log = Path(HOST_LOG).resolve()
    _write(out, {"ready": round(time.monotonic() - started, 3)})
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    pending = b""
    try:
        while True:
            readable, _, _ = select.select([0, wake_r], [], [])
            if wake_r in readable:
                os.read(wake_r, 4096)
            for pid in sorted(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    _write(out, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})
            if 0 not in readable:
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                session_r, session_w = os.pipe()
                try:
                    pid = os.fork()
                except OSError as exc:
                    os.close(session_r)
                    os.close(session_w)
                    _write(out, {"error": f"fork failed: {exc}"})
                    continue
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    os.close(session_r)
                    _child(request, (out.fileno(), wake_r, wake_w), host_log, session_w)
                os.close(session_w)
                os.read(session_r, 1)  # the child leads its own session (or has died) now
                os.close(session_r)
                children.add(pid)
                _write(out, {"pid": pid})
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


if __name__ == "__main__":
    serve(sys.argv[1:])
