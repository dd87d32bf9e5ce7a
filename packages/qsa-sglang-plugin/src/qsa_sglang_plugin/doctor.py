"""Doctor: check this machine and environment before serving, without starting SGLang.

Usage::

    python -m qsa_sglang_plugin.doctor [--tp-size N] [--model-path DIR --gpu-budget-gib G
        --host-budget-gib H --max-running-requests R [--kv-cache-dtype D] [--context-length L]]
    qsa-hisparse doctor ...

Checks installed versions against the supported set, the plugin entry point and
``SGLANG_PLUGINS``, the switches, the fingerprints of every hooked SGLang module, GPU presence and
compute capability (through ``nvidia-smi``), the locked-memory limit (``ulimit -l``) and free host
memory against the prefix-cache budget of the TP ranks on this host, and the NUMA layout. With
``--model-path`` whose ``config.json`` is readable, it also prices the per-rank memory of those
flags (``qsa_core.plan_capacity`` through the plugin's adapter) and prints the plan; with
``SGLANG_QSA_DS_CHANNEL_CONFIG`` set it loads the channel file against that model's layers, heads
and head dim, as start-up will, and prices the label bytes of a token. Prints one
line per check and exits 1 when any check fails (serving would fail), else 0.
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

from qsa_core import (
    CONFIG_JSON_MAX_BYTES,
    CapacityError,
    JSONFileError,
    MemoryPartKind,
    PlacementError,
    format_bytes,
    index_ranks,
    read_json_file,
    render_plan,
)
from qsa_core.cli import gib_bytes
from qsa_sglang_plugin._adapters import capacity_plan_from_sglang
from qsa_sglang_plugin._config_check import SUPPORTED_KV_CACHE_DTYPES, ds_capacity
from qsa_sglang_plugin._errors import (
    ActivationError,
    AdapterError,
    ConfigurationError,
    SwitchError,
)
from qsa_sglang_plugin._fingerprints import pinned_modules, verify_fingerprints
from qsa_sglang_plugin._hooks import HOOKS, REGISTRATIONS
from qsa_sglang_plugin._hostmem import meminfo_bytes
from qsa_sglang_plugin._switches import (
    ENV_DS_CHANNEL_CONFIG,
    ENV_SGLANG_PLUGINS,
    PLUGIN_NAME,
    Switches,
    parse_switches,
)
from qsa_sglang_plugin._versions import SUPPORTED_VERSIONS, installed_versions, version_mismatches

__all__ = ("MIN_COMPUTE_CAPABILITY", "Check", "Status", "main", "plan_check", "run_checks")

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
        verify_fingerprints(HOOKS, registrations=REGISTRATIONS)
    except ActivationError as exc:
        return Check("fingerprints", Status.FAIL, str(exc))
    modules = sorted(pinned_modules(HOOKS, REGISTRATIONS))
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


def _check_memlock(budget: int) -> Check:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else format_bytes(soft)
    if budget == 0:
        return Check("memlock", Status.OK, f"ulimit -l {limit}; prefix cache off")
    if soft != resource.RLIM_INFINITY and soft < budget:
        return Check(
            "memlock",
            Status.FAIL,
            f"ulimit -l is {limit} but the prefix cache pins {format_bytes(budget)} on this host; "
            "raise it (e.g. 'ulimit -l unlimited' or LimitMEMLOCK=infinity)",
        )
    return Check("memlock", Status.OK, f"ulimit -l {limit} >= prefix cache {format_bytes(budget)}")


def _check_host_memory(budget: int) -> Check:
    available = meminfo_bytes("MemAvailable")
    if available is None:
        return Check("host memory", Status.WARN, "MemAvailable not readable from /proc/meminfo")
    if available < budget:
        return Check(
            "host memory",
            Status.FAIL,
            f"{format_bytes(available)} available but the prefix cache needs "
            f"{format_bytes(budget)}",
        )
    return Check(
        "host memory",
        Status.OK,
        f"{format_bytes(available)} available; prefix cache needs {format_bytes(budget)}",
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
        total = meminfo_bytes(f"Node {node.name[4:]} MemTotal", node / "meminfo")
        parts.append(f"{node.name}: cpus {cpus}, {format_bytes(total) if total else '?'}")
    return Check("numa", Status.OK, f"{len(nodes)} node(s); " + "; ".join(parts))


def _model_config(model_path: str) -> dict[str, object]:
    """The checkpoint's ``config.json``, read within :func:`qsa_core.read_json_file`'s bounds.

    Raises:
        JSONFileError: unreadable, not bounded JSON, or not a JSON object (naming the file).
    """
    path = Path(model_path) / "config.json"
    config = read_json_file(path, what="--model-path config", max_bytes=CONFIG_JSON_MAX_BYTES)
    if not isinstance(config, dict):
        msg = f"--model-path config {str(path)!r} holds a {type(config).__name__}, not an object"
        raise JSONFileError(msg)
    return config


def plan_check(
    flags: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> tuple[Check, str | None]:
    """The capacity plan of the operator's flags: a report line and the rendered table.

    ``flags`` holds ``model_path``, ``tp_size``, ``kv_cache_dtype``, ``context_length``,
    ``max_running_requests``, ``gpu_budget_gib`` and ``host_budget_gib`` (the doctor's options);
    ``SGLANG_QSA_CACHE_SHARDING`` in ``environ`` divides the host arena and
    ``SGLANG_QSA_HISPARSE_HOT_BLOCKS`` sizes the hot caches, ``SGLANG_QSA_INDEX_SHARDING`` and
    ``SGLANG_QSA_HISPARSE_VERIFY`` are priced as pool sizing prices them (a malformed switch is
    the switches check's to report; the plan then assumes the defaults).
    """
    try:
        config = _model_config(flags.model_path)
    except JSONFileError as exc:
        return Check("capacity plan", Status.WARN, str(exc)), None
    missing = [
        f"--{name.replace('_', '-')}"
        for name in ("gpu_budget_gib", "host_budget_gib", "max_running_requests")
        if getattr(flags, name) is None
    ]
    if missing:
        return Check("capacity plan", Status.WARN, f"give {', '.join(missing)} to plan"), None
    server_args = argparse.Namespace(
        tp_size=flags.tp_size,
        kv_cache_dtype=flags.kv_cache_dtype,
        page_size=None,
        context_length=flags.context_length,
        max_running_requests=flags.max_running_requests,
    )
    try:
        switches = parse_switches(environ)
        sharding, hot_blocks = switches.cache_sharding, switches.hot_blocks
        index_sharded, verify = switches.index_sharding, switches.verify_offload
    except SwitchError:
        sharding, hot_blocks, index_sharded, verify = 1, None, False, False
    try:
        plan = capacity_plan_from_sglang(
            server_args,
            config,
            flags.gpu_budget_gib,  # bytes: gib_bytes parsed the GiB
            flags.host_budget_gib,
            sharding_size=sharding,
            hot_slots=hot_blocks,
            index_sharded=index_sharded,
            verify=verify,
        )
    except (AdapterError, CapacityError, PlacementError, ValueError) as exc:
        return Check("capacity plan", Status.FAIL, str(exc)), None
    sharded = f", host K/V sharded over {sharding} ranks" if sharding > 1 else ""
    if index_sharded:
        index = plan.resident.part(MemoryPartKind.COMPRESSED_INDEX).nbytes
        ranks = index_ranks(sharding, plan.tp_size)  # D2 alone: every TP rank
        sharded += (
            f", compressed index sharded over {ranks} ranks "
            f"({format_bytes(index)} per rank for the plan's requests)"
        )
    detail = (
        f"{plan.num_requests} x {plan.context_len} tokens at TP{plan.tp_size} "
        f"{plan.kv_dtype.value}{sharded}: offload fits {plan.max_requests_offloaded}, resident "
        f"fits {plan.max_requests_resident} (per rank, GPU {format_bytes(plan.gpu_budget_bytes)}, "
        f"host {format_bytes(plan.host_budget_bytes)})"
    )
    status = Status.OK if plan.max_requests_offloaded >= plan.num_requests else Status.WARN
    return Check("capacity plan", status, detail), render_plan(plan)


def _check_double_sparsity(
    switches: Switches,
    model_path: str | None,
    tp_size: int = 1,
    rows: int | None = None,
    context_len: int | None = None,
) -> Check | None:
    """The channel file against the model and the TP size, as start-up loads it.

    Reports what a token costs one TP rank and what pool sizing will charge (DS-Offload's fixed
    buffers with ``rows``, ``--max-running-requests``, and ``context_len``, ``--context-length``);
    None with double sparsity off.
    """
    ds = switches.double_sparsity
    if ds is None:
        return None
    name = "double sparsity"
    named = f"{ENV_DS_CHANNEL_CONFIG}={ds.channel_config!r}"
    if model_path is None:
        return Check(name, Status.WARN, f"{named} not checked: give --model-path")
    try:
        config = _model_config(model_path)
    except JSONFileError as exc:
        return Check(name, Status.WARN, str(exc))
    from qsa_kernels.double_sparsity import DSConfigError
    from qsa_sglang_plugin._config_check import ds_geometry

    nested = config.get("text_config")
    text = nested if isinstance(nested, dict) and nested else config
    try:
        geometry = ds_geometry(text)
    except ConfigurationError as exc:
        return Check(name, Status.FAIL, str(exc))
    try:
        capacity = ds_capacity(
            text,
            ds,
            tp_size=tp_size,
            rows=rows,
            context_len=context_len,
            verify=switches.verify_offload,
        )
    except DSConfigError as exc:
        return Check(name, Status.FAIL, f"{named} is refused at --tp-size={tp_size}: {exc}")
    except AdapterError as exc:
        return Check(name, Status.FAIL, str(exc))
    rank_heads = capacity.kv_heads
    labels, kv = capacity.label_token_bytes, capacity.kv_token_bytes
    per_rank = f" (each of {tp_size} TP ranks holds {rank_heads})" if tp_size > 1 else ""
    detail = (
        f"{ds.heavy_channel_num} of {geometry.head_dim} channels per KV head for "
        f"{geometry.layers} layers x {geometry.kv_heads} KV heads{per_rank}, "
        f"{ds.heavy_token_num} heavy tokens, dense below "
        f"{ds.sparse_decode_threshold} tokens; labels add {labels} B per token to {kv} B of "
        f"bf16 K/V ({labels / kv:.1%})"
    )
    if ds.offload:
        detail += (
            f"; DS-Offload: the GPU keeps the {labels} B of labels per token ({kv / labels:.1f}x "
            f"fewer bytes than the K/V), the pinned host arena the {kv} B of K/V per token of "
            "every running request's longest context"
        )
    if capacity.price is None:
        detail += "; give --max-running-requests to price DS-Offload's buffers"
    else:
        detail += (
            f"; pool sizing charges {capacity.price.token_bytes} B per token plus "
            f"{format_bytes(capacity.price.fixed_bytes)} fixed"
        )
    return Check(name, Status.OK, detail)


def run_checks(
    environ: Mapping[str, str],
    *,
    tp_size: int = 1,
    plan: Check | None = None,
    model_path: str | None = None,
    max_running_requests: int | None = None,
    context_length: int | None = None,
) -> tuple[Check, ...]:
    """Every check, in report order.

    Args:
        environ: the environment the server would get (switches, ``SGLANG_PLUGINS``).
        tp_size: TP ranks on this host; each pins its own prefix-cache budget.
        plan: the capacity-plan line (:func:`plan_check`), appended last when given.
        model_path: the checkpoint directory, whose ``config.json`` the double-sparsity check
            reads.
        max_running_requests: ``--max-running-requests`` (DS-Offload's buffers are sized by it).
        context_length: ``--context-length`` (None: the model's).
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
        ds = _check_double_sparsity(
            switches, model_path, tp_size, max_running_requests, context_length
        )
        if ds is not None:
            checks.append(ds)
    checks.append(_check_fingerprints())
    checks.append(_check_gpu())
    budget = 0 if switches is None else switches.prefix_cache_bytes * tp_size
    checks.append(_check_memlock(budget))
    checks.append(_check_host_memory(budget))
    checks.append(_check_numa())
    if plan is not None:
        checks.append(plan)
    return tuple(checks)


def build_parser() -> argparse.ArgumentParser:
    """The doctor's arguments; every value is checked here, before any check runs."""
    parser = argparse.ArgumentParser(
        prog="qsa-hisparse doctor", description="Check this machine before serving."
    )
    parser.add_argument(
        "--tp-size", type=int, default=1, help="TP ranks that will run on this host (default 1)"
    )
    parser.add_argument(
        "--model-path", help="local checkpoint directory; its config.json is priced (optional)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=SUPPORTED_KV_CACHE_DTYPES,
        help="as for SGLang (default auto)",
    )
    parser.add_argument("--context-length", type=int, help="tokens per request (default: config)")
    parser.add_argument("--max-running-requests", type=int, help="requests to plan for")
    parser.add_argument(
        "--gpu-budget-gib", type=gib_bytes, help="GPU GiB for KV and state, per rank"
    )
    parser.add_argument("--host-budget-gib", type=gib_bytes, help="pinned host GiB, per rank")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report; 1 when any check fails, else 0."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.tp_size < 1:
        parser.error(f"--tp-size={opts.tp_size!r} is not allowed; allowed: a positive integer")
    plan, table = (None, None) if opts.model_path is None else plan_check(opts)
    checks = run_checks(
        os.environ,
        tp_size=opts.tp_size,
        plan=plan,
        model_path=opts.model_path,
        max_running_requests=opts.max_running_requests,
        context_length=opts.context_length,
    )
    for check in checks:
        sys.stdout.write(f"{check}\n")
    if table is not None:
        sys.stdout.write(table if table.endswith("\n") else f"{table}\n")
    failed = [c.name for c in checks if c.status is Status.FAIL]
    if failed:
        sys.stdout.write(f"serving would fail: {', '.join(failed)}\n")
        return 1
    sys.stdout.write("ready to serve\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
