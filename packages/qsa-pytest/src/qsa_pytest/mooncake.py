"""A real Mooncake Store master for tests: ``mooncake_master`` on free localhost ports.

The binary ships in the ``mooncake`` package of ``mooncake-transfer-engine-non-cuda`` (it links
``libibverbs.so.1`` even for the TCP transport). Readiness is polled (the RPC port accepts a
connection), bounded only by the hang guard (:func:`qsa_pytest.processes.wait_until`).
"""

from __future__ import annotations

import importlib.util
import re
import socket
import subprocess
import urllib.request
from pathlib import Path

from qsa_pytest.processes import wait_until

__all__ = ("MooncakeMaster", "free_port")

_KEY_COUNT = re.compile(r"^master_key_count (\d+)", re.MULTILINE)


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        msg = "mooncake is not installed: install 'qsa-hostcache[mooncake]'"
        raise FileNotFoundError(msg)
    return Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"


class MooncakeMaster:
    """A ``mooncake_master`` process on free ports of 127.0.0.1, its output in ``log``.

    Args:
        log: where the master writes its output.
        segment_mb: put in :meth:`address` for the clients that lend memory to the store.
        port: the RPC port (default: a free one).
    """

    def __init__(self, log: Path, *, segment_mb: int = 64, port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self.metrics_port = free_port()
        self.log = log
        self._segment_mb = segment_mb
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    str(_binary()),
                    f"--rpc_port={self.port}",
                    "--rpc_address=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                    "--metrics_host=127.0.0.1",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(f"mooncake_master listening on 127.0.0.1:{self.port} (log: {log})", self._up)

    def address(self, segment_mb: int | None = None) -> str:
        """``mooncake://127.0.0.1:PORT?segment_mb=N`` (N: ``segment_mb`` or the default)."""
        n = self._segment_mb if segment_mb is None else segment_mb
        return f"mooncake://127.0.0.1:{self.port}?segment_mb={n}"

    def key_count(self) -> int:
        """Objects the store holds now (the master's ``master_key_count`` gauge)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as reply:
            text = reply.read().decode()
        found = _KEY_COUNT.search(text)
        if found is None:
            msg = f"no master_key_count in the master's metrics at {url}"
            raise AssertionError(msg)
        return int(found.group(1))

    def kill(self) -> None:
        """Stop the master at once (SIGKILL), as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _up(self) -> bool:
        if self.process.poll() is not None:
            msg = f"mooncake_master exited with {self.process.returncode}; see {self.log}"
            raise AssertionError(msg)
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True
