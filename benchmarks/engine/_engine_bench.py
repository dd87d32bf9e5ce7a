"""What the engine benchmarks share: the report's machine line, numbers from an engine's log, and
timing a batch's decode in a real engine from SGLang's log.

``B`` requests of one prompt length generate greedy tokens concurrently; SGLang's own
``Decode batch`` log lines (tokens over wall time, every ``--decode-log-interval`` steps) give the
decode rate while all ``B`` decode. Engines start side by side (:func:`start_all`) and each serves
one unmeasured request first (:func:`warm_up`), so no cell pays for compiling a kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from _trace import summarize

__all__ = (
    "PREFILL_GRAPHS",
    "SCHEDULES",
    "SKIPPED",
    "Cell",
    "HotCacheUse",
    "Served",
    "first_difference",
    "host_facts",
    "hot_cache_counters",
    "hot_cache_use",
    "lacks_cuda",
    "log_numbers",
    "measure",
    "mem_fraction",
    "pinned_to_device_rate",
    "pool_tokens",
    "profile_args",
    "profile_cells",
    "profile_decode",
    "profile_request",
    "schedule_arg",
    "scheduling",
    "send_together",
    "start_all",
    "warm_up",
    "write_json",
)

#: Exit status of a benchmark that cannot run here (no CUDA device).
SKIPPED = 77

#: ``--prefill-graphs``: SGLang's ``--cuda-graph-backend-prefill`` in every arm. ``breakable``
#: (SGLang's default on CUDA: the layers between attentions replay as captured graphs, the
#: attention runs eagerly) or ``disabled`` (an eager prefill, as every run before the
#: twenty-ninth session).
PREFILL_GRAPHS = ("breakable", "disabled")
#: ``--schedule``: SGLang's overlap scheduling (its default; the next batch launches before the
#: last one's result is processed) or ``serial`` (``--disable-overlap-schedule``, as every run
#: before the offload served overlap scheduling).
SCHEDULES = ("overlap", "serial")


def schedule_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--schedule`` (:data:`SCHEDULES`), read by :func:`scheduling`."""
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=SCHEDULES[0],
        help="SGLang's scheduling in every arm",
    )


def scheduling(schedule: str) -> dict[str, bool]:
    """SGLang's server arguments of a :data:`SCHEDULES` value."""
    return {"disable_overlap_schedule": schedule == "serial"}


_DECODE_LINE = re.compile(
    r"Decode batch.*?#running-req: (\d+),.*?gen throughput \(token/s\): ([0-9.]+)"
)


_POOL = re.compile(r"max_total_num_tokens=(\d+)")


def pool_tokens(engine: Any) -> int:
    """The token capacity SGLang sized the engine's pools to (``max_total_num_tokens``)."""
    return log_numbers(engine, _POOL)[0]


