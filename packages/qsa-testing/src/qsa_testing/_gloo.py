"""Distributed code on one CPU machine: a scenario on ``N`` gloo ranks, their results collected.

The scenario is a module-level function ``(rank, world) -> dict`` (the spawned processes import
it by name); each rank joins a default gloo group on ``127.0.0.1`` with one CPU thread, runs it,
and writes its JSON result, which :func:`run_on_gloo_ranks` returns in rank order. What the NCCL
runs on several GPUs check, the CPU tests check here first.

Only a hang fails the ranks for time: past :func:`qsa_pytest.processes.hang_guard_s` every rank
still running gets ``SIGABRT``, and ``faulthandler`` writes where each of its threads was.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessRaisedException, spawn

from qsa_pytest.processes import hang_guard_s
from qsa_testing._engine import PORT_ATTEMPTS

__all__ = ("Scenario", "run_on_gloo_ranks", "zigzag_prefill_cp")

#: ``(rank, world) -> JSON-serialisable result`` of one rank.
Scenario = Callable[[int, int], dict[str, Any]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank(rank: int, scenario: Scenario, world: int, port: int, out_dir: str) -> None:
    faulthandler.enable()  # a rank the hang guard aborts reports where it was
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = scenario(rank, world)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_on_gloo_ranks(scenario: Scenario, world: int, out_dir: Path) -> list[dict[str, Any]]:
    """``scenario(rank, world)`` on ``world`` processes; their results, rank 0 first.

    The rendezvous port is chosen free, but another process (an engine's, picking its own ports)
    may bind it before rank 0 does: a launch whose rank 0 could not listen on it (``EADDRINUSE``
    while creating the store, before the scenario ran) is started again on another port, up to
    :data:`PORT_ATTEMPTS` times.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback included).
        torch.multiprocessing.ProcessExitedException: a rank died, or hung and was aborted by
            the hang guard (then its threads' tracebacks are in this process's stderr).
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _launch(scenario, world, out_dir)
        except ProcessRaisedException as exc:
            if attempt == PORT_ATTEMPTS or not _port_was_taken(str(exc)):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _port_was_taken(trace: str) -> bool:
    """Whether a rank's traceback says the store's port was in use when rank 0 bound it."""
    return "_create_c10d_store" in trace and "EADDRINUSE" in trace


def _launch(scenario: Scenario, world: int, out_dir: Path) -> list[dict[str, Any]]:
    args = (scenario, world, _free_port(), str(out_dir))
    context = spawn(_rank, args=args, nprocs=world, join=False)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + hang_guard_s()
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive() and process.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGABRT)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@contextlib.contextmanager
def zigzag_prefill_cp(rank: int, world: int) -> Iterator[Any]:
    """SGLang's zigzag prefill CP over every gloo rank, as a CP-TP-sharing engine sets it up.

    Its ``GroupCoordinator`` over gloo as the attention-CP group (the TP group: attention TP 1),
    and ``get_parallel()`` overridden to say so while the block runs. Call after
    ``qsa_testing.standins.install_cpu_engine_standins()`` (SGLang's CPU collectives); every
    rank must enter it alike (the group's creation is collective). Yields the group.
    """
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.runtime_context import get_parallel

    group = GroupCoordinator(
        group_ranks=[list(range(world))],
        local_rank=rank,
        torch_distributed_backend="gloo",
        use_pynccl=False,
        use_mscclpp=False,
        use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False,
        use_xpu_communicator=False,
        group_name="attn_cp",
    )
    with get_parallel().override(
        tp_size=world,
        tp_rank=rank,
        attn_tp_size=1,
        attn_tp_rank=0,
        attn_dp_size=1,
        attn_dp_rank=0,
        attn_cp_size=world,
        attn_cp_rank=rank,
        attn_cp_group=group,
        enable_prefill_cp=True,
        enable_cp_tp_group_sharing=True,
        cp_strategy="zigzag",
    ):
        yield group
