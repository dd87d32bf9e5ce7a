"""A real SGLang 0.5.23 server for tests: configured once, started in its own process group.

:func:`start_engine` writes the tiny model, starts ``python -m qsa_testing._host`` (SGLang's own
plugin loading, ``ServerArgs`` and HTTP server, nothing replaced) with the stand-ins the machine
needs, and waits until ``/health`` answers. A CPU engine's server is forked from an engine host
that has imported SGLang once (:mod:`qsa_testing._forkhost`); a CUDA engine's is a fresh
interpreter. :class:`Engine` sends requests over loopback and stops
the whole process group when closed, so no scheduler or detokenizer outlives a test session.
"""

from __future__ import annotations

import array
import base64
import contextlib
import enum
import fcntl
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from qsa_pytest.processes import hang_guard_s
from qsa_sglang_plugin import ENV_ACTIVATION_DIR, ENV_SGLANG_PLUGINS, PLUGIN_NAME, SWITCH_PREFIX
from qsa_testing._errors import EngineConfigError, EngineRequestError, EngineStartError
from qsa_testing._forkhost import HostKey, fork_host
from qsa_testing._host import Children
from qsa_testing._models import TinyModel, TinyModelKind
from qsa_testing._selection_trace import (
    ENV_SELECTION_TRACE,
    SelectionTrace,
    selection_trace_directory,
)
from qsa_testing._starts import StartRecord, record_start
from qsa_testing.standins import (
    APPLIED_MARKER,
    CPU_STANDINS,
    CUDA_STANDINS,
    ENV_STANDINS,
    StandIn,
    boot_directory,
)

__all__ = (
    "ENV_CUDA_GRAPHS",
    "ENV_PLATFORM",
    "Engine",
    "EngineConfig",
    "FrozenArgs",
    "GenerateRequest",
    "Generation",
    "Platform",
    "current_platform",
    "platform_standins",
    "running_engine",
    "start_engine",
)

#: Overrides the platform an engine is configured for (``cpu`` or ``cuda``).
ENV_PLATFORM: Final = "QSA_TESTING_PLATFORM"
#: ``1``: CUDA engines capture CUDA graphs, for decode and, where SGLang captures them, prefill
#: (``0``, the default: eager). A configuration's own ``disable_cuda_graph`` wins.
ENV_CUDA_GRAPHS: Final = "QSA_TESTING_CUDA_GRAPHS"
#: ``SGLANG_PLUGINS`` for an engine without the plugin: an allow-list no entry point matches.
_NO_PLUGINS: Final = "qsa-testing-no-plugins"
_LOG_TAIL_LINES: Final = 60
#: One sample line of the Prometheus text format: ``name{labels} value`` (labels optional).
_SAMPLE: Final = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$", re.M)
#: One ``label="value"`` pair of a sample (values without escaped quotes, as SGLang's are).
_LABEL: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')


class Platform(enum.StrEnum):
    """Where an engine runs."""

    CPU = "cpu"
    CUDA = "cuda"


@functools.cache
def current_platform() -> Platform:
    """``QSA_TESTING_PLATFORM`` if set, else CUDA when torch sees a device, else CPU."""
    forced = os.environ.get(ENV_PLATFORM)
    if forced:
        try:
            return Platform(forced)
        except ValueError:
            allowed = [p.value for p in Platform]
            msg = f"{ENV_PLATFORM}={forced!r} is not allowed; allowed: {allowed!r}"
            raise EngineConfigError(msg) from None
    import torch

    return Platform.CUDA if torch.cuda.is_available() else Platform.CPU


def cuda_graphs_requested() -> bool:
    """Whether ``QSA_TESTING_CUDA_GRAPHS`` asks CUDA engines for decode CUDA graphs."""
    raw = os.environ.get(ENV_CUDA_GRAPHS, "0")
    if raw not in ("0", "1"):
        msg = f"{ENV_CUDA_GRAPHS}={raw!r} is not allowed; allowed: '0', '1'"
        raise EngineConfigError(msg)
    return raw == "1"