def lacks_cuda(script: str) -> bool:
    """True, after saying so on stderr, when this machine has no CUDA device for ``script``."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"{script}: needs a CUDA device; skipped", file=sys.stderr)
    return True


@dataclasses.dataclass
class Cell:
    """One (context, batch) measurement of one engine.

    Attributes:
        arm: the engine's name in the benchmark.
        context: prompt tokens per request.
        batch: concurrent requests.
        decode_tokens_per_s: median of SGLang's ``gen throughput`` while all ``batch`` decode.
        wall_s: the batch's wall time, prefill included.
        prefill_tokens_per_s: batch 1 only: prompt tokens over the wall time less the decode.
        output_ids: the first request's greedy tokens.
    """

    arm: str
    context: int
    batch: int
    decode_tokens_per_s: float
    wall_s: float
    prefill_tokens_per_s: float | None
    output_ids: list[int]


@dataclasses.dataclass(frozen=True)
class Served:
    """``batch`` requests sent to one engine at once, and what its log said meanwhile.

    Attributes:
        replies: each request's generation, in the order sent.
        wall_s: from sending the first to the last reply.
        decode_lines: ``(running requests, gen throughput tok/s)`` of each of SGLang's
            ``Decode batch`` log lines while they ran.
    """

    replies: list[Any]
    wall_s: float
    decode_lines: list[tuple[int, float]]

    @property
    def most_running(self) -> int:
        """The most requests SGLang decoded in one step (0 without a ``Decode batch`` line)."""
        return max((n for n, _ in self.decode_lines), default=0)


def _requests(engine: Any, context: int, batch: int, new_tokens: int) -> list[Any]:
    """``batch`` greedy requests of ``context`` prompt tokens (seeds 100, 101, ...)."""
    from qsa_testing import GenerateRequest

    model = engine.config.model
    return [
        GenerateRequest(model.prompt(context, seed=100 + i), new_tokens, top_logprobs=0)
        for i in range(batch)
    ]


def send_together(
    engine: Any, context: int, batch: int, new_tokens: int, arm: str, *, timeout: float = 1800.0
) -> Served:
    """Send ``batch`` prompts of ``context`` tokens (seeds 100, 101, ...) at once; wait for all.

    Raises:
        RuntimeError: a request got no reply (naming the arm, batch and context).
    """
    requests = _requests(engine, context, batch, new_tokens)
    mark = engine.log_path.stat().st_size
    replies: list[Any] = [None] * batch

    def run(i: int) -> None:
        replies[i] = engine.generate(requests[i], timeout=timeout)

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    if any(r is None for r in replies):
        msg = f"{arm}: a request of the {batch} x {context}-token batch got no reply"
        raise RuntimeError(msg)
    with engine.log_path.open("rb") as log:
        log.seek(mark)
        text = log.read().decode("utf-8", "replace")
    lines = [(int(n), float(r)) for n, r in _DECODE_LINE.findall(text)]
    return Served(replies, wall, lines)


def measure(engine: Any, context: int, batch: int, new_tokens: int, arm: str) -> Cell:
    """Serve ``batch`` prompts of ``context`` tokens at once; time the decode from the log."""
    served = send_together(engine, context, batch, new_tokens, arm)
    rates = [rate for n, rate in served.decode_lines if n == batch]
    if not rates:
        msg = f"{arm}: no 'Decode batch' log line with {batch} running requests"
        raise RuntimeError(msg)
    decode = statistics.median(rates[1:] if len(rates) > 2 else rates)  # the first may span prefill
    prefill = None
    if batch == 1:
        prefill_s = served.wall_s - (new_tokens - 1) / decode
        prefill = context / prefill_s if prefill_s > 0 else None
    ids = list(served.replies[0].output_ids)
    return Cell(arm, context, batch, decode, served.wall_s, prefill, ids)


def profile_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--profile CONTEXTxBATCH,...`` and ``--profile-steps N`` (read by
    :func:`profile_cells`)."""
    parser.add_argument(
        "--profile",
        default="",
        help="cells to profile after measuring, CONTEXTxBATCH comma separated (e.g. 32768x8)",
    )
    parser.add_argument("--profile-steps", type=int, default=8, help="decode steps per trace")


