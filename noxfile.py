"""Development sessions for the QSA HiSparse workspace.

Common invocations:

    nox -s demo               # the planned memory layout and a CPU walk-through, no GPU needed
    nox -s tests              # CPU tests of every package, each in its own minimal environment
    nox -s "tests(qsa-core)"  # one package
    nox -s lint typecheck     # ruff check + format check; mypy --strict on the libraries
    nox -s gpu-tests          # on a CUDA machine: every GPU test, with the machine's own torch
    nox -s gpu-engine         # on the GPU machine: real SGLang engines from .gpu-payload wheels
    nox -s bench              # benchmarks; results land in docs/bench/

CPU sessions install from ``uv.lock`` with ``uv sync --locked --package <member>``, so a package
that imports an undeclared sibling fails its own session. ``gpu-tests`` and ``bench`` use the
interpreter that runs nox and put each package's ``src/`` on ``sys.path``: the GPU machine has torch
and triton but no network, so nothing may be installed there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
from typing import IO, Final
from xml.etree import ElementTree

import nox

nox.needs_version = ">=2024.10.9"
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "tests"]

ROOT = pathlib.Path(__file__).parent
PYTHON = (ROOT / ".python-version").read_text().strip()
# Nothing on our machines may download an interpreter: the closed network refuses it anyway, and a
# silent download would hide a missing install step.
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")


class Package(enum.StrEnum):
    """Every workspace member, by distribution name."""

    CORE = "qsa-core"
    KERNELS = "qsa-kernels"
    HOSTCACHE = "qsa-hostcache"
    MM_PREFIX = "qsa-mm-prefix"
    SGLANG_PLUGIN = "qsa-sglang-plugin"
    HISPARSE = "qsa-hisparse"
    TESTING = "qsa-testing"
    PYTEST = "qsa-pytest"


def _package_dir(package: Package) -> pathlib.Path:
    return ROOT / "packages" / package.value


def _uv_sync(session: nox.Session, *args: str) -> None:
    """Install exactly what ``uv.lock`` says into the session's virtualenv."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        f"--python={session.virtualenv.location}",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


# ==== Testing =====================================================================================


#: The generated record of the last full ``nox -s tests`` run: per session its time, test counts
#: and engine starts. README, testing.md, development.md and STATUS quote it.
TEST_RECORD = ROOT / "docs" / "test-suite.md"
#: Where each CPU engine start of a session is recorded (read by :func:`_record_session`); the
#: name is ``qsa_testing.ENV_ENGINE_STARTS``, which the noxfile cannot import.
_ENV_ENGINE_STARTS = "QSA_TESTING_ENGINE_STARTS"
#: pytest-xdist workers per session: one per core, at most 4 (each real engine holds about
#: 4 GiB of host memory, and a worker runs one at a time).
_MAX_TEST_WORKERS = 4


def _test_workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), _MAX_TEST_WORKERS))


@nox.session(python=PYTHON)
@nox.parametrize("name", [p.value for p in Package], ids=[p.value for p in Package])
def tests(session: nox.Session, name: str) -> None:
    """CPU tests of one package, installed alone with its declared dependencies.

    Tests run on one pytest-xdist worker per core, a module at a time on one worker
    (``--dist loadscope``: its module fixtures and engines start once; the modules in the order
    collection gives them, which puts those with real engines first), in the random order of
    pytest-randomly (the seed is printed; ``-- --randomly-seed=N`` repeats an order,
    ``-- -p no:randomly`` keeps the written one). Arguments after ``--`` go to pytest; without
    any, the session's time, counts and engine starts are written to ``docs/test-suite.md``.
    """
    package = Package(name)
    _uv_sync(session, "--package", package.value, "--group", "test")
    record_dir = pathlib.Path(session.create_tmp()).resolve() / "record"
    shutil.rmtree(record_dir, ignore_errors=True)
    record_dir.mkdir(parents=True)
    junit, starts = record_dir / "junit.xml", record_dir / "engine-starts.jsonl"
    workers = _test_workers()
    session.chdir(_package_dir(package))
    started = time.monotonic()
    try:
        session.run(
            "python",
            "-m",
            "pytest",
            f"--numprocesses={workers}",
            "--dist=loadscope",
            "--no-loadscope-reorder",
            f"--junitxml={junit}",
            *session.posargs,
            # Each worker's own torch ops on its share of the cores: OpenMP threads of two
            # workers on one core spin waiting for each other.
            env={
                _ENV_ENGINE_STARTS: str(starts),
                "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // workers)),
            },
        )
    finally:
        if not session.posargs and junit.is_file():
            _record_session(package, time.monotonic() - started, workers, junit, starts)


