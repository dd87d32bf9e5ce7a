"""Processes a test waits for: guarded against a hang, never against a slow machine.

A correct run on a loaded two-core machine may take many times what it takes on a quiet one, so
no test of this workspace fails for being slow. Every wait for another process (a gloo rank, an
engine becoming healthy, a reply, a gauge settling) is bounded only by :data:`HANG_GUARD_S`, a
generous guard whose one purpose is to turn a hang into a failure well before CI's own limit,
with a report of where the stuck process was.

A process stopped by the guard gets ``SIGABRT`` first: Python's ``faulthandler`` (enabled in
every process :func:`run_together` starts, through ``PYTHONFAULTHANDLER``) then writes each of
its threads' tracebacks to its output, which the failure message carries.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = (
    "ENV_HANG_GUARD_S",
    "HANG_GUARD_S",
    "Finished",
    "hang_guard_s",
    "run_together",
    "script_report",
    "wait_until",
)

#: Overrides :data:`HANG_GUARD_S` (seconds; a positive number).
ENV_HANG_GUARD_S: Final = "QSA_TEST_HANG_GUARD_S"
#: Seconds any one wait of a test may last before it is called a hang: 20 minutes, about ten
#: times the slowest such wait measured on a loaded two-core machine, and well inside CI's 90.
HANG_GUARD_S: Final = 1200.0
#: Seconds a process that got ``SIGABRT`` has to write its tracebacks before ``SIGKILL``.
_ABORT_GRACE_S: Final = 10.0


def hang_guard_s() -> float:
    """:data:`HANG_GUARD_S`, or ``QSA_TEST_HANG_GUARD_S`` when set.

    Raises:
        ValueError: the variable is not a positive finite number (the message names it).
    """
    raw = os.environ.get(ENV_HANG_GUARD_S)
    if raw is None:
        return HANG_GUARD_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 < value < float("inf"):
        msg = f"{ENV_HANG_GUARD_S}={raw!r} is not allowed; it must be a positive number of seconds"
        raise ValueError(msg)
    return value


@dataclass(frozen=True, slots=True)
class Finished:
    """One process of :func:`run_together`, after it ended.

    Attributes:
        argv: the command it ran.
        returncode: its exit status (negative: the signal that ended it).
        output: its stdout and stderr together.
        hung: the hang guard stopped it; ``output`` then ends with its threads' tracebacks.
    """

    argv: tuple[str, ...]
    returncode: int
    output: str
    hung: bool

    @property
    def ok(self) -> bool:
        """Exited with status 0 by itself."""
        return self.returncode == 0 and not self.hung


def _stop_hung(process: subprocess.Popen[str]) -> str:
    """``SIGABRT`` (tracebacks via faulthandler), then ``SIGKILL``; the process's output."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGABRT)
    try:
        output, _ = process.communicate(timeout=_ABORT_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    return output


def run_together(
    commands: Sequence[Sequence[str]],
    *,
    env: Mapping[str, str] | None = None,
    guard_s: float | None = None,
) -> list[Finished]:
    """Start every command at once and wait for all of them, each at most ``guard_s`` seconds.

    Args:
        commands: the argument vectors, started in order (e.g. one per rank).
        env: their environment (default this process's); ``PYTHONFAULTHANDLER=1`` is added.
        guard_s: the hang guard, default :func:`hang_guard_s`.

    Returns:
        One :class:`Finished` per command, in order.
    """
    guard = hang_guard_s() if guard_s is None else guard_s
    environment = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    processes = [
        subprocess.Popen(
            list(argv),
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        for argv in commands
    ]
    deadline = time.monotonic() + guard
    finished = []
    for argv, process in zip(commands, processes, strict=True):
        try:
            output, _ = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            hung = False
        except subprocess.TimeoutExpired:
            output, hung = _stop_hung(process), True
        finished.append(Finished(tuple(argv), process.returncode, output, hung))
    return finished


def wait_until(what: str, condition: Callable[[], object], *, poll_s: float = 0.05) -> None:
    """Poll ``condition()`` until it is true; fail only past the hang guard.

    Args:
        what: what is awaited, for the failure message.
        condition: called until it returns a true value.
        poll_s: seconds between polls.

    Raises:
        AssertionError: still false after :func:`hang_guard_s` seconds.
    """
    guard = hang_guard_s()
    deadline = time.monotonic() + guard
    while not condition():
        if time.monotonic() > deadline:
            msg = f"{what}: still not true after the {guard:.0f} s hang guard"
            raise AssertionError(msg)
        time.sleep(poll_s)


def script_report(script: Path, *args: str, env: Mapping[str, str] | None = None) -> Any:
    """Run ``python SCRIPT ARGS`` (this interpreter); the JSON of the last line it printed.

    Fails the calling test (``pytest.fail``) with the status and both streams' tails when the
    script exits non-zero or prints nothing; a script still running after
    :func:`hang_guard_s` seconds raises ``subprocess.TimeoutExpired``.
    """
    import pytest

    done = subprocess.run(
        [sys.executable, str(script), *args],
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(),
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        pytest.fail(
            f"{script.name} failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-4000:]}"
        )
    return json.loads(lines[-1])
