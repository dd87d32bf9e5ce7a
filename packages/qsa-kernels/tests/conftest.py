"""Device choice, GPU gating and poisoned allocations shared by this package's tests.

Tests marked ``@pytest.mark.gpu`` are gated by :mod:`qsa_pytest.gpu`: skipped where CUDA is
absent, failed instead under ``QSA_REQUIRE_GPU=1`` (set by ``nox -s gpu-tests``).

Without CUDA the Triton kernels still run, on CPU tensors, through Triton's interpreter. Triton
reads ``TRITON_INTERPRET`` when it is first imported, so it is set here, before any test module
imports the kernels.

Kernel tests take a ``kernel_device`` argument and get exactly one value: ``"cpu"`` (id
``interpreter``) where Triton runs interpreted, otherwise ``"cuda"`` marked ``gpu``. Tests that
only make sense under the interpreter take ``interpreter_device`` instead, which skips where
Triton compiles for CUDA. Output buffers come from the ``poisoned_int`` / ``poisoned_float``
factories (on the kernel device, filled with ``int_poison`` / NaN) and ``poisoned_empty`` makes
``torch.empty`` return the same poison, so an element a kernel never writes fails the test.

Multi-process tests (gloo over ``127.0.0.1``) start their ranks with ``spawn_workers``.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

from qsa_pytest.processes import run_together

pytest_plugins = ("qsa_pytest.gpu",)

# Wall-clock deadlines are meaningless on a shared 2-core CI machine; examples must still pass.
settings.register_profile("qsa", deadline=None)
settings.load_profile("qsa")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Written into int32 buffers before a launch so an element a kernel leaves unwritten fails a test.
INT_POISON = -7_777_777


@functools.cache
def _triton_interpreted() -> bool:
    """Whether this process's Triton kernels are interpreter functions (checked on a real one)."""
    from triton.runtime.interpreter import InterpretedFunction

    from qsa_kernels.lse_merge.triton import _lse_merge_kernel

    return isinstance(_lse_merge_kernel, InterpretedFunction)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Give every test that takes ``kernel_device`` its one device."""
    if "kernel_device" not in metafunc.fixturenames:
        return
    if _triton_interpreted():
        device = pytest.param("cpu", id="interpreter")
    else:
        device = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)
    metafunc.parametrize("kernel_device", [device])


@pytest.fixture(scope="session")
def interpreter_device() -> str:
    """``"cpu"`` for tests that only run under Triton's interpreter; skips where Triton compiles."""
    if not _triton_interpreted():
        pytest.skip("Triton compiles for CUDA here (TRITON_INTERPRET is not 1)")
    return "cpu"


@pytest.fixture
def int_poison() -> int:
    """The int32 poison value of :func:`poisoned_int` and :func:`poisoned_empty`."""
    return INT_POISON


@pytest.fixture
def poisoned_int(kernel_device: str) -> Callable[..., torch.Tensor]:
    """Factory: ``poisoned_int(*shape)`` is an int32 tensor on the kernel device of INT_POISON."""

    def make(*shape: int) -> torch.Tensor:
        return torch.full(shape, INT_POISON, dtype=torch.int32, device=kernel_device)

    return make


@pytest.fixture
def poisoned_float(kernel_device: str) -> Callable[..., torch.Tensor]:
    """Factory: ``poisoned_float(*shape)`` is an fp32 tensor on the kernel device full of NaN."""

    def make(*shape: int) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=torch.float32, device=kernel_device)

    return make


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the test runs, torch.empty / empty_like return NaN (floats) or INT_POISON (ints).

    Integer types too narrow for INT_POISON get their largest value, bool gets True.
    """
    real_empty: Callable[..., torch.Tensor] = torch.empty
    real_like: Callable[..., torch.Tensor] = torch.empty_like

    def _poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.fill_(float("nan"))
        if t.dtype == torch.bool:
            return t.fill_(True)
        info = torch.iinfo(t.dtype)  # narrow ints (flags) get their largest value
        return t.fill_(INT_POISON if info.min <= INT_POISON <= info.max else info.max)

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _poison(real_empty(*args, **kwargs))

    def empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _poison(real_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn_workers(script: str, world: int, out_dir: Path) -> None:
    """Run ``python script RANK PORT OUT_DIR`` for every rank at once and wait for all of them.

    The ranks share a fresh TCP port on 127.0.0.1 (gloo over loopback, one OpenMP thread each).
    Only a hang fails them for time (:func:`qsa_pytest.processes.run_together`'s guard, which
    stops a stuck rank with its threads' tracebacks); if any rank hung or exited non-zero the
    test fails with every rank's exit status and output.
    """
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = run_together(
        [[sys.executable, script, str(rank), str(port), str(out_dir)] for rank in range(world)],
        env=env,
    )
    if not all(rank.ok for rank in ranks):
        states = [
            f"rank {r}: {'hung' if f.hung else f'exit {f.returncode}'}" for r, f in enumerate(ranks)
        ]
        logs = "\n---\n".join(f.output for f in ranks)
        pytest.fail(f"workers of {script!r} failed ({', '.join(states)}):\n{logs}")


@pytest.fixture(scope="session")
def spawn_workers() -> Callable[[str, int, Path], None]:
    """``spawn_workers(script, world, out_dir)``: run every rank, fail on any failure."""
    return _spawn_workers


def _group_runs(script: str, world: int, out_dir: Path) -> dict[tuple[int, int, str], Any]:
    """Run every rank (:func:`_spawn_workers`) and read each ``rankR.json`` of
    ``{"N/case": result}`` as ``{(N, R, case): result}``."""
    _spawn_workers(script, world, out_dir)
    out = {}
    for rank in range(world):
        for key, result in json.loads((out_dir / f"rank{rank}.json").read_text()).items():
            n, case = key.split("/", 1)
            out[int(n), rank, case] = result
    return out


@pytest.fixture(scope="session")
def group_runs() -> Callable[[str, int, Path], dict[tuple[int, int, str], Any]]:
    """``group_runs(script, world, out_dir)``: every rank's results of each group size and case,
    as ``{(N, rank, case): result}`` (the workers write ``{"N/case": result}``)."""
    return _group_runs
