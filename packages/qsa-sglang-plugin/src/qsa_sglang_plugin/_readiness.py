"""Readiness of a launched server: its topology, health and verified activation records."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qsa_sglang_plugin._activation import ActivationRecord, read_records, write_atomic
from qsa_sglang_plugin._errors import LaunchError
from qsa_sglang_plugin._supervisor import ServerGroup
from qsa_sglang_plugin._switches import Switches
from qsa_sglang_plugin._versions import version_mismatches

__all__ = ("Topology", "server_topology", "wait_ready")


@dataclass(frozen=True, slots=True)
class Topology:
    """The server flags the readiness check needs: where it listens and the ranks to expect."""

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


def server_topology(server_args: Sequence[str]) -> Topology:
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
    topo = Topology(
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


def _assess(
    records: Sequence[ActivationRecord], topo: Topology, switches: Switches
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


def _write_ready(directory: Path, address: str, records: Sequence[ActivationRecord]) -> None:
    payload = {
        "address": address,
        "schedulers": [{"pid": r.pid, "tp_rank": r.tp_rank, "pp_rank": r.pp_rank} for r in records],
    }
    write_atomic(directory / "ready.json", json.dumps(payload, indent=2, sort_keys=True))


def wait_ready(
    server: ServerGroup,
    *,
    topo: Topology,
    switches: Switches,
    activation_dir: Path,
    opts: argparse.Namespace,
    received: list[int],
) -> None:
    """Block until the server is healthy and every rank's verified record is in.

    Then write ``ready.json`` and print the address. On a signal, an early exit, a rejected record
    or the timeout, stop the server's group first.

    Raises:
        LaunchError: why the server did not become ready.
    """
    deadline = time.monotonic() + float(opts.timeout)
    expected = sorted(topo.expected_ranks)
    while True:
        if received:
            server.stop(opts.stop_grace, first=received[0])
            raise LaunchError(f"interrupted by signal {received[0]} before the server was ready")
        code = server.exit_code()
        if code is not None:
            server.stop(opts.stop_grace)
            raise LaunchError(f"the server exited with status {code} before it was ready")
        records, unreadable = read_records(activation_dir)
        ready, problems = _assess(records, topo, switches)
        problems = unreadable + problems
        if problems:
            server.stop(opts.stop_grace)
            raise LaunchError("activation records rejected: " + "; ".join(problems))
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
            msg = f"timed out after {opts.timeout:g} s waiting for " + " and ".join(waiting)
            raise LaunchError(msg)
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