class FrozenArgs(Mapping[str, Any]):
    """A read-only, hashable mapping (items kept sorted by key), for configuration values."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None) -> None:
        self._items = tuple(sorted((items or {}).items()))

    def __getitem__(self, key: str) -> Any:
        for name, value in self._items:
            if name == key:
                return value
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple((name, json.dumps(value, sort_keys=True)) for name, value in self._items))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenArgs):
            return self._items == other._items
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"FrozenArgs({dict(self._items)!r})"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine: the model, whether the plugin loads, its switches and server arguments.

    Two equal configurations describe the same engine; ``replica`` tells apart otherwise equal
    ones (two fresh engines that must agree).

    Attributes:
        model: the tiny model to serve.
        plugin: load the ``qsa_hisparse`` entry point (``SGLANG_PLUGINS`` allows only it); when
            False no plugin loads at all (upstream SGLang).
        switches: ``SGLANG_QSA_*`` environment variables for every process of the engine.
        server_args: ``ServerArgs`` fields that override the harness defaults (JSON values).
        standins: stand-ins added to those the platform needs (e.g. a sensitivity check's).
        replica: distinguishes otherwise equal engines.
        trace_selection: record the QSA indexer's eager decode selections in the engine's work
            directory (:meth:`Engine.selection_trace`).
    """

    model: TinyModel
    plugin: bool = True
    switches: Mapping[str, str] = field(default_factory=FrozenArgs)
    server_args: Mapping[str, Any] = field(default_factory=FrozenArgs)
    standins: AbstractSet[StandIn] = frozenset()
    replica: int = 0
    trace_selection: bool = False

    def __post_init__(self) -> None:
        for name, value in self.server_args.items():
            try:
                json.dumps(value)
            except TypeError:
                msg = f"server_args[{name!r}]={value!r} is not JSON-serialisable"
                raise EngineConfigError(msg) from None
        object.__setattr__(self, "switches", FrozenArgs(self.switches))
        object.__setattr__(self, "server_args", FrozenArgs(self.server_args))
        object.__setattr__(self, "standins", frozenset(StandIn(s) for s in self.standins))
        for name, value in self.switches.items():
            if not name.startswith(SWITCH_PREFIX) or not isinstance(value, str):
                msg = (
                    f"switch {name}={value!r} is not allowed; switches are {SWITCH_PREFIX}* "
                    "environment variables with string values"
                )
                raise EngineConfigError(msg)
        if self.switches and not self.plugin:
            msg = f"switches {dict(self.switches)!r} need plugin=True; the plugin is off"
            raise EngineConfigError(msg)
        reserved = {"model_path", "host", "port"} & set(self.server_args)
        if reserved:
            msg = f"server_args {sorted(reserved)!r} are set by the harness; leave them out"
            raise EngineConfigError(msg)

    @property
    def label(self) -> str:
        """A short, filesystem-safe name for logs: model, plugin state, switches, overrides."""
        parts = [self.model.name, "plugin" if self.plugin else "upstream"]
        parts += [f"{k.removeprefix(SWITCH_PREFIX).lower()}={v}" for k, v in self.switches.items()]
        parts += [f"{k}={v}" for k, v in self.server_args.items()]
        parts += sorted(s.value for s in self.standins)
        parts += ["trace_selection"] if self.trace_selection else []
        if self.replica:
            parts.append(f"replica{self.replica}")
        safe = "-".join(parts)
        return "".join(c if c.isalnum() or c in "-_=." else "_" for c in safe)[:120]


