"""Pytest fixtures and ordering for real-engine tests.

Enable them with ``pytest_plugins = ["qsa_testing.pytest_plugin"]`` in a top-level conftest.

- ``engines`` is one :class:`~qsa_testing.EnginePool` for the whole session (per worker under
  ``pytest-xdist``); the engines a module started stop when the module ends. When a test fails,
  the log path and tail of the engine it used last are attached to its report.
- ``@pytest.mark.engine(CONFIG)`` names the engine a test drives. Whatever order the tests come in
  (``pytest-randomly`` shuffles them), the tests of one module that drive one engine are moved next
  to each other, blocks in the order their first test came, so each engine starts once per module.
  The reference answers a module compares against come from module fixtures it names in its
  ``REFERENCES`` tuple; those its selected tests use are taken before its first test.
  Modules that use real engines come first: under ``--dist loadscope`` each module runs on one
  worker, so its engines start once, and the long modules start before the short ones.
- Every engine start of the run (pooled or not, on every worker) is appended to one JSON-lines
  file (:data:`~qsa_testing.ENV_ENGINE_STARTS`); the session ends with a table of them.

It also loads :mod:`qsa_pytest.gpu`, the GPU gate: tests marked ``@pytest.mark.gpu`` skip where
CUDA is absent and fail instead under ``QSA_REQUIRE_GPU=1`` (the GPU sessions).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Generator, Iterator

import pytest

from qsa_testing._engine import EngineConfig
from qsa_testing._pool import EnginePool
from qsa_testing._starts import ENV_ENGINE_STARTS, read_starts

pytest_plugins = ("qsa_pytest.gpu",)

_POOL = pytest.StashKey[EnginePool]()
#: The marker that names the engine a test drives.
ENGINE_MARKER = "engine"


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers; on the controlling process, choose the run's engine-start file."""
    config.addinivalue_line(
        "markers",
        f"{ENGINE_MARKER}(config): the EngineConfig this test drives; tests of one engine run "
        "next to each other so that it starts once",
    )
    if not hasattr(config, "workerinput") and not os.environ.get(ENV_ENGINE_STARTS):
        directory = tempfile.mkdtemp(prefix="qsa-engine-starts-")
        os.environ[ENV_ENGINE_STARTS] = os.path.join(directory, "starts.jsonl")  # workers inherit


def _engine_key(item: pytest.Item) -> EngineConfig | None:
    marker = item.get_closest_marker(ENGINE_MARKER)
    if marker is None:
        return None
    (config,) = marker.args
    if not isinstance(config, EngineConfig):
        msg = f"{item.nodeid}: @pytest.mark.{ENGINE_MARKER}({config!r}) needs an EngineConfig"
        raise pytest.UsageError(msg)
    return config


def engine_blocks(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with each module's tests of one engine next to each other, engine modules first.

    Within a module, the tests that drive one engine form a block where the first of them stood
    (unmarked tests form a block too), keeping their order inside it. Modules whose tests use the
    ``engines`` fixture come first, in their order: under ``--dist loadscope`` (one module per
    worker at a time) the longest work starts first and the short modules fill in at the end.
    """
    modules: dict[str, dict[EngineConfig | None, list[pytest.Item]]] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        modules.setdefault(module, {}).setdefault(_engine_key(item), []).append(item)

    def uses_engines(blocks: dict[EngineConfig | None, list[pytest.Item]]) -> bool:
        return any("engines" in getattr(i, "fixturenames", ()) for b in blocks.values() for i in b)

    ordered = sorted(modules.values(), key=lambda blocks: not uses_engines(blocks))
    return [item for blocks in ordered for block in blocks.values() for item in block]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group each module's tests by engine, after any shuffle (``trylast``)."""
    items[:] = engine_blocks(items)


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


#: A module's tuple of the names of its module fixtures that take reference answers (upstream's,
#: say): each is taken before any test of the module runs, if a selected test of the module uses
#: it, so no block of tests has its engine stopped halfway for one.
REFERENCES_ATTRIBUTE = "REFERENCES"


@pytest.fixture(scope="module", autouse=True)
def _references_first(request: pytest.FixtureRequest) -> None:
    """Take the module's declared reference fixtures that its selected tests use, in order."""
    names = getattr(request.module, REFERENCES_ATTRIBUTE, ())
    mine = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    for name in names:
        if any(name in getattr(item, "fixturenames", ()) for item in mine):
            request.getfixturevalue(name)


@pytest.fixture(scope="module", autouse=True)
def _engines_stop_with_their_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each module, stop the engines it left running; their answers stay in the pool.

    No idle engine then holds memory and cores while other modules run.
    """
    yield
    pool = request.config.stash.get(_POOL, None)
    if pool is not None:
        pool.stop_running()


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


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """List every engine start of the run (all workers) and its cost."""
    if hasattr(config, "workerinput"):
        return
    path = os.environ.get(ENV_ENGINE_STARTS)
    starts = read_starts(path) if path else []
    if not starts:
        return
    terminalreporter.section("engine starts")
    for start in starts:
        terminalreporter.write_line(
            f"{start.seconds:7.1f} s  {start.outcome:7}  {start.label}  ({start.log_path})"
        )
    total = sum(start.seconds for start in starts)
    terminalreporter.write_line(f"{total:7.1f} s  in all, {len(starts)} engine starts ({path})")
