"""The process an :class:`~qsa_testing.Engine` runs: SGLang's own server, nothing replaced.

``python -m qsa_testing._host LAUNCH_JSON`` does what ``python -m sglang.launch_server`` does
(load the ``sglang.srt.plugins`` entry points, then serve over HTTP), except that the server
arguments come as ``ServerArgs`` fields from a JSON file: a few fields the tests need, such as
``enable_multimodal=False``, have no command-line form.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    """Serve the configuration in ``argv[0]`` until terminated."""
    launch = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
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