#: Seconds a CUDA engine's forward may run before SGLang's watchdog kills its scheduler.
_CUDA_WATCHDOG_S: Final = 3600.0
#: Reads of ``/metrics`` while it answers 500 (:meth:`Engine.metric`), 0.2 s apart.
_METRICS_READS: Final = 5
#: Server arguments every engine gets; a configuration's ``server_args`` override them.
_COMMON_ARGS: Final[Mapping[str, Any]] = {
    "load_format": "dummy",
    "skip_tokenizer_init": True,
    "dtype": "bfloat16",
    "random_seed": 0,
    "context_length": 4096,
    "max_total_tokens": 16384,
    "chunked_prefill_size": 8192,
    "max_running_requests": 4,
    "disable_radix_cache": True,
    "enable_multimodal": False,
    "skip_server_warmup": True,
    "sampling_backend": "pytorch",
    "log_level": "info",
}
_PLATFORM_ARGS: Final[Mapping[Platform, Mapping[str, Any]]] = {
    Platform.CPU: {
        "device": "cpu",
        "attention_backend": "torch_native",
        "disable_cuda_graph": True,
        "mem_fraction_static": 0.3,
    },
    Platform.CUDA: {
        "device": "cuda",
        "attention_backend": "triton",
        "mem_fraction_static": 0.3,
        "cuda_graph_max_bs_decode": 4,
        # A fresh GPU machine's first forward of a Qwen4Exp compiles and autotunes the GDN chunk
        # kernels for five minutes or more; SGLang's watchdog (300 s by default) then kills the
        # scheduler mid-compile. The runs' own deadlines (``nox -s gpu-engine --deadline``) and
        # their stack dumps are what stop a real hang.
        "watchdog_timeout": _CUDA_WATCHDOG_S,
    },
}
_MODEL_ARGS: Final[Mapping[TinyModelKind, Mapping[str, Any]]] = {
    TinyModelKind.QWEN4_EXP: {
        "page_size": 64,
        "mamba_ssm_dtype": "float32",
        "linear_attn_backend": "triton",
    },
    TinyModelKind.LLAMA: {},
}
#: Server arguments of an engine whose model takes images: SGLang's processor needs its tokenizer.
_VISION_ARGS: Final[Mapping[str, Any]] = {"skip_tokenizer_init": False, "enable_multimodal": True}
#: The vision tower's attention per platform: SGLang's SM90 default, FA3, is not in the GPU
#: machine's sglang-kernel (its ``flash_ops`` are trimmed away); Triton's is SGLang's own default
#: below SM90. CPU engines keep SGLang's default.
_PLATFORM_VISION_ARGS: Final[Mapping[Platform, Mapping[str, Any]]] = {
    Platform.CPU: {},
    Platform.CUDA: {"mm_attention_backend": "triton_attn"},
}
#: Stand-ins of every engine: dummy weights that give logprobs varying per step and per prompt.
_COMMON_STANDINS: Final = frozenset({StandIn.DUMMY_WEIGHT_RANGE})
_PLATFORM_STANDINS: Final[Mapping[Platform, frozenset[StandIn]]] = {
    Platform.CPU: _COMMON_STANDINS | CPU_STANDINS,
    Platform.CUDA: _COMMON_STANDINS | CUDA_STANDINS,
}


def platform_standins(platform: Platform) -> frozenset[StandIn]:
    """The stand-ins every engine on ``platform`` gets (a configuration may add more)."""
    return _PLATFORM_STANDINS[platform]


