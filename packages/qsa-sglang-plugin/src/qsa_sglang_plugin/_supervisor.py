"""The launched server's process group: start, signal, stop, and supervise until it ends."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from qsa_sglang_plugin._errors import LaunchError

__all__ = ("FORWARDED_SIGNALS", "ServerGroup", "supervise")

logger = logging.getLogger(__name__)

#: Signals the launcher forwards to the server's group.
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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


class ServerGroup:
    """The server's process group.

    The leader stays unreaped until :meth:`reap`, so its pid (the group id) cannot be reused while
    the launcher may still signal the group.
    """

    def __init__(self, command: Sequence[str], env: dict[str, str]) -> None:
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


def supervise(server: ServerGroup, grace: float, poll: float, received: list[int]) -> int:
    """Wait for the server; forward a received signal to its group. Returns the exit status.

    Raises:
        LaunchError: the server exited on its own with a non-zero status.
    """
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
            if code != 0:
                msg = f"the server exited with status {code}"
                raise LaunchError(msg)
            return 0
        time.sleep(poll)