def _record_session(
    package: Package, seconds: float, workers: int, junit: pathlib.Path, starts: pathlib.Path
) -> None:
    """Write this session's row of :data:`TEST_RECORD`, keeping the other sessions' rows."""
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, f"{junit} holds no testsuite"
    count = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    records = (
        [json.loads(line) for line in starts.read_text().splitlines()] if starts.is_file() else []
    )
    row = _RecordRow(
        package=package.value,
        seconds=round(seconds),
        passed=count["tests"] - count["failures"] - count["errors"] - count["skipped"],
        failed=count["failures"] + count["errors"],
        skipped=count["skipped"],
        workers=workers,
        commit=_git_commit(),
        day=time.strftime("%Y-%m-%d", time.gmtime()),
        engines=tuple(_EngineStart(e["label"], e["outcome"], float(e["seconds"])) for e in records),
    )
    rows = {r.package: r for r in _read_record(TEST_RECORD)}
    rows[row.package] = row
    TEST_RECORD.write_text(_render_record([rows[p.value] for p in Package if p.value in rows]))


@dataclasses.dataclass(frozen=True)
class _EngineStart:
    """One engine start of a session, as ``qsa_testing`` records it."""

    label: str
    outcome: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class _RecordRow:
    """One session's rows of :data:`TEST_RECORD`: its totals and its engine starts."""

    package: str
    seconds: int
    passed: int
    failed: int
    skipped: int
    workers: int
    commit: str
    day: str
    engines: tuple[_EngineStart, ...] = ()


_SESSION_HEADER = (
    "| session | seconds | passed | failed | skipped | engine starts | engine start seconds "
    "| workers | commit | day |"
)
_ENGINE_HEADER = "| session | engine | outcome | seconds to healthy or stopped |"


def _cells(line: str) -> list[str]:
    return [c.strip().strip("`") for c in line.strip().strip("|").split("|")]


