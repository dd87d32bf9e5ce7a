"""The process an :class:`~qsa_testing.Engine` runs: SGLang's own server, nothing replaced.

``python -m qsa_testing._host LAUNCH_JSON`` does what ``python -m sglang.launch_server`` does
(load the ``sglang.srt.plugins`` entry points, then serve over HTTP), except that the server
arguments come as ``ServerArgs`` fields from a JSON file: a few fields the tests need, such as
``enable_multimodal=False``, have no command-line form.

``"children"`` in the launch file says how SGLang's scheduler and detokenizer processes start:

- ``"spawn"`` (the default, and CUDA's): as SGLang asks, each a fresh interpreter that imports
  SGLang again. A process must not fork once CUDA may have been touched.
- ``"fork"`` (CPU engines, whose server is a fork of an engine host that has imported every module
  those processes import, :mod:`qsa_testing._forkhost`): SGLang's ``spawn`` becomes ``fork``, so
  each child starts from the server as it is when SGLang starts it, its imports done. Each child
  still runs SGLang's own target, which calls ``load_plugins()`` in that process as under
  ``spawn``. SGLang starts them before the server has a second thread; a fork beside another
  thread could inherit a lock that thread held, so the server refuses to fork then.
"""

from __future__ import annotations

import enum
import json
import multiprocessing
import os
import sys
import threading
from multiprocessing import context
from pathlib import Path
from typing import Any


class Children(enum.StrEnum):
    """How SGLang's scheduler and detokenizer start (``"children"`` in the launch file)."""

    SPAWN = "spawn"
    FORK = "fork"


def _only_thread() -> None:
    threads = [thread.name for thread in threading.enumerate()]
    if len(threads) > 1:
        msg = (
            f"children={Children.FORK.value!r}: the server has threads {threads!r} as SGLang "
            "starts a process; allowed: the main thread alone"
        )
        raise RuntimeError(msg)


def _fork_children() -> None:
    """Turn SGLang's ``set_start_method("spawn")`` into ``fork``; fork only from one thread."""
    set_start_method = multiprocessing.set_start_method

    def fork_instead(method: str | None, force: bool = False) -> None:
        set_start_method("fork" if method == "spawn" else method, force=force)

    def popen_alone(process_obj: Any, _popen: Any = context.ForkProcess._Popen) -> Any:
        _only_thread()
        return _popen(process_obj)

    multiprocessing.set_start_method = fork_instead
    context.ForkProcess._Popen = staticmethod(popen_alone)  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    """Serve the configuration in ``argv[0]`` until terminated."""
    launch = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    if Children(launch.get("children", Children.SPAWN)) is Children.FORK:
        _fork_children()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.launch_server import run_server
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import kill_process_tree

    server_args = ServerArgs(**launch["server_args"])
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
