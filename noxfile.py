"""Development sessions for the QSA HiSparse workspace.

Common invocations:

    nox -s demo               # the planned memory layout and a CPU walk-through, no GPU needed
    nox -s tests              # CPU tests of every package, each in its own minimal environment
    nox -s "tests(qsa-core)"  # one package
    nox -s lint typecheck     # ruff check + format check; mypy --strict on the libraries
    nox -s gpu-tests          # on a CUDA machine: every GPU test, with the machine's own torch
    nox -s bench              # benchmarks; results land in docs/bench/

CPU sessions install from ``uv.lock`` with ``uv sync --locked --package <member>``, so a package
that imports an undeclared sibling fails its own session. ``gpu-tests`` and ``bench`` use the
interpreter that runs nox and put each package's ``src/`` on ``sys.path``: the GPU machine has torch
and triton but no network, so nothing may be installed there.
"""

from __future__ import annotations

import enum
import os
import pathlib
import shutil
import subprocess
import sys

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


@nox.session(python=PYTHON)
@nox.parametrize("name", [p.value for p in Package], ids=[p.value for p in Package])
def tests(session: nox.Session, name: str) -> None:
    """CPU tests of one package, installed alone with its declared dependencies."""
    package = Package(name)
    _uv_sync(session, "--package", package.value, "--group", "test")
    session.chdir(_package_dir(package))
    session.run("python", "-m", "pytest", *session.posargs)


def _src_path() -> str:
    return os.pathsep.join(str(_package_dir(p) / "src") for p in Package)


@nox.session(name="gpu-tests", python=False)
def gpu_tests(session: nox.Session) -> None:
    """Every GPU test, with this machine's own python, torch and triton; no installs, no downloads.

    ``QSA_REQUIRE_GPU=1`` turns the GPU tests' clean skip into a failure: here a missing device is
    an error, not a reason to pass.
    """
    env = {"PYTHONPATH": _src_path(), "QSA_REQUIRE_GPU": "1", "PYTHONUNBUFFERED": "1"}
    for package in (Package.KERNELS, Package.HOSTCACHE, Package.HISPARSE):
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
    as skipped. ``nox -s bench -- bench_selection ...`` runs a subset by script name.
    """
    out = ROOT / "docs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    python = _bench_python(session)
    env = {"PYTHONPATH": _src_path(), "PYTHONUNBUFFERED": "1"}
    wanted = set(session.posargs)
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
    """The main job on its embedded default: no GPU and no model needed."""
    _uv_sync(session, "--package", Package.HISPARSE.value)
    session.run("qsa-hisparse", "demo", *session.posargs)


# ==== Linting and typing ==========================================================================


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Ruff lint and format check over the whole workspace."""
    _uv_sync(session, "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


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