def _read_record(path: pathlib.Path) -> list[_RecordRow]:
    """The sessions of an existing record (none if there is no file)."""
    if not path.is_file():
        return []
    rows: dict[str, _RecordRow] = {}
    engines: dict[str, list[_EngineStart]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = _cells(line)
        if not cells[0].startswith("qsa-"):
            continue
        if len(cells) == 10:
            n = [int(c) for c in cells[1:8]]
            rows[cells[0]] = _RecordRow(cells[0], *n[:4], n[6], cells[8], cells[9])
        elif len(cells) == 4:
            engines.setdefault(cells[0], []).append(
                _EngineStart(cells[1], cells[2], float(cells[3]))
            )
    return [dataclasses.replace(r, engines=tuple(engines.get(p, ()))) for p, r in rows.items()]


def _render_record(rows: list[_RecordRow]) -> str:
    lines = [
        "# The test suite, as its last run measured it",
        "",
        "Generated by `nox -s tests`: each session rewrites its own rows after a full run of its "
        "package, on the machine that ran it, and the file is committed after a run. The "
        "figures about the suite elsewhere in these docs are quoted from here. Seconds are the "
        "wall time of the session's pytest run, installs excluded. An engine start is one real "
        "SGLang server started by the tests, to its first healthy answer or to its refusal at "
        "start-up; the xdist workers start theirs side by side, so the starts' seconds add up to "
        "more than the session's. Why each engine exists: "
        "[testing.md](testing.md#the-engines-and-what-they-cost).",
        "",
        _SESSION_HEADER,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.package} | {r.seconds} | {r.passed} | {r.failed} | {r.skipped} "
            f"| {len(r.engines)} | {round(sum(e.seconds for e in r.engines))} | {r.workers} "
            f"| `{r.commit}` | {r.day} |"
        )
    lines.append(
        f"| all | {sum(r.seconds for r in rows)} | {sum(r.passed for r in rows)} "
        f"| {sum(r.failed for r in rows)} | {sum(r.skipped for r in rows)} "
        f"| {sum(len(r.engines) for r in rows)} "
        f"| {round(sum(e.seconds for r in rows for e in r.engines))} | | | |"
    )
    lines += ["", "## Engine starts", "", _ENGINE_HEADER, "| --- | --- | --- | ---: |"]
    for r in rows:
        for e in r.engines:
            lines.append(f"| {r.package} | `{e.label}` | {e.outcome} | {e.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def _git_commit() -> str:
    """The checkout's commit (short), with ``+`` when the tree has changes; ``?`` without git."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return "?"
    if head.returncode != 0:
        return "?"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def _src_path() -> str:
    return os.pathsep.join(str(_package_dir(p) / "src") for p in Package)


@nox.session(name="gpu-tests", python=False)
def gpu_tests(session: nox.Session) -> None:
    """Every GPU test, with this machine's own python, torch and triton; no installs, no downloads.

    ``QSA_REQUIRE_GPU=1`` turns the GPU tests' clean skip into a failure: here a missing device is
    an error, not a reason to pass.
    """
    env = {"PYTHONPATH": _src_path(), "QSA_REQUIRE_GPU": "1", "PYTHONUNBUFFERED": "1"}
    for package in (Package.KERNELS, Package.HOSTCACHE, Package.HISPARSE, Package.PYTEST):
        session.chdir(_package_dir(package))
        session.run(
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            *session.posargs,
            env=env,
            external=True,
        )


# ==== Real engines on the GPU machine =============================================================

#: What ``tools/build_engine_payload.sh`` builds: ``engine/`` (sglang 0.5.23, sglang-kernel 0.4.5
#: and the dependencies the GPU machine lacks) and ``nox/`` (nox itself, to bootstrap this session).
GPU_PAYLOAD = ROOT / ".gpu-payload"
#: Where the payload is installed and the engine runs keep their files on the GPU machine.
_GPU_ENGINE_HOME = pathlib.Path("/tmp/qsa-gpu-engine")
#: Seconds a pytest run gets, after ``--deadline`` is spent, to stop its engines after SIGINT.
_ENGINE_RUN_GRACE = 45.0


def _install_engine_payload(session: nox.Session) -> pathlib.Path:
    """Install ``.gpu-payload/engine`` offline into a target directory, once per payload."""
    wheels = sorted((GPU_PAYLOAD / "engine").glob("*.whl"))
    if not wheels:
        session.error(
            f"no wheels under {GPU_PAYLOAD / 'engine'}: build them where PyPI is reachable with "
            "tools/build_engine_payload.sh and carry .gpu-payload"
        )
    site = _GPU_ENGINE_HOME / "site"
    stamp = site / ".qsa-gpu-payload"
    listing = "".join(f"{w.name} {w.stat().st_size}\n" for w in wheels)
    if stamp.is_file() and stamp.read_text() == listing:
        session.log(f"the payload's {len(wheels)} wheels are already installed in {site}")
        return site
    shutil.rmtree(site, ignore_errors=True)
    session.log(f"installing {len(wheels)} wheels of {GPU_PAYLOAD / 'engine'} into {site}")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
    pip += ["--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--target", str(site)]
    if subprocess.run([*pip, *map(str, wheels)], check=False).returncode != 0:
        session.error(f"pip could not install the payload into {site}; see its output above")
    stamp.write_text(listing)
    return site


def _write_workspace_dists(directory: pathlib.Path) -> None:
    """Write a minimal ``.dist-info`` (name, version, entry points) for every workspace package.

    The packages are served from their ``src/`` on ``PYTHONPATH``, uninstalled; SGLang finds the
    plugin through its ``sglang.srt.plugins`` entry point, and the plugin reads its own version,
    both through ``importlib.metadata``, which needs these records on ``sys.path``.
    """
    shutil.rmtree(directory, ignore_errors=True)
    for package in Package:
        pyproject = tomllib.loads((_package_dir(package) / "pyproject.toml").read_text())
        version_file = _package_dir(package) / pyproject["tool"]["hatch"]["version"]["path"]
        found = re.search(r'^__version__ = "([^"]+)"', version_file.read_text(), re.MULTILINE)
        if found is None:
            raise RuntimeError(f"{version_file} defines no __version__")
        name = package.value.replace("-", "_")
        info = directory / f"{name}-{found.group(1)}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {package.value}\nVersion: {found.group(1)}\n"
        )
        groups = pyproject["project"].get("entry-points", {})
        lines = [
            line
            for group, points in groups.items()
            for line in (f"[{group}]", *(f"{k} = {v}" for k, v in points.items()), "")
        ]
        if lines:
            (info / "entry_points.txt").write_text("\n".join(lines))


#: What ``gpu-engine --groups`` may name: the CUDA stand-ins' tests and each engine test group.
_STANDINS_GROUP = "standins"


def _engine_posargs(
    session: nox.Session,
) -> tuple[pathlib.Path | None, list[str], float, bool, list[str], list[str]]:
    """Parse ``--out DIR``, ``--graphs 0|1|both``, ``--deadline S``, ``--concurrent``,
    ``--groups A,B``.

    Returns the output directory, the graph modes, the deadline in seconds, whether the modes run
    side by side, the groups to run (default: all) and the remaining arguments, which go to pytest.
    """
    out = os.environ.get("OUT") or None
    graphs, deadline, concurrent, rest = ["0", "1"], float("inf"), False, []
    allowed = [_STANDINS_GROUP, *(group for group, _, _ in _ENGINE_TEST_GROUPS)]
    groups = list(allowed)
    args = list(session.posargs)
    while args:
        arg = args.pop(0)
        if arg in ("--out", "--graphs", "--deadline", "--groups") and not args:
            session.error(f"{arg} needs a value")
        if arg == "--out":
            out = args.pop(0)
        elif arg == "--groups":
            groups = [group for group in args.pop(0).split(",") if group]
            unknown = [group for group in groups if group not in allowed]
            if unknown or not groups:
                session.error(f"--groups {unknown or groups!r} not allowed; allowed: {allowed}")
        elif arg == "--graphs":
            value = args.pop(0)
            if value not in ("0", "1", "both"):
                session.error(f"--graphs {value!r} is not allowed; allowed: 0, 1, both")
            graphs = ["0", "1"] if value == "both" else [value]
        elif arg == "--deadline":
            deadline = float(args.pop(0))
        elif arg == "--concurrent":
            concurrent = True
        else:
            rest.append(arg)
    return (pathlib.Path(out) if out else None), graphs, deadline, concurrent, groups, rest


def _pump(stream: IO[str], log: pathlib.Path, echo: bool) -> None:
    with log.open("w", encoding="utf-8") as sink:
        for line in iter(stream.readline, ""):
            sink.write(line)
            sink.flush()
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()


def _bundle_engine_logs(
    basetemps: list[pathlib.Path], extra: list[pathlib.Path], target: pathlib.Path
) -> None:
    """Pack the runs' engine logs, launch records and ``report.json``, and ``extra``, together."""
    with tarfile.open(target, "w:gz") as bundle:
        for basetemp in basetemps:
            for path in sorted(basetemp.rglob("*")):
                if path.name in ("server.log", "launch.json", "report.json") and path.is_file():
                    bundle.add(path, arcname=f"{basetemp.name}/{path.relative_to(basetemp)}")
        for path in extra:
            if path.is_file():
                bundle.add(path, arcname=path.name)


#: The engine tests split into groups that ``--concurrent`` can run side by side: each group's
#: engines are only ever compared with engines of the same group. ``(name, test files, -k
#: expression or None)``, the files run by one pytest; each group runs once per graph mode.
_ENGINE_TEST_GROUPS: Final[tuple[tuple[str, tuple[str, ...], str | None], ...]] = (
    ("qwen", ("tests/test_engine.py",), "not llama"),
    ("llama", ("tests/test_engine.py",), "llama"),
    ("offload", ("tests/test_engine_offload.py",), None),
    ("double_sparsity", ("tests/test_engine_double_sparsity.py",), None),
    ("context_attention", ("tests/test_context_attention.py",), None),
    ("model_compat", ("tests/test_engine_autoround.py", "tests/test_engine_production.py"), None),
)


def _select(pytest_args: list[str], expression: str | None) -> list[str]:
    """``pytest_args`` with ``-k`` narrowed to ``expression`` (and any ``-k`` given)."""
    args, given = list(pytest_args), []
    while "-k" in args:
        at = args.index("-k")
        given.append(args[at + 1])
        del args[at : at + 2]
    expressions = [*given, *([expression] if expression is not None else [])]
    if not expressions:
        return args
    return [*args, "-k", " and ".join(f"({e})" for e in expressions)]


def _engine_environment(session: nox.Session) -> dict[str, str]:
    """Install the engine payload and the workspace records; the environment that runs on them."""
    _GPU_ENGINE_HOME.mkdir(parents=True, exist_ok=True)
    site = _install_engine_payload(session)
    dists = _GPU_ENGINE_HOME / "dists"
    _write_workspace_dists(dists)
    return {
        "PYTHONPATH": os.pathsep.join([str(site), str(dists), _src_path()]),
        "QSA_REQUIRE_GPU": "1",
        "QSA_TESTING_PLATFORM": "cuda",
        "PYTHONUNBUFFERED": "1",
    }


#: ``nox -s gpu-engine-bench -- [NAME] ...``: the engine benchmarks, by name.
ENGINE_BENCHMARKS: Final = {
    "offload": "engine_offload.py",  # offloaded against resident decode and prefill
    "prefix_cache": "engine_prefix_cache.py",  # warm against cold TTFT of the host prefix cache
    "double_sparsity": "engine_double_sparsity.py",  # qsa_ds against triton decode
    "capacity": "engine_capacity.py",  # most concurrent long requests at one GPU budget
    "serving": "engine_serving.py",  # SGLang's own client against real HTTP servers
}


@nox.session(name="gpu-engine-bench", python=False)
def gpu_engine_bench(session: nox.Session) -> None:
    """A benchmark in real engines on the GPU machine: ``offload`` (default), ``prefix_cache``,
    ``double_sparsity``, ``capacity``, ``serving``.

    Installs the engine payload as ``gpu-engine`` does and runs the named script of
    ``benchmarks/engine/`` (:data:`ENGINE_BENCHMARKS`); the other arguments
    after ``--`` go to it (``--contexts``, ``--deadline``, ``--out``, default ``docs/bench``...).
    """
    args = list(session.posargs)
    name = args.pop(0) if args and not args[0].startswith("-") else "offload"
    if name not in ENGINE_BENCHMARKS:
        session.error(f"benchmark {name!r} is not known; allowed: {', '.join(ENGINE_BENCHMARKS)}")
    env = _engine_environment(session)
    script = ROOT / "benchmarks" / "engine" / ENGINE_BENCHMARKS[name]
    if "--out" not in args:
        args += ["--out", str(ROOT / "docs" / "bench")]
    if "--workdir" not in args:
        args += ["--workdir", str(_GPU_ENGINE_HOME / "bench")]
    session.run(sys.executable, str(script), *args, env=env, external=True)


@nox.session(name="gpu-engine", python=False)
def gpu_engine(session: nox.Session) -> None:
    """Real SGLang 0.5.23 engines on the GPU machine: decode CUDA graphs off, then on.

    Installs ``.gpu-payload/engine`` offline (``tools/build_engine_payload.sh`` builds it), runs the
    qsa-testing GPU tests (the CUDA stand-ins), then the plugin's engine tests once per
    ``QSA_TESTING_CUDA_GRAPHS`` value, with this machine's own python, torch and triton.

    Arguments after ``--``: ``--out DIR`` (default ``$OUT``) receives ``junit-standins.xml`` and,
    per graph mode ``G``, ``engine-graphsG.tar.gz`` (each group's pytest output
    ``engine-graphsG-<group>.log``, junit report and ``report.json``, and every engine's log);
    ``--graphs 0|1|both`` (default both); ``--concurrent`` runs every mode and group side by side
    on the one GPU (each with its own Triton cache: engines compared with one another must read
    the autotuning choices of one tuner); ``--groups A,B`` runs only those (``standins`` and the
    engine groups: qwen, llama, offload, double_sparsity, context_attention, model_compat);
    ``--deadline S`` interrupts engine runs still going after S seconds, so their reports and logs
    are still written. Anything else goes to pytest for the
    engine tests, e.g. ``-k upstream_engines``.
    """
    started = time.monotonic()
    out, graphs, deadline, concurrent, groups, pytest_args = _engine_posargs(session)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    env = _engine_environment(session)
    failed = []
    if _STANDINS_GROUP in groups:
        junit = [f"--junitxml={out / 'junit-standins.xml'}"] if out is not None else []
        command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *junit]
        session.log(f"CUDA stand-ins: {' '.join(command)}")
        status = subprocess.run(
            command, cwd=_package_dir(Package.TESTING), env={**os.environ, **env}, check=False
        ).returncode
        if status != 0:
            failed.append(f"qsa-testing GPU tests (pytest status {status})")
    engine_groups = [entry for entry in _ENGINE_TEST_GROUPS if entry[0] in groups]

    # The runs' own logs go into the bundles: the device tool returns at most eight files.
    logs_dir = _GPU_ENGINE_HOME
    runs: list[tuple[str, subprocess.Popen[str], threading.Thread, pathlib.Path]] = []
    for mode in graphs:
        for group, test_files, expression in engine_groups:
            name = f"graphs{mode}-{group}"
            log = logs_dir / f"engine-{name}.log"
            command = [
                sys.executable,
                "-m",
                "pytest",
                *test_files,
                "-p",
                "no:cacheprovider",
                f"--basetemp={_GPU_ENGINE_HOME / f'pytest-{name}'}",
                f"--junitxml={_GPU_ENGINE_HOME / f'junit-engine-{name}.xml'}",
                "-v",
                *_select(pytest_args, expression),
            ]
            run_env = {**os.environ, **env, "QSA_TESTING_CUDA_GRAPHS": mode}
            if concurrent:
                run_env["TRITON_CACHE_DIR"] = str(_GPU_ENGINE_HOME / f"triton-{name}")
            session.log(f"QSA_TESTING_CUDA_GRAPHS={mode}: {' '.join(command)} (log {log})")
            process = subprocess.Popen(
                command,
                cwd=_package_dir(Package.SGLANG_PLUGIN),
                env=run_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            assert process.stdout is not None
            pump = threading.Thread(target=_pump, args=(process.stdout, log, not concurrent))
            pump.start()
            runs.append((name, process, pump, log))
            if not concurrent:
                _finish_engine_run(process, pump, started + deadline)
    for name, process, pump, log in runs:
        status = _finish_engine_run(process, pump, started + deadline)
        if concurrent:
            tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
            session.log(f"{name}, last lines of {log}:\n" + "\n".join(tail))
        if status not in (0, 5):  # 5: the -k given selects none of this group's tests
            failed.append(f"{name} (pytest status {status})")
    if out is not None:
        for mode in graphs:
            names = [f"graphs{mode}-{group}" for group, _, _ in engine_groups]
            _bundle_engine_logs(
                [_GPU_ENGINE_HOME / f"pytest-{n}" for n in names],
                [
                    *(_GPU_ENGINE_HOME / f"junit-engine-{n}.xml" for n in names),
                    *(_GPU_ENGINE_HOME / f"engine-{n}.log" for n in names),
                ],
                out / f"engine-graphs{mode}.tar.gz",
            )
    session.log(f"gpu-engine took {time.monotonic() - started:.0f} s")
    if failed:
        session.error("failed: " + ", ".join(failed))


def _finish_engine_run(
    process: subprocess.Popen[str], pump: threading.Thread, deadline: float
) -> int:
    """Wait for a pytest run; past ``deadline`` interrupt it (pytest then stops its engines)."""
    remaining = deadline - time.monotonic()
    try:
        process.wait(timeout=None if remaining == float("inf") else max(0.0, remaining))
    except subprocess.TimeoutExpired:
        _dump_engine_stacks(process.pid)
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=_ENGINE_RUN_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    pump.join()
    return process.returncode


def _dump_engine_stacks(root: int) -> None:
    """Have every engine process under ``root`` write its threads' stacks to its server log.

    Engine processes are the ``qsa_testing._host`` servers and their children (scheduler,
    detokenizer), each of which registered ``faulthandler`` for ``SIGUSR1`` at start; no other
    process is signalled (``SIGUSR1`` ends a process that did not).
    """
    children: dict[int, list[int]] = {}
    hosts = set()
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
        if b"qsa_testing._host" in cmdline:
            hosts.add(int(entry.name))
    engine, todo, seen = [], [(root, False)], set()
    while todo:
        pid, inside = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        inside = inside or pid in hosts
        if inside:
            engine.append(pid)
        todo.extend((child, inside) for child in children.get(pid, ()))
    for pid in engine:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    if engine:
        print(f"nox > deadline: asked engine processes {engine} for their stacks (server logs)")
        time.sleep(3)  # time for each to write them (its faulthandler does, in the signal handler)


# ==== Benchmarks and demo =========================================================================


#: Exit status of a benchmark that needs hardware this machine lacks (the autotools "skipped" code).
BENCH_SKIPPED = 77


def _bench_python(session: nox.Session) -> str:
    """The interpreter for benchmarks: this one if it has torch, else a synced workspace venv.

    The GPU machine has torch and triton but no uv and no network, so there the interpreter running
    nox is used as it is. A development machine without torch gets ``.nox/bench-env`` from the lock.
    """
    probe = "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)"
    if subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0:
        return sys.executable
    if shutil.which("uv") is None:
        session.error(f"{sys.executable} has no torch and uv is not installed to provide one")
    env_dir = ROOT / ".nox" / "bench-env"
    session.run(
        "uv",
        "sync",
        "--locked",
        "--all-packages",
        "--no-default-groups",
        env={"UV_PROJECT_ENVIRONMENT": str(env_dir)},
        external=True,
    )
    return str(env_dir / "bin" / "python")


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """Run every package's benchmarks; each writes ``<name>.md`` and ``.json`` under docs/bench/.

    A benchmark that needs a GPU exits with status 77 where there is none; the session reports it
    as skipped. ``nox -s bench -- bench_selection ...`` runs a subset by script name;
    ``--out DIR`` writes the reports there instead (on the GPU machine, a folder that comes back:
    each device call copies the working tree, docs/bench included, again).
    """
    parser = argparse.ArgumentParser(prog="nox -s bench --")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "bench")
    parser.add_argument("names", nargs="*")
    args = parser.parse_args(session.posargs)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = _bench_python(session)
    env = {"PYTHONPATH": _src_path(), "PYTHONUNBUFFERED": "1"}
    wanted = set(args.names)
    scripts = sorted(ROOT.glob("packages/*/benchmarks/bench_*.py"))
    chosen = [s for s in scripts if not wanted or s.stem in wanted]
    if not chosen:
        session.error(
            f"no benchmark matched {sorted(wanted)!r}; found {[s.stem for s in scripts]!r}"
        )
    skipped = []
    for script in chosen:
        session.log(f"{script.stem} --out-dir {out}")
        status = subprocess.run(
            [python, str(script), "--out-dir", str(out)], env={**os.environ, **env}, check=False
        ).returncode
        if status == BENCH_SKIPPED:
            skipped.append(script.stem)
        elif status != 0:
            session.error(f"{script.stem} failed with exit status {status}")
    if skipped:
        session.warn(f"skipped for lack of hardware: {', '.join(skipped)}")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The memory plan, then a real SGLang engine with the plugin on the tiny model (CPU is fine).

    On a machine without a GPU the engine needs the test harness's stand-ins for SGLang's
    CUDA-only kernels, so the demo lives in ``qsa-testing`` (``python -m qsa_testing.demo``).
    """
    _uv_sync(session, "--package", Package.TESTING.value)
    session.run("python", "-m", "qsa_testing.demo", *session.posargs)


# ==== Linting and typing ==========================================================================


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Ruff lint and format check over the whole workspace, and declared against real imports.

    ``tools/check_dependencies.py`` fails when a package's source imports a distribution it does
    not declare, declares a workspace package it never imports, or imports another workspace
    package's private module.
    """
    _uv_sync(session, "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", str(ROOT / "tools" / "check_dependencies.py"))


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's sources and tests."""
    _uv_sync(session, "--all-packages", "--group", "typecheck")
    for package in Package:
        session.run(
            "mypy",
            str(_package_dir(package) / "src"),
            str(_package_dir(package) / "tests"),
        )