_PLATFORM_ENV: Final[Mapping[Platform, Mapping[str, str]]] = {
    Platform.CPU: {"SGLANG_USE_CPU_ENGINE": "1"},
    Platform.CUDA: {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1"},
}


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One greedy ``/generate`` call by token ids.

    Attributes:
        input_ids: the prompt.
        max_new_tokens: tokens to generate.
        top_logprobs: alternatives returned per generated token (0 for none).
        cache_salt: the request's ``cache_salt`` (prefix caches share only within one salt).
        image_data: one image per placeholder in ``input_ids``, in order (a URL, a path or a
            ``data:`` URL: what SGLang's ``image_data`` takes); empty for a text prompt.
        ignore_eos: generate all ``max_new_tokens`` even past an end-of-sequence token.
        routed_experts: also return the experts each MoE layer routed every generated token's
            forward to (SGLang's ``return_routed_experts``; the server needs
            ``enable_return_routed_experts``): :attr:`Generation.routed_experts`.
    """

    input_ids: tuple[int, ...]
    max_new_tokens: int = 8
    top_logprobs: int = 5
    cache_salt: str | None = None
    image_data: tuple[str, ...] = ()
    ignore_eos: bool = False
    routed_experts: bool = False

    def body(self) -> dict[str, Any]:
        """The JSON body SGLang's ``/generate`` takes."""
        body: dict[str, Any] = {
            "input_ids": list(self.input_ids),
            "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0.0},
            "return_logprob": True,
            "top_logprobs_num": self.top_logprobs,
        }
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        if self.image_data:
            body["image_data"] = list(self.image_data)
        if self.ignore_eos:
            body["sampling_params"]["ignore_eos"] = True
        if self.routed_experts:  # from the prompt's last position: the first token's forward
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = len(self.input_ids) - 1
        return body


@dataclass(frozen=True, slots=True)
class Generation:
    """What a ``/generate`` call returned, in the fields tests compare.

    Attributes:
        output_ids: generated token ids.
        logprobs: natural-log probability of each generated token.
        top_logprobs: per generated token, ``(token_id, logprob)`` of the top alternatives.
        prompt_tokens: prompt length the server counted.
        cached_tokens: prompt tokens the server reported as served from a cache.
        finish_reason: SGLang's finish type (``length``, ``stop``, ...).
        first_token_s: seconds from the server's receipt of the request to its first token, as
            SGLang measures it (``meta_info.first_token_latency``; ``None`` without
            ``--enable-metrics``). Not compared.
        routed_experts: with :attr:`GenerateRequest.routed_experts`, per generated token the
            expert ids of the forward that chose it (the prompt's last position for the first,
            then each decode step), every MoE layer's top-k in layer order, flat; empty
            otherwise. Not compared.
    """

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    first_token_s: float | None = field(default=None, compare=False)
    routed_experts: tuple[tuple[int, ...], ...] = field(default=(), compare=False)

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> Generation:
        """Parse one ``/generate`` reply."""
        meta = reply["meta_info"]
        tops = meta.get("output_top_logprobs") or []
        first = meta.get("first_token_latency")
        output_ids = tuple(int(t) for t in reply["output_ids"])
        return cls(
            output_ids=output_ids,
            logprobs=tuple(float(entry[0]) for entry in meta["output_token_logprobs"]),
            top_logprobs=tuple(
                tuple((int(entry[1]), float(entry[0])) for entry in step or ()) for step in tops
            ),
            prompt_tokens=int(meta["prompt_tokens"]),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            finish_reason=str((meta.get("finish_reason") or {}).get("type")),
            first_token_s=None if first is None else float(first),
            routed_experts=_routed_experts(meta.get("routed_experts"), len(output_ids)),
        )


def _routed_experts(encoded: str | None, tokens: int) -> tuple[tuple[int, ...], ...]:
    """SGLang's ``meta_info.routed_experts`` as one flat tuple of expert ids per token.

    The payload is base64 of int32 ``[tokens, layers, top_k]``; empty when the reply has none.

    Raises:
        EngineRequestError: a payload that does not split into ``tokens`` equal rows.
    """
    if not encoded or not tokens:
        return ()
    ids = array.array("i", base64.b64decode(encoded))
    if sys.byteorder != "little":
        ids.byteswap()
    width, rest = divmod(len(ids), tokens)
    if rest or not width:
        msg = f"routed_experts holds {len(ids)} ids; allowed: a multiple of the {tokens} tokens"
        raise EngineRequestError(msg)
    return tuple(tuple(ids[t * width : (t + 1) * width]) for t in range(tokens))


def sum_samples(text: str, name: str, **labels: str) -> float:
    """Sum the samples of ``name`` in Prometheus text ``text`` that carry every ``labels`` pair."""
    total = 0.0
    for m in _SAMPLE.finditer(text):
        if m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


class ServerProcess(Protocol):
    """The server's main process: a ``subprocess.Popen`` or a fork of an engine host."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Engine:
    """A running SGLang server: requests over loopback, logs in a file, one process group.

    Use :func:`start_engine`; close it (or use it as a context manager) to stop every process.
    """

    def __init__(
        self, config: EngineConfig, process: ServerProcess, port: int, log_path: Path
    ) -> None:
        self.config = config
        self.address = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.start_seconds = 0.0
        self._process = process

    def __enter__(self) -> Engine:
        return self

    def selection_trace(self, *, after: SelectionTrace | None = None) -> SelectionTrace:
        """The QSA indexer's eager decode selections (``config.trace_selection``).

        All so far, or those recorded since ``after`` (an earlier trace of this engine) was read.

        Raises:
            EngineConfigError: the engine was started without ``trace_selection``.
        """
        if not self.config.trace_selection:
            msg = f"engine {self.config.label!r} was started with trace_selection=False"
            raise EngineConfigError(msg)
        return SelectionTrace.read(selection_trace_directory(self.log_path.parent), after=after)

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests -------------------------------------------------------------------------------

    def _call(self, path: str, body: Mapping[str, Any] | None, timeout: float | None) -> bytes:
        timeout = hang_guard_s() if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.address + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                payload: bytes = reply.read()
                return payload
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            msg = f"{path} answered {exc.code}: {detail}; log: {self.log_path}"
            raise EngineRequestError(msg) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            alive = "running" if self._process.poll() is None else "exited"
            msg = (
                f"{path} failed ({exc}); the server is {alive}; log {self.log_path}, tail:\n"
                f"{_tail(self.log_path)}"
            )
            raise EngineRequestError(msg) from None

    def get_text(self, path: str, *, timeout: float | None = None) -> str:
        """``GET path`` and its reply as text (e.g. ``/metrics``)."""
        return self._call(path, None, timeout).decode("utf-8", errors="replace")

    def post(self, path: str, body: Mapping[str, Any], *, timeout: float | None = None) -> bytes:
        """``POST path`` with a JSON body; the reply's raw bytes (some routes answer no JSON).

        ``timeout``: seconds to wait for the reply, default the hang guard.
        """
        return self._call(path, body, timeout)

    def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        """``GET path`` and its JSON reply."""
        return json.loads(self._call(path, None, timeout))

    def post_json(self, path: str, body: Mapping[str, Any], *, timeout: float | None = None) -> Any:
        """``POST path`` with a JSON body and its JSON reply (``timeout``: as :meth:`post`)."""
        return json.loads(self._call(path, body, timeout))

    def generate(self, request: GenerateRequest, *, timeout: float | None = None) -> Generation:
        """One greedy generation (``timeout``: default the hang guard)."""
        reply = self.post_json("/generate", request.body(), timeout=timeout)
        return Generation.from_reply(reply)

    def metric(self, name: str, **labels: str) -> float:
        """The value of Prometheus series ``name`` on ``/metrics``, summed over its label sets.

        ``name`` as exposed (a counter with its ``_total``); ``labels`` keep only the samples that
        carry each of them (``outcome="aborted"``); 0.0 when no sample is there yet. Needs
        ``--enable-metrics``.
        """
        for attempt in range(_METRICS_READS):
            try:
                return sum_samples(self.get_text("/metrics"), name, **labels)
            except EngineRequestError as exc:
                # SGLang's multiprocess Prometheus reader answers 500 while a process it merges
                # has created its value file and not yet written its header (seen at start-up).
                if "answered 500" not in str(exc) or attempt + 1 == _METRICS_READS:
                    raise
                time.sleep(0.2)
        raise AssertionError("unreachable")  # the loop returns or raises

    def flush_cache(self) -> None:
        """``POST /flush_cache``; raises when SGLang refuses it."""
        self._call("/flush_cache", {}, None)

    # ---- logs -----------------------------------------------------------------------------------

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server's log."""
        return _tail(self.log_path, lines)

    def standins_applied(self) -> frozenset[tuple[StandIn, str]]:
        """``(stand-in, module)`` pairs the engine's processes logged as applied."""
        found = set()
        for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            if APPLIED_MARKER in line:
                name, _, rest = line.split(APPLIED_MARKER, 1)[1].strip().partition(" on ")
                found.add((StandIn(name), rest.split(" ", 1)[0]))
        return frozenset(found)

    # ---- lifetime -------------------------------------------------------------------------------

    @property
    def process_group(self) -> int:
        """The id of the process group that holds every process of the server."""
        return self._process.pid

    @property
    def running(self) -> bool:
        """True while the server's main process lives."""
        return self._process.poll() is None

    def close(self, grace: float = 0.0) -> None:
        """Stop the whole process group.

        By default the group is killed at once: a test engine holds nothing a drain would save,
        and SGLang's graceful shutdown costs some 5 s (a drain, or a pause before its crash
        diagnostics when its scheduler goes first). With ``grace`` > 0 the group gets SIGTERM
        and that many seconds before SIGKILL.

        Raises:
            EngineStartError: a process of the group survived SIGKILL.
        """
        pgid = self._process.pid
        if grace > 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
        if grace <= 0 or not _wait_group_gone(pgid, grace):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            if not _wait_group_gone(pgid, 10.0):
                msg = f"processes of group {pgid} survived SIGKILL; log: {self.log_path}"
                raise EngineStartError(msg)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie group leader still counts for killpg; reap it if it is ours.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_group_gone(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return True
        time.sleep(0.2)
    return not _group_alive(pgid)


def _server_args(
    config: EngineConfig, platform: Platform, model_path: Path, port: int
) -> dict[str, Any]:
    args: dict[str, Any] = {**_COMMON_ARGS, **_PLATFORM_ARGS[platform]}
    if platform is Platform.CUDA:
        args["disable_cuda_graph"] = not cuda_graphs_requested()
    args.update(_MODEL_ARGS[config.model.kind])
    if config.model.vision:
        args.update(_VISION_ARGS)
        args.update(_PLATFORM_VISION_ARGS[platform])
    args.update(dict(config.server_args))
    args.update(model_path=str(model_path), host="127.0.0.1", port=port)
    return args


#: Where a CPU engine of several TP ranks is told its NCCL library is: a path that holds none.
_NO_NCCL: Final = "no-nccl-on-cpu/libnccl.so.2"


def _xdist_worker() -> tuple[int, int] | None:
    """``(index, count)`` of this pytest-xdist worker, or None outside xdist."""
    name, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not name or not count or not name.startswith("gw") or not name[2:].isdigit():
        return None
    if not count.isdigit() or int(name[2:]) >= int(count):
        return None
    return int(name[2:]), int(count)


def _cpu_environment(
    tp_size: int,
    workdir: Path,
    cores: AbstractSet[int] | None = None,
    worker: tuple[int, int] | None = None,
) -> dict[str, str]:
    """Where a CPU engine's ranks run, and what several ranks need (nothing for one rank alone).

    - ``SGLANG_CPU_OMP_THREADS_BIND``: the cores given to the engine, split into ``tp_size``
      runs, one per rank, in order (SGLang otherwise wants a NUMA node per rank). Under
      pytest-xdist each worker's engines get that worker's share of the cores (``cores[k::n]``
      for worker ``k`` of ``n``), so two workers' engines never run their OpenMP threads on one
      core, where each would spin waiting for the other; an engine with more ranks than its
      worker's share spreads them over every core instead. One rank on every core of the
      machine is SGLang's own default, and is left to it.
    - ``SGLANG_NCCL_SO_PATH`` at a file that does not exist, for several ranks. SGLang 0.5.23
      turns PyNccl on for every TP group whatever the device, and on a machine with PyPI's CUDA
      torch the NCCL library loads and ``PyNcclCommunicator`` then refuses the CPU device.
      Where the library does not load, PyNccl disables itself, and the CPU all-reduce and
      all-gather run through the group's gloo backend (``torch.distributed``), as on a machine
      without NCCL. Without AMX, SGLang never takes its shared-memory all-reduce (an
      ``sgl_kernel`` CPU op).

    Args:
        tp_size: ``--tp-size``.
        workdir: the engine's directory (the missing library is named under it).
        cores: the machine's CPU ids; default the cores this process may run on.
        worker: ``(index, count)`` of the pytest-xdist worker starting the engine, None for
            none (:func:`_xdist_worker` tells).

    Raises:
        EngineConfigError: fewer cores than ranks.
    """
    ids = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if tp_size < 1 or len(ids) < tp_size:
        msg = (
            f"tp_size={tp_size!r} is not allowed on this CPU: {len(ids)} cores {ids!r}; "
            f"allowed: 1 to {len(ids)}"
        )
        raise EngineConfigError(msg)
    share = ids[worker[0] :: worker[1]] if worker is not None and worker[1] <= len(ids) else ids
    pool = share if len(share) >= tp_size else ids
    env = {}
    if tp_size > 1:
        env["SGLANG_NCCL_SO_PATH"] = str(workdir / _NO_NCCL)
    if tp_size > 1 or pool != ids:
        per_rank, extra = divmod(len(pool), tp_size)
        runs, start = [], 0
        for rank in range(tp_size):
            size = per_rank + (rank < extra)
            runs.append(",".join(str(i) for i in pool[start : start + size]))
            start += size
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(runs)
    return env


#: The module of SGLang's ``sglang.srt.models`` that defines each tiny model's architecture.
_MODEL_MODULES: Final[Mapping[TinyModelKind, str]] = {
    TinyModelKind.QWEN4_EXP: "qwen4_exp",
    TinyModelKind.LLAMA: "llama",
}


@functools.cache
def _sglang_model_modules() -> frozenset[str]:
    """The module names of SGLang's model directory, found without importing SGLang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        msg = "sglang is not importable here; an engine cannot start"
        raise EngineConfigError(msg)
    models = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    return frozenset(p.stem for p in models.glob("*.py") if not p.stem.startswith("_"))


def _disabled_model_archs() -> str:
    """``SGLANG_DISABLED_MODEL_ARCHS`` for every engine: the model modules no tiny model needs.

    SGLang's model registry imports each module of ``sglang.srt.models`` (about 250) in every
    scheduler process, some 10 s of CPU on the 2-core machine, to find the class of one
    architecture; its own switch skips the modules no engine here serves. The tiny models'
    modules and the registry itself are imported as before. One list for every kind of model
    keeps one engine host (:mod:`qsa_testing._forkhost`) serving them all.
    """
    keep = {*_MODEL_MODULES.values(), "registry"}
    return ",".join(sorted(_sglang_model_modules() - keep))


#: What an engine host imports: everything SGLang's server, scheduler and detokenizer import on
#: their way to serving.
HOST_PRELOAD: Final = (
    "qsa_testing._host",
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
)
#: prometheus_client chooses at import whether its values live in files shared by processes
#: (``PROMETHEUS_MULTIPROC_DIR`` set) or in one process; SGLang needs the former.
_METRICS_DIR: Final = "PROMETHEUS_MULTIPROC_DIR"
#: SGLang's switch for ``/health`` sending a one-token generation (default on).
_HEALTH_GENERATION: Final = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


@functools.cache
def _host_metrics_directory() -> str:
    return tempfile.mkdtemp(prefix="qsa-engine-host-metrics-")


def _import_environment(platform: Platform, standins: AbstractSet[StandIn]) -> dict[str, str]:
    """What an engine's processes may read at import.

    This process's environment without the plugin's switches, with the platform's settings, the
    stand-ins and the model modules.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(SWITCH_PREFIX)}
    env.update(_PLATFORM_ENV[platform])
    env["SGLANG_DISABLED_MODEL_ARCHS"] = _disabled_model_archs()
    env[ENV_STANDINS] = ",".join(sorted(s.value for s in standins))
    paths = [str(boot_directory()), *filter(None, [os.environ.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _environment(config: EngineConfig, platform: Platform, workdir: Path) -> dict[str, str]:
    """An engine's whole environment.

    :func:`_import_environment` and what its server reads when it starts: the plugin's entry
    point, switches and activation directory; on the CPU the cores of each rank and the
    metrics directory.
    """
    env = _import_environment(platform, platform_standins(platform) | config.standins)
    # ``/health`` answers without queueing a one-token request: a health request that outlives
    # the client's poll stays in the scheduler, and an engine a test finds busy refuses what
    # needs it idle (``/update_weights_from_disk`` flushes the cache only when idle).
    env[_HEALTH_GENERATION] = "0"
    if platform is Platform.CPU:
        tp_size = int(config.server_args.get("tp_size", 1))
        env.update(_cpu_environment(tp_size, workdir, worker=_xdist_worker()))
        # Emptied first: prometheus_client sums every file it finds there, so a directory kept
        # from an earlier engine in the same workdir would add that engine's counts to this one's.
        metrics = workdir / "metrics"
        shutil.rmtree(metrics, ignore_errors=True)
        metrics.mkdir()
        env[_METRICS_DIR] = str(metrics)
    env.update(dict(config.switches))
    if config.trace_selection:
        traces = selection_trace_directory(workdir)
        shutil.rmtree(traces, ignore_errors=True)  # an earlier engine's records are not this one's
        env[ENV_SELECTION_TRACE] = str(traces)
    env[ENV_SGLANG_PLUGINS] = PLUGIN_NAME if config.plugin else _NO_PLUGINS
    if config.plugin:
        activation = workdir / "activation"
        activation.mkdir(exist_ok=True)
        env[ENV_ACTIVATION_DIR] = str(activation)
    return env


def _host_key(config: EngineConfig, platform: Platform) -> HostKey:
    """The engine host a CPU engine of ``config`` forks from (one per import-time environment)."""
    env = _import_environment(platform, platform_standins(platform) | config.standins)
    env.pop("PYTEST_CURRENT_TEST", None)  # the one variable pytest changes from test to test
    env[_METRICS_DIR] = _host_metrics_directory()
    return HostKey.of(HOST_PRELOAD, env)


def _start_server(
    config: EngineConfig, platform: Platform, launch: Path, env: Mapping[str, str], log_path: Path
) -> ServerProcess:
    """Start ``python -m qsa_testing._host LAUNCH`` in a new session whose group holds the engine.

    On the CPU the server is forked from an engine host, on CUDA it is a fresh interpreter.
    """
    if platform is Platform.CPU:
        host = fork_host(_host_key(config, platform))
        return host.spawn("qsa_testing._host", [str(launch)], env, launch.parent, log_path)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "qsa_testing._host", str(launch)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=launch.parent,
            start_new_session=True,
        )


#: Starts of one engine whose HTTP port another process took between its choice and the bind.
PORT_ATTEMPTS: Final = 3


def start_engine(
    config: EngineConfig,
    workdir: Path,
    *,
    timeout: float | None = None,
    poll: float = 1.0,
    models: Path | None = None,
) -> Engine:
    """Write the model, start the server in a new process group and wait until it is healthy.

    The port is chosen free, but another process (SGLang's own, picking its internal ports) may
    bind it before the server does: a server that stops on that port being taken is started
    again on another, up to :data:`PORT_ATTEMPTS` times, its log kept as
    ``server-port-taken-<n>.log``.

    Args:
        config: the engine.
        workdir: a directory for the model, the log (``server.log``) and the launch record.
        timeout: seconds to wait for ``/health`` to answer 200, per start; default the hang
            guard (:func:`qsa_pytest.processes.hang_guard_s`): a slow start never fails.
        poll: seconds between health checks.
        models: the directory the model is written under (default ``workdir / "models"``).
            Engines given one directory serve one ``--model-path``, as replicas of a
            deployment do (the host prefix cache's namespace names the path).

    Raises:
        EngineStartError: the server exited or did not become healthy in time; the message holds
            the log path and its tail. Nothing of the engine is left running.
    """
    platform = current_platform()
    timeout = hang_guard_s() if timeout is None else timeout
    workdir.mkdir(parents=True, exist_ok=True)
    model_path = config.model.write(workdir / "models" if models is None else models)
    env = _environment(config, platform, workdir)
    log_path = workdir / "server.log"
    attempt = 0
    while True:
        attempt += 1
        port = _free_port()
        args = _server_args(config, platform, model_path, port)
        launch = workdir / "launch.json"
        record = {
            "label": config.label,
            "server_args": args,
            "children": (Children.FORK if platform is Platform.CPU else Children.SPAWN).value,
        }
        launch.write_text(json.dumps(record, indent=1))
        # An engine that sizes its pools from the free memory it measures must not start beside
        # another one: the other's imports and pools would look like its own weights.
        with _start_lock(exclusive=args.get("max_total_tokens") is None):
            started = time.monotonic()
            log_path.write_bytes(b"")
            process = _start_server(config, platform, launch, env, log_path)
            engine = Engine(config, process, port, log_path)
            try:
                _wait_healthy(engine, process, timeout, poll)
            except EngineStartError:
                seconds = time.monotonic() - started
                record_start(StartRecord(config.label, seconds, "stopped", str(log_path)))
                engine.close()
                if attempt == PORT_ATTEMPTS or not _port_was_taken(log_path, port):
                    raise
                log_path.rename(workdir / f"server-port-taken-{attempt}.log")
                continue
            except BaseException:
                engine.close()
                raise
        engine.start_seconds = time.monotonic() - started
        record_start(StartRecord(config.label, engine.start_seconds, "healthy", str(log_path)))
        return engine


#: One lock for every engine start on this machine (all pytest processes, all workers), and the
#: turnstile that keeps a waiting exclusive start from being overtaken by new shared ones.
_START_LOCK: Final = Path(tempfile.gettempdir()) / "qsa-testing-engine-starts.lock"
_START_TURNSTILE: Final = Path(tempfile.gettempdir()) / "qsa-testing-engine-starts.turnstile"


@contextlib.contextmanager
def _start_lock(*, exclusive: bool) -> Iterator[None]:
    """Hold the machine's engine-start lock, shared or ``exclusive``.

    Ordinary starts share it; a start that sizes its pools from the free memory it measures
    (SGLang's ``mem_fraction_static`` with no ``max_total_tokens``) holds it alone, so that no
    other engine starts while it measures.
    """
    with _START_TURNSTILE.open("a") as turnstile, _START_LOCK.open("a") as handle:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _port_was_taken(log_path: Path, port: int) -> bool:
    """Whether the server's log says its HTTP port was in use when it tried to bind it."""
    taken = f"while attempting to bind on address ('127.0.0.1', {port}): address already in use"
    return taken in log_path.read_text(encoding="utf-8", errors="replace")


def _wait_healthy(engine: Engine, process: ServerProcess, timeout: float, poll: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = process.poll()
        if code is not None:
            msg = (
                f"engine {engine.config.label} exited with status {code} before it was healthy; "
                f"log {engine.log_path}, tail:\n{engine.log_tail()}"
            )
            raise EngineStartError(msg)
        try:
            with urllib.request.urlopen(engine.address + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            pass
        time.sleep(poll)
    msg = (
        f"engine {engine.config.label} was not healthy after {timeout:.0f} s; "
        f"log {engine.log_path}, tail:\n{engine.log_tail()}"
    )
    raise EngineStartError(msg)


@contextlib.contextmanager
def running_engine(config: EngineConfig, workdir: Path, **kwargs: Any) -> Iterator[Engine]:
    """:func:`start_engine` as a context manager that always stops the engine."""
    engine = start_engine(config, workdir, **kwargs)
    try:
        yield engine
    finally:
        engine.close()
