"""Doctor: check this machine and environment before serving, without starting SGLang.

Usage::

    python -m qsa_sglang_plugin.doctor [--tp-size N]
    qsa-hisparse doctor [--tp-size N]

Checks installed versions against the supported set, the plugin entry point and
``SGLANG_PLUGINS``, the switches, the fingerprints of every hooked SGLang module, GPU presence and
compute capability (through ``nvidia-smi``), the locked-memory limit (``ulimit -l``) and free host
memory against the prefix-cache budget of the TP ranks on this host, and the NUMA layout. Prints
one line per check and exits 1 when any check fails (serving would fail), else 0.
"""

from __future__ import annotations

import argparse
import enum
import importlib.metadata
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from qsa_sglang_plugin._errors import ActivationError, SwitchError
from qsa_sglang_plugin._fingerprints import verify_fingerprints
from qsa_sglang_plugin._hooks import HOOKS
from qsa_sglang_plugin._switches import ENV_SGLANG_PLUGINS, PLUGIN_NAME, Switches, parse_switches
from qsa_sglang_plugin._versions import SUPPORTED_VERSIONS, installed_versions, version_mismatches

__all__ = ("MIN_COMPUTE_CAPABILITY", "Check", "Status", "main", "run_checks")

#: The QSA kernels need bf16 tensor cores (Ampere or newer).
MIN_COMPUTE_CAPABILITY: Final = (8, 0)


class Status(enum.StrEnum):
    """Outcome of one check."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the report."""

    name: str
    status: Status
    detail: str

    def __str__(self) -> str:
        return f"[{self.status.value.upper():>4}] {self.name}: {self.detail}"


def _check_versions() -> Check:
    mismatches = version_mismatches()
    found = installed_versions()
    if mismatches:
        return Check("versions", Status.FAIL, "; ".join(str(m) for m in mismatches))
    listed = ", ".join(f"{d} {found[d]}" for d in SUPPORTED_VERSIONS)
    return Check("versions", Status.OK, f"{listed} (python {found['python']})")


def _check_entry_point(environ: Mapping[str, str]) -> Check:
    eps = [
        ep.value
        for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
        if ep.name == PLUGIN_NAME
    ]
    if len(eps) != 1:
        return Check(
            "plugin",
            Status.FAIL,
            f"entry point {PLUGIN_NAME!r} found {len(eps)} times in group 'sglang.srt.plugins'",
        )
    allowed = [x.strip() for x in environ.get(ENV_SGLANG_PLUGINS, "").split(",") if x.strip()]
    if allowed and PLUGIN_NAME not in allowed:
        return Check(
            "plugin",
            Status.FAIL,
            f"{ENV_SGLANG_PLUGINS}={environ[ENV_SGLANG_PLUGINS]!r} excludes {PLUGIN_NAME!r}; "
            f"allowed: unset, or a list that contains {PLUGIN_NAME!r}",
        )
    return Check("plugin", Status.OK, f"entry point {PLUGIN_NAME} -> {eps[0]}")


def _check_fingerprints() -> Check:
    try:
        verify_fingerprints(HOOKS)
    except ActivationError as exc:
        return Check("fingerprints", Status.FAIL, str(exc))
    modules = sorted({s.module for s in HOOKS})
    return Check("fingerprints", Status.OK, f"{len(modules)} modules match: {', '.join(modules)}")


def _check_gpu() -> Check:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Check("gpu", Status.FAIL, "no NVIDIA driver found (nvidia-smi is not on PATH)")
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("gpu", Status.FAIL, f"nvidia-smi failed: {exc}")
    gpus = [line.split(", ") for line in out.strip().splitlines() if line.strip()]
    if not gpus:
        return Check("gpu", Status.FAIL, "nvidia-smi lists no GPU")
    too_old = []
    for row in gpus:
        major, _, minor = row[-1].partition(".")
        if (int(major), int(minor or 0)) < MIN_COMPUTE_CAPABILITY:
            too_old.append(f"GPU {row[0]} ({row[1]}) has compute capability {row[-1]}")
    listed = "; ".join(f"GPU {r[0]}: {r[1]}, sm {r[-1]}" for r in gpus)
    if too_old:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return Check("gpu", Status.FAIL, f"{'; '.join(too_old)}; supported: >= {need}")
    return Check("gpu", Status.OK, listed)


