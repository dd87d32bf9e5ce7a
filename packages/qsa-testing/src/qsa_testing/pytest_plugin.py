"""Pytest fixtures for real-engine tests.

Enable them with ``pytest_plugins = ["qsa_testing.pytest_plugin"]`` in a top-level conftest.

``engines`` is one :class:`~qsa_testing.EnginePool` for the whole session. When a test fails, the
log path and tail of the engine it used last are attached to its report; at the end the session
lists every engine start and its cost.

It also loads :mod:`qsa_pytest.gpu`, the GPU gate: tests marked ``@pytest.mark.gpu`` skip where
CUDA is absent and fail instead under ``QSA_REQUIRE_GPU=1`` (the GPU sessions).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from qsa_testing._pool import EnginePool

pytest_plugins = ("qsa_pytest.gpu",)

_POOL = pytest.StashKey[EnginePool]()


@pytest.fixture(scope="session")
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnginePool]:
    """Engines shared by every test of the session, each configuration started once."""
    pool = EnginePool(tmp_path_factory.mktemp("engines"))
    request.config.stash[_POOL] = pool
    try:
        yield pool
    finally:
        pool.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Attach the log tail of the engine a failing test used last."""
    report = yield
    pool = item.config.stash.get(_POOL, None)
    if report.failed and pool is not None and pool.last_used is not None:
        engine = pool.last_used
        report.sections.append(
            (f"engine {engine.config.label} ({engine.log_path})", engine.log_tail(80))
        )
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """List every engine start of the session and its cost."""
    pool = terminalreporter.config.stash.get(_POOL, None)
    if pool is None or not pool.starts:
        return
    terminalreporter.section("engine starts")
    for start in pool.starts:
        terminalreporter.write_line(f"{start.seconds:7.1f} s  {start.label}  ({start.log_path})")
    total = sum(start.seconds for start in pool.starts)
    terminalreporter.write_line(f"{total:7.1f} s  in all, {len(pool.starts)} engines")
    terminalreporter.write_line(f"generations served: {pool.report_path}")
