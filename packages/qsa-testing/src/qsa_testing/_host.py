"""The process an :class:`~qsa_testing.Engine` runs: SGLang's own server, nothing replaced.

``python -m qsa_testing._host LAUNCH_JSON`` does what ``python -m sglang.launch_server`` does
(load the ``sglang.srt.plugins`` entry points, then serve over HTTP), except that the server
arguments come as ``ServerArgs`` fields from a JSON file: a few fields the tests need, such as
``enable_multimodal=False``, have no command-line form.

With ``"fork_server": true`` in the launch file (the harness sets it for CPU engines), SGLang's
processes start from a fork server instead of as fresh interpreters: SGLang asks for the
``spawn`` start method, and here it gets ``forkserver``, whose server process imports SGLang's
scheduler and detokenizer modules once. Each child still runs SGLang's own target, which calls
``load_plugins()`` in that process as under ``spawn``; what it no longer does is import SGLang
again (20 to 30 s of CPU per process on the two-core machine). The server starts when SGLang
starts its first child, after SGLang has set the environment its children inherit, so they see
the same environment as under ``spawn``. CUDA engines keep ``spawn``: a process must not fork
once CUDA may have been touched.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Final

#: What the fork server imports before it forks SGLang's processes: every module the scheduler
#: and the detokenizer import on their way to their targets.
FORK_SERVER_PRELOAD: Final = (
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
)
#: Printed to the server log when the fork server is in use.
FORK_SERVER_MARKER: Final = "[qsa-testing] SGLang's processes start from a fork server"


def _start_children_from_a_fork_server() -> None:
    """Turn SGLang's ``multiprocessing.set_start_method("spawn")`` into ``forkserver``."""
    set_start_method = multiprocessing.set_start_method

    def start_from_a_fork_server(method: str | None, force: bool = False) -> None:
        if method == "spawn":
            multiprocessing.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
            method = "forkserver"
            sys.stdout.write(
                f"{FORK_SERVER_MARKER} (preloaded: {', '.join(FORK_SERVER_PRELOAD)})\n"
            )
        set_start_method(method, force=force)

    multiprocessing.set_start_method = start_from_a_fork_server


def main(argv: list[str]) -> None:
    """Serve the configuration in ``argv[0]`` until terminated."""
    launch = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    if launch.get("fork_server", False):
        _start_children_from_a_fork_server()
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