def profile_cells(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Turn ``args.profile`` into ``(context, batch)`` pairs, refusing what cannot be traced:
    a malformed cell, or more steps than half of ``args.new_tokens`` (the traced steps must all
    decode)."""
    allowed = "allowed: e.g. 32768x1,32768x8"
    try:
        cells = [tuple(int(x) for x in c.split("x", 1)) for c in args.profile.split(",") if c]
    except ValueError:
        parser.error(f"--profile {args.profile!r} is not allowed; {allowed}")
    if any(len(cell) != 2 or min(cell) < 1 for cell in cells):
        parser.error(f"--profile {args.profile!r} is not allowed; {allowed}")
    args.profile = cells
    if not 1 <= args.profile_steps <= args.new_tokens // 2:
        parser.error(
            f"--profile-steps {args.profile_steps!r} is not allowed; allowed: 1 to "
            f"{args.new_tokens // 2} (half of --new-tokens, so the traced steps all decode)"
        )


def profile_decode(  # noqa: PLR0917 (measure's order, then the trace's)
    engine: Any,
    context: int,
    batch: int,
    new_tokens: int,
    arm: str,
    steps: int,
    out: pathlib.Path,
) -> pathlib.Path:
    """A torch profiler trace of ``steps`` decode steps while ``batch`` requests decode together.

    The batch is sent as in :func:`measure`; once SGLang logs a ``Decode batch`` line with all
    ``batch`` running, ``/start_profile`` records the next ``steps`` steps (Python stacks, torch
    operators, CUDA runtime calls and kernels) into ``out/traces``, so ``new_tokens`` must leave
    ``steps`` steps after that line. Profiled steps run slower: the decode rate comes from
    :func:`measure`, never from here.

    Returns:
        The trace's summary (``_trace.summarize``), ``out/profile-<arm>-<context>-<batch>.txt``;
        the trace itself is ``out/traces/<arm>-<context>-<batch>-*.trace.json.gz``.
    """
    prefix = f"{arm}-{context}-{batch}"
    requests = _requests(engine, context, batch, new_tokens)
    mark = engine.log_path.stat().st_size
    threads = [
        threading.Thread(target=engine.generate, args=(r,), kwargs={"timeout": 1800.0})
        for r in requests
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 1800.0
    while time.monotonic() < deadline:
        with engine.log_path.open("rb") as log:
            log.seek(mark)
            text = log.read().decode("utf-8", "replace")
        if any(int(n) == batch for n, _ in _DECODE_LINE.findall(text)):
            break
        time.sleep(0.05)
    traces = out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    engine.post(
        "/start_profile",
        {
            "output_dir": str(traces),
            "num_steps": steps,
            "activities": ["CPU", "GPU"],
            "with_stack": True,
            "record_shapes": False,
            "profile_prefix": prefix,
        },
    )
    for t in threads:
        t.join()
    summary = out / f"profile-{prefix}.txt"
    summary.write_text(summarize(_written_trace(traces, prefix)), encoding="utf-8")
    return summary


def profile_request(engine: Any, request: Any, out: pathlib.Path, prefix: str) -> pathlib.Path:
    """A torch profiler trace of the scheduler from just before ``request`` to its reply.

    Everything the scheduler does in between is recorded (Python stacks, torch operators, CUDA
    runtime calls and kernels): its scheduling rounds and the request's admission as well as its
    forward steps. Profiled requests run slower: times come from unprofiled ones.

    Returns:
        The trace, ``out/<prefix>-*.trace.json.gz``.
    """
    out.mkdir(parents=True, exist_ok=True)
    engine.post(
        "/start_profile",
        {
            "output_dir": str(out),
            "activities": ["CPU", "GPU"],
            "with_stack": True,
            "record_shapes": False,
            "profile_prefix": prefix,
        },
    )
    try:
        engine.generate(request, timeout=1800.0)
    finally:
        engine.post("/stop_profile", {})
    return _written_trace(out, prefix)


def _written_trace(out: pathlib.Path, prefix: str) -> pathlib.Path:
    """The newest ``out/<prefix>-*.trace.json.gz``, once the scheduler has written it."""
    deadline = time.monotonic() + 120.0  # the scheduler writes the trace when profiling ends
    while not (traces := sorted(out.glob(f"{prefix}-*.trace.json.gz"))):
        if time.monotonic() > deadline:
            msg = f"no trace {prefix}-*.trace.json.gz in {out} 120 s after profiling ended"
            raise RuntimeError(msg)
        time.sleep(0.5)
    return traces[-1]


def start_all(
    configs: Mapping[str, Any], workdir: pathlib.Path, *, together: bool = True
) -> dict[str, Any]:
    """Start one engine per configuration, side by side or (``together=False``) one after the
    other; the first failure is raised once every start has ended (the started ones closed).

    Engines that size their pools at the same moment race for the free memory: start large ones
    one after the other.
    """
    from qsa_testing import start_engine

    boots: dict[str, Any] = {}
    errors: list[BaseException] = []

    def boot(arm: str, config: Any) -> None:
        try:
            boots[arm] = start_engine(config, workdir / arm, timeout=900.0)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=boot, args=item) for item in configs.items()]
    for t in threads:
        t.start()
        if not together:
            t.join()
    for t in threads:
        t.join()
    if errors:
        for engine in boots.values():
            engine.close()
        raise errors[0]
    return dict(sorted(boots.items()))


def warm_up(engines: Mapping[str, Any], context: int) -> None:
    """One request per engine before measuring: a kernel's first use compiles it (Triton, JIT),
    and engines share the compile cache, so whichever ran first would pay for both."""
    for arm, engine in engines.items():
        measure(engine, context, 1, 80, arm)


def first_difference(a: Cell, b: Cell) -> str:
    """``yes`` when both cells chose the same greedy tokens, else where they part."""
    if a.output_ids == b.output_ids:
        return "yes"
    for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids, strict=False)):
        if x != y:
            return f"first differs at token {i}"
    return "lengths differ"


@dataclasses.dataclass(frozen=True)
class HotCacheUse:
    """An offload engine's hot caches over one cell, from its Prometheus counters.

    The QSA offload counts blocks of every K/V head of a layer; DS-Offload counts records of one
    block of one K/V head.

    Attributes:
        steps: decode steps served from the host arena.
        selected: records the decode layers selected, every layer and row.
        fetched: those that missed the hot cache and were read from the host arena.
        record_bytes: K and V bytes of one record.
    """

    steps: int
    selected: int
    fetched: int
    record_bytes: int

    @property
    def hit_rate(self) -> float:
        """Selected records found in the hot cache."""
        return 1.0 - self.fetched / self.selected if self.selected else 1.0

    @property
    def fetched_bytes_per_step(self) -> float:
        """Bytes read from the host arena per decode step (every layer and row)."""
        return self.fetched * self.record_bytes / self.steps if self.steps else 0.0


_HOT_CACHE_COUNTERS = (
    "qsa_hisparse_offload_decode_steps_total",
    "qsa_hisparse_selected_blocks_total",
    "qsa_hisparse_fetched_blocks_total",
)


def hot_cache_counters(engine: Any) -> tuple[int, ...]:
    """The offload engine's decode steps, selected and fetched records so far (``/metrics``)."""
    return tuple(int(engine.metric(name)) for name in _HOT_CACHE_COUNTERS)


def hot_cache_use(engine: Any, before: tuple[int, ...], record_bytes: int) -> HotCacheUse:
    """What the engine's counters gained since ``before`` (:func:`hot_cache_counters`)."""
    steps, selected, fetched = (
        a - b for a, b in zip(hot_cache_counters(engine), before, strict=True)
    )
    return HotCacheUse(steps, selected, fetched, record_bytes)


def pinned_to_device_rate(mib: int = 256, repeats: int = 5) -> float:
    """This machine's pinned host-to-device copy rate, bytes per second (best of ``repeats``
    copies of ``mib`` MiB); the ceiling of an offload's reads from its host arena."""
    import torch

    host = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del host, device
    torch.cuda.empty_cache()
    return mib * 2**20 / best


def log_numbers(engine: Any, pattern: re.Pattern[str]) -> tuple[int, ...]:
    """The integer groups of ``pattern``'s last match in the engine's log.

    Raises:
        RuntimeError: naming the pattern and the log, when nothing matches.
    """
    found = pattern.findall(engine.log_path.read_text(encoding="utf-8", errors="replace"))
    if not found:
        msg = f"no line matching {pattern.pattern!r} in {engine.log_path}"
        raise RuntimeError(msg)
    last = found[-1]
    return tuple(int(x) for x in (last if isinstance(last, tuple) else (last,)))


def mem_fraction(budget_gib: float) -> float:
    """SGLang's ``--mem-fraction-static`` that is ``budget_gib`` of this GPU (a GPU budget:
    SGLang's profiler sizes the pools from it, with no ``--max-total-tokens``).

    Raises:
        SystemExit: naming the budget and the GPU's memory, when it is not a fraction of it.
    """
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    fraction = budget_gib * 2**30 / total
    if not 0 < fraction < 1:
        msg = (
            f"--gpu-budget-gib {budget_gib!r} is not allowed on this GPU of "
            f"{total / 2**30:.1f} GiB; allowed: more than 0 and less than that"
        )
        raise SystemExit(msg)
    return round(fraction, 4)


def host_facts() -> dict[str, Any]:
    """What makes one machine's host-memory traffic differ from another's: the CPU model, its
    logical CPUs, the NUMA nodes, the GPU's NUMA node (``None`` where the system does not say)
    and the host memory, in GiB; and the kernel's boot id (:func:`boot_id`), which tells runs of
    one machine, started once, from runs of another."""
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    nodes = len(list(pathlib.Path("/sys/devices/system/node").glob("node[0-9]*")))
    gpu_node = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)  # the PCI address's parts, as ints
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        text = _read(f"/sys/bus/pci/devices/{bus}/numa_node").strip()
        gpu_node = int(text) if text.lstrip("-").isdigit() and int(text) >= 0 else None
    mem = re.search(r"MemTotal:\s+(\d+) kB", _read("/proc/meminfo"))
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "numa_nodes": nodes,
        "gpu_numa_node": gpu_node,
        "memory_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
        "boot_id": boot_id(),
    }


def boot_id() -> str | None:
    """This machine's boot id (``/proc/sys/kernel/random/boot_id``: new at every boot); None
    where the system does not give one."""
    return _read("/proc/sys/kernel/random/boot_id").strip() or None


def _read(path: str) -> str:
    try:
        return pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def write_json(out: pathlib.Path, name: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``<out>/<name>.json``: the machine, the command line, then ``fields``; return it."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    data = {
        "machine": {
            "gpu": gpu,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "host": host_facts(),
        },
        "command": " ".join(sys.argv),
        **fields,
    }
    (out / f"{name}.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    return data