def _fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _check_memlock(budget: int) -> Check:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else _fmt_bytes(soft)
    if budget == 0:
        return Check("memlock", Status.OK, f"ulimit -l {limit}; prefix cache off")
    if soft != resource.RLIM_INFINITY and soft < budget:
        return Check(
            "memlock",
            Status.FAIL,
            f"ulimit -l is {limit} but the prefix cache pins {_fmt_bytes(budget)} on this host; "
            "raise it (e.g. 'ulimit -l unlimited' or LimitMEMLOCK=infinity)",
        )
    return Check("memlock", Status.OK, f"ulimit -l {limit} >= prefix cache {_fmt_bytes(budget)}")


def _meminfo_bytes(field: str, path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_host_memory(budget: int) -> Check:
    available = _meminfo_bytes("MemAvailable")
    if available is None:
        return Check("host memory", Status.WARN, "MemAvailable not readable from /proc/meminfo")
    if available < budget:
        return Check(
            "host memory",
            Status.FAIL,
            f"{_fmt_bytes(available)} available but the prefix cache needs {_fmt_bytes(budget)}",
        )
    return Check(
        "host memory",
        Status.OK,
        f"{_fmt_bytes(available)} available; prefix cache needs {_fmt_bytes(budget)}",
    )


def _check_numa(root: Path = Path("/sys/devices/system/node")) -> Check:
    nodes = sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    if not nodes:
        return Check("numa", Status.WARN, f"no NUMA information under {root}")
    parts = []
    for node in nodes:
        try:
            cpus = (node / "cpulist").read_text().strip()
        except OSError:
            cpus = "?"
        total = _meminfo_bytes(f"Node {node.name[4:]} MemTotal", node / "meminfo")
        parts.append(f"{node.name}: cpus {cpus}, {_fmt_bytes(total) if total else '?'}")
    return Check("numa", Status.OK, f"{len(nodes)} node(s); " + "; ".join(parts))


def run_checks(environ: Mapping[str, str], *, tp_size: int = 1) -> tuple[Check, ...]:
    """Every check, in report order.

    Args:
        environ: the environment the server would get (switches, ``SGLANG_PLUGINS``).
        tp_size: TP ranks on this host; each pins its own prefix-cache budget.
    """
    checks = [_check_versions(), _check_entry_point(environ)]
    switches: Switches | None
    try:
        switches = parse_switches(environ)
    except SwitchError as exc:
        switches = None
        checks.append(Check("switches", Status.FAIL, str(exc)))
    else:
        if switches.any_on:
            mode = switches.hisparse.value if switches.hisparse else "unset"
            checks.append(
                Check(
                    "switches",
                    Status.OK,
                    f"features {[f.value for f in switches.features]}, mode {mode}, "
                    f"prefix cache {switches.prefix_cache_mb} MiB per TP rank",
                )
            )
        else:
            checks.append(Check("switches", Status.WARN, "every switch is off: the plugin is idle"))
    checks.append(_check_fingerprints())
    checks.append(_check_gpu())
    budget = 0 if switches is None else switches.prefix_cache_bytes * tp_size
    checks.append(_check_memlock(budget))
    checks.append(_check_host_memory(budget))
    checks.append(_check_numa())
    return tuple(checks)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report; 1 when any check fails, else 0."""
    parser = argparse.ArgumentParser(
        prog="qsa-hisparse doctor", description="Check this machine before serving."
    )
    parser.add_argument(
        "--tp-size", type=int, default=1, help="TP ranks that will run on this host (default 1)"
    )
    opts = parser.parse_args(argv)
    if opts.tp_size < 1:
        parser.error(f"--tp-size={opts.tp_size!r} is not allowed; allowed: a positive integer")
    checks = run_checks(os.environ, tp_size=opts.tp_size)
    for check in checks:
        sys.stdout.write(f"{check}\n")
    failed = [c.name for c in checks if c.status is Status.FAIL]
    if failed:
        sys.stdout.write(f"serving would fail: {', '.join(failed)}\n")
        return 1
    sys.stdout.write("ready to serve\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
