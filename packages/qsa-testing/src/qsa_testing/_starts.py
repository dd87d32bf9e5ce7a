"""Every engine start of a test run, in one file all of the run's processes append to.

:func:`~qsa_testing.start_engine` appends one JSON line per start to the file named by
``QSA_TESTING_ENGINE_STARTS`` (when set): what started, how long it took, and whether it became
healthy or stopped first (a start-up refusal is a start too: its cost is the same imports).
``nox -s tests`` and the pytest plugin's summary read them back.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

__all__ = ("ENV_ENGINE_STARTS", "StartRecord", "read_starts", "record_start")

#: Path of the JSON-lines file every engine start of the run is appended to.
ENV_ENGINE_STARTS: Final = "QSA_TESTING_ENGINE_STARTS"


@dataclass(frozen=True, slots=True)
class StartRecord:
    """One engine start.

    Attributes:
        label: the configuration's label.
        seconds: wall time from spawning the server to its first healthy answer, or to its exit.
        outcome: ``healthy``, or ``stopped`` (it exited first: a refused configuration).
        log_path: the server's log.
    """

    label: str
    seconds: float
    outcome: str
    log_path: str


def record_start(record: StartRecord) -> None:
    """Append ``record`` to the run's file, if ``QSA_TESTING_ENGINE_STARTS`` names one.

    One ``write`` of one line below the pipe-buffer size on a file opened for appending, so lines
    of processes writing at once never interleave.
    """
    path = os.environ.get(ENV_ENGINE_STARTS)
    if not path:
        return
    line = json.dumps({**asdict(record), "seconds": round(record.seconds, 1)}) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_starts(path: str | os.PathLike[str]) -> list[StartRecord]:
    """The records of ``path`` in the order written; none if the file does not exist."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [StartRecord(**json.loads(line)) for line in text.splitlines() if line.strip()]
